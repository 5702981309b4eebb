# %% [markdown]
# # Autotuning a bfloat16 model for an AVX-512 CPU
#
# Convert a model to bfloat16, tune it with MetaSchedule (XGBoost cost model), build it with the
# tuning records and compare it with fp32 in one process. The trial count comes from
# `RELAY_AMP_TUTORIAL_TRIALS` (the test suite runs this with a handful; real tuning uses hundreds
# and keeps its records under `tune_logs/`).

# %%
import os
import tempfile
from pathlib import Path

import numpy as np

import relay_amp
from relay_amp import models, targets
from relay_amp.runtime import run_executable
from relay_amp.tools.bench import benchmark, format_rows

trials = int(os.environ.get("RELAY_AMP_TUTORIAL_TRIALS", "64"))
target = "cpu-avx512-bf16" if targets.host_supports("avx512_bf16") else "cpu"
print(f"tuning for {target} with {trials} trials")

# %% [markdown]
# ## A one-layer BERT-style encoder, converted to bfloat16

# %%
mod = models.bert_encoder(seq_len=8, hidden=64, heads=2, layers=1, vocab=128)
bf16 = relay_amp.to_mixed_precision(mod, "bfloat16")
print(relay_amp.precision_plan(bf16).summary())

# %% [markdown]
# ## Tune
# MetaSchedule explores schedules per operator; relay_amp raises `TuningError` if no trial
# succeeded (MetaSchedule itself would report success with every record failed). On a CPU with
# avx512_bf16 the bf16 matmuls are relay_amp's dot-product kernels (below): MetaSchedule samples
# their register tiles around the tensorized `vdpbf16ps` dot product.

# %%
work_dir = Path(tempfile.mkdtemp()) / "bert-bfloat16"
database = relay_amp.tune(bf16, target, work_dir, trials=trials, trials_per_iter=min(trials, 16))
tensorized = [r for r in database.get_all_tuning_records() if "relay_amp.dot_16x2_bf16" in str(r.trace)]
print(f"{len(tensorized)} of {len(database.get_all_tuning_records())} records are tensorized bf16 kernels")
print(sorted(p.name for p in work_dir.iterdir()))

# %% [markdown]
# ## Build with the records and check the numbers

# %%
executable = relay_amp.build(bf16, target, tune_logs=work_dir)
inputs = models.example_inputs(mod)
tuned_out = run_executable(executable, inputs)[0]
reference = relay_amp.run(mod, inputs)[0]
error = float(np.abs(tuned_out - reference).max() / np.abs(reference).max())
print(f"tuned bfloat16 vs fp32: max relative error {error:.2e}")
assert error < 2e-2

# %% [markdown]
# ## Compare with fp32 in one process
# Speed-ups are ratios measured in the same run; with a handful of trials they mean little.

# %%
print(format_rows(benchmark(mod, ["bfloat16"], target, repeat=5)))

# %% [markdown]
# ## Fast without tuning: relay_amp's dot-product kernels
# `relay_amp.build` needs no records to be fast: untuned operators get relay_amp's rule-based
# schedules, and on targets with avx512_bf16 / VNNI every bf16 or int8 matmul (and NHWC conv) with
# a constant weight goes to a tensorized kernel on `vdpbf16ps` / `vpdpbusd`, its weight packed at
# compile time. Here is a 64x64x64 bf16 matmul kernel (a 1x1 convolution) and the instruction in
# its assembly; compiling it needs no such CPU, running it does.

# %%
import tvm

from relay_amp.backend.cpu import kernels

spec = kernels.ConvSpec(data_shape=(1, 1, 64, 64), kernel_size=(1, 1), out_channels=64)
kernel = kernels.conv2d_nhwc(spec).with_attr("global_symbol", "main")
library = tvm.compile(tvm.IRModule({"main": kernel}), target=targets.get_target("cpu-avx512-bf16"))
assembly = library.mod.inspect_source("asm")
print("vdpbf16ps instructions:", assembly.count("vdpbf16ps"))
assert "vdpbf16ps" in assembly
