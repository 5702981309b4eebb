"""Benchmarks: each dtype variant of one model built, timed and checked against fp32 in one process."""

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tvm
from tabulate import tabulate
from tvm import relax

from ..backend.fusion import AUTO
from ..compile.build import build
from ..compile.tuning import LOG_FILES, log_dir
from ..errors import OptionError, TuningError
from ..passes.amp import to_mixed_precision
from ..passes.layers import list_layers
from ..passes.quantize import quantize
from ..passes.recast import recast
from ..passes.weight_only import quantize_weights
from ..runtime import run_executable, virtual_machine
from ..targets import host_cores
from . import pytorch
from .calibration import random_batches
from .models import example_inputs

BASELINE = "float32"
QUANTIZED = "int8q"  # calibrated int8 (quantize), beside recast's int8
WEIGHT_ONLY = "int4w"  # bf16 activations (AMP) and int4 weights, packed (quantize_weights)
INT8_OPS = ("relax.nn.conv2d", "relax.matmul")
# --layout: the backend's choice (auto), a data layout to force, or the model's own (keep)
LAYOUTS = {AUTO: AUTO, "NHWC": "NHWC", "NCHW": "NCHW", "keep": None}


@dataclass(frozen=True)
class BenchRow:
    """One variant: its median latency, speed-up over fp32 (same run) and output error against fp32."""

    dtype: str
    median_ms: float
    speedup: float
    max_rel_error: float
    tuned: bool
    torch_ms: float | None = None


def max_relative_error(output: np.ndarray, reference: np.ndarray) -> float:
    """The largest absolute difference of `output` from `reference`, relative to the largest |reference|."""
    return float(np.abs(output - reference).max()) / max(float(np.abs(reference).max()), 1e-12)


def variant(mod: tvm.IRModule, dtype: str, calibration: Sequence | None = None) -> tvm.IRModule:
    """The module to benchmark for `dtype`: fp32 as is, float16/bfloat16 through AMP's defaults, int8 by recast,
    int8q by quantize on `calibration` (input batches; random ones by default), with per-row activation scales
    computed at run time for the matmuls of models without convolutions (transformers), int4w as bf16 AMP with
    the constant-weight matmuls' weights int4 (quantize_weights).

    int8 is TVM's recast experiment (convs and matmuls in int8 accumulating in int32, values cast, not
    calibrated), so its error column measures the casts, not a quantized model's accuracy; int8q is calibrated.
    """
    if dtype == BASELINE:
        return mod
    if dtype == "int8":
        return recast(mod, "int8", "int32", ops=INT8_OPS)
    if dtype == WEIGHT_ONLY:
        return quantize_weights(to_mixed_precision(mod, "bfloat16"))
    if dtype == QUANTIZED:
        convolutional = bool(list_layers(mod, ["relax.nn.conv2d"]))  # else a transformer: per-row scales pay
        return quantize(mod, random_batches(mod) if calibration is None else calibration,
                        dynamic_matmuls=not convolutional)
    return to_mixed_precision(mod, dtype)


def _logs_for(tune_logs: str | os.PathLike | None, model: str, dtype: str, target: str) -> Path | None:
    if tune_logs is None:
        return None
    root = Path(tune_logs)
    if not root.is_dir():
        raise TuningError(f"tuning log directory {root} does not exist")
    if all((root / name).is_file() for name in LOG_FILES):
        return root
    candidate = log_dir(root, model, dtype, target)
    return candidate if candidate.is_dir() else None


def _median_ms(executable: relax.VMExecutable, inputs: Sequence[np.ndarray], repeat: int) -> float:
    vm = virtual_machine(executable)
    args = [tvm.runtime.tensor(x) for x in inputs]
    return vm.time_evaluator("main", tvm.cpu(), number=1, repeat=repeat)(*args).median * 1e3


def benchmark(mod: tvm.IRModule, dtypes: Sequence[str] = ("float32", "bfloat16"), target: str = "cpu",
              tune_logs: str | os.PathLike | None = None, model: str = "model", repeat: int = 10,
              seed: int = 0, *, layout: str = AUTO, torch_twin: str | None = None,
              fast_math: bool = True) -> list[BenchRow]:
    """Build and time every dtype variant of `mod` (fp32 always first), with errors against fp32.

    `layout` is a key of LAYOUTS (build's conv_layout: "auto" lets the backend choose); `torch_twin` names a built-in model whose PyTorch twin
    (relay_amp.tools.pytorch) is timed for fp32 and bf16 on the same number of threads; `fast_math` goes to build.
    """
    order = [BASELINE] + [d for d in dtypes if d != BASELINE]
    inputs = example_inputs(mod, seed)
    if layout not in LAYOUTS:
        raise OptionError(f"unknown benchmark layout {layout!r}; choose one of {list(LAYOUTS)}")
    measured = {}
    for dtype in order:
        logs = _logs_for(tune_logs, model, dtype, target)
        executable = build(variant(mod, dtype), target, logs, fast_math, LAYOUTS[layout])
        outputs = run_executable(executable, inputs)
        measured[dtype] = (_median_ms(executable, inputs, repeat), outputs[0].astype("float64"), logs is not None)
    base_ms, reference, _ = measured[BASELINE]
    return [
        BenchRow(dtype, ms, base_ms / ms, max_relative_error(out, reference), tuned,
                 _torch_ms(torch_twin, dtype, repeat))
        for dtype, (ms, out, tuned) in measured.items()
    ]


def _torch_ms(twin: str | None, dtype: str, repeat: int) -> float | None:
    if twin is None or dtype not in pytorch.TORCH_DTYPES:
        return None
    return pytorch.time_twin(twin, dtype, host_cores(), repeat=repeat)


def format_rows(rows: Sequence[BenchRow]) -> str:
    """A printable table of benchmark rows (with PyTorch columns when any row was compared with PyTorch)."""
    headers = ["dtype", "median ms", "speed-up vs fp32", "max rel error", "tuned"]
    table = [[r.dtype, f"{r.median_ms:.2f}", f"{r.speedup:.2f}x", f"{r.max_rel_error:.2e}", "yes" if r.tuned else "no"]
             for r in rows]
    if any(r.torch_ms is not None for r in rows):
        headers += ["torch ms", "TVM speed-up vs torch"]
        for line, r in zip(table, rows):
            line += [_optional(r.torch_ms, "{:.2f}"), _optional(r.torch_ms and r.torch_ms / r.median_ms, "{:.2f}x")]
    return tabulate(table, headers=headers)


def _optional(value: float | None, fmt: str) -> str:
    return "" if value is None else fmt.format(value)


def rows_to_json(rows: Sequence[BenchRow], **context) -> str:
    """Benchmark rows and their context (model, target, ...) as JSON."""
    return json.dumps({**context, "rows": [asdict(r) for r in rows]}, indent=1)
