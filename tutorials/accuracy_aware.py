# %% [markdown]
# # Accuracy-aware mixed precision
#
# `tune_precision` converts a model and, when a metric on real data drops by more than a
# tolerance, keeps the fewest layers in fp32 that bring it back. This tutorial uses the CNN that
# ships with relay_amp, trained on scikit-learn's handwritten digits, and its held-out split.

# %%
import tempfile
from pathlib import Path

import relay_amp
from relay_amp import digits, metrics

images, labels = digits.load_test_split()
data = digits.batches(images, labels, 50)  # (inputs, labels) pairs
model = digits.load_model(batch=50)
print(f"{len(images)} held-out digits; layers: {[layer.name for layer in relay_amp.list_layers(model)]}")

# %% [markdown]
# ## A well-behaved model converts as a whole

# %%
converted, plan, report = relay_amp.tune_precision(model, data, metrics.top1_accuracy, "float16",
                                                   tolerance=0.01, progress=False)
print(report.summary())

# %% [markdown]
# ## A layer whose activations overflow float16
# `load_overflowing_model` scales conv2 by 1e5 and divides after it: exact in fp32, but conv2's
# outputs pass float16's 65504. The search finds that layer and keeps only it in fp32.

# %%
overflowing = digits.load_overflowing_model(batch=50)
converted, plan, report = relay_amp.tune_precision(overflowing, data, metrics.top1_accuracy, "float16",
                                                   tolerance=0.01, progress=False)
print(report.summary())
print(plan.summary())
report.plot(Path(tempfile.mkdtemp()) / "sensitivity.png")

# %% [markdown]
# ## The range guard finds it without any metric
# `calibrate` records each layer's largest |output| on the data; `to_mixed_precision(ranges=...)`
# keeps in fp32 the layers past float16's range (with a margin of 2) and says why in the plan.

# %%
stats = relay_amp.calibrate(overflowing, [x for x, _ in data])
for layer in stats.layers:
    print(layer.index, layer.name, f"{layer.max_abs:.3g}")
guarded = relay_amp.to_mixed_precision(overflowing, "float16", ranges=stats)
print([(e.name, e.dtype, e.reason) for e in relay_amp.precision_plan(guarded).entries if e.reason.startswith("range")])
