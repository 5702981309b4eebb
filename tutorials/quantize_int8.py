# %% [markdown]
# # Calibrated int8: quantize, the quantization plan, and the kernels it runs on
#
# `relay_amp.recast(mod, "int8", ...)` casts values and is a speed experiment. `relay_amp.quantize`
# calibrates: it runs the fp32 model on a few input batches, records a histogram of what each
# conv and matmul reads, picks a clipping threshold per layer (the observer), and makes the layer
# an int8 call on per-channel int8 weights with one multiply by the scales after it. This tutorial
# uses the CNN that ships with relay_amp, trained on scikit-learn's digits, and its held-out split.

# %%
import tempfile
from pathlib import Path

import numpy as np

import relay_amp
from relay_amp import digits, metrics
from relay_amp.runtime import run_executable

images, labels = digits.load_test_split()
data = digits.batches(images, labels, 50)  # (inputs, labels) pairs
model = digits.load_model(batch=50)
calibration, held_out = [inputs for inputs, _ in data[:2]], data[2:]  # 100 images calibrate, 350 test

# %% [markdown]
# ## Quantize on 100 images
# Activations that calibration never saw negative (after a ReLU) become uint8, the operand VNNI's
# `vpdpbusd` takes as it is; the others symmetric int8. Everything not quantized goes through AMP in
# `fallback_dtype` (bfloat16 here: "int8 + bf16 + fp32" in one model).

# %%
quantized = relay_amp.quantize(model, calibration, observer="percentile")
plan = relay_amp.quant_plan(quantized)
print(plan.summary())

# %% [markdown]
# ## Accuracy on the other 350 images, on this CPU's kernels

# %%
target = relay_amp.targets.host_preset()
truth = np.concatenate([y for _, y in held_out])


def accuracy(mod):
    executable = relay_amp.build(mod, target)
    outputs = np.concatenate([run_executable(executable, [x])[0] for x, _ in held_out])
    return metrics.top1_accuracy(outputs, truth)


print(f"fp32 {accuracy(model):.3f}, int8 {accuracy(quantized):.3f} (on {target})")

# %% [markdown]
# ## Edit the plan by hand and apply it again (no calibration)
# A plan is JSON: per layer its dtype, threshold and reason. Setting a layer's dtype to
# `fallback` keeps it out of int8; `apply_quant_plan` re-applies the plan to the same model.

# %%
path = Path(tempfile.mkdtemp()) / "quant_plan.json"
plan.save(path)
edited = relay_amp.QuantPlan.load(path)
first = edited.entries[0]
edited.entries[0] = type(first)(first.index, first.op, first.name, "fallback", 0.0, "kept by hand")
print(relay_amp.quant_plan(relay_amp.apply_quant_plan(model, edited)).summary())
