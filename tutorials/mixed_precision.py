# %% [markdown]
# # Mixed precision with relay_amp
#
# This tutorial converts the built-in BERT-style encoder to bfloat16 and float16, reads the
# precision plan, overrides the op lists for one call, keeps a layer in fp32, and re-applies an
# edited plan. Every model runs on the Relax VM on the CPU.

# %%
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

import relay_amp
from relay_amp import models

mod = models.bert_encoder(seq_len=16, layers=2)
inputs = models.example_inputs(mod)
reference = relay_amp.run(mod, inputs)[0]


def relative_error(converted):
    """max |converted - fp32| / max |fp32| on the tutorial's inputs."""
    out = relay_amp.run(converted, inputs)[0]
    return float(np.abs(out - reference).max() / np.abs(reference).max())


# %% [markdown]
# ## The layer index
# Every pass numbers layers the same way: calls of the chosen ops in binding order.

# %%
for layer in relay_amp.list_layers(mod)[:4]:
    print(layer.index, layer.op, layer.name, layer.input_shapes)

# %% [markdown]
# ## Convert with the default lists
# Matmuls run in bfloat16 with float32 accumulation; softmax and layer norm stay in float32.

# %%
bf16 = relay_amp.to_mixed_precision(mod, "bfloat16")
plan = relay_amp.precision_plan(bf16)
print(plan.summary())
print(f"bfloat16 relative error: {relative_error(bf16):.2e}")

# %% [markdown]
# ## Overrides are per call
# Here softmax joins the low-precision list and the first matmul (layer 0) stays in float32.
# The defaults are untouched for the next conversion.

# %%
fp16 = relay_amp.to_mixed_precision(
    mod, "float16", target_dtype_ops=["matmul", "nn.softmax"], excluded_layers=[0]
)
print(relay_amp.list_layers(fp16)[0].input_dtypes, relay_amp.list_layers(fp16)[1].input_dtypes)
print(f"float16 relative error: {relative_error(fp16):.2e}")

# %% [markdown]
# ## Save, edit and re-apply a plan

# %%
workdir = Path(tempfile.mkdtemp())
plan.save(workdir / "plan.json")
edited = relay_amp.PrecisionPlan.load(workdir / "plan.json")
# keep the matmuls of the first encoder block (op calls 0..20) in float32
edited.entries = [
    replace(entry, dtype="float32") if entry.op == "relax.matmul" and entry.index <= 20 else entry
    for entry in edited.entries
]
reapplied = relay_amp.apply_plan(mod, edited)
print(relay_amp.precision_plan(reapplied).summary())
relay_amp.save(reapplied, workdir / "model.json")
assert relative_error(relay_amp.load(workdir / "model.json")) < 2e-2
