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

from .amp import to_mixed_precision
from .build import build
from .errors import TuningError
from .models import example_inputs
from .runtime import run_executable
from .tuning import LOG_FILES, log_dir

BASELINE = "float32"


@dataclass(frozen=True)
class BenchRow:
    """One variant: its median latency, speed-up over fp32 (same run) and output error against fp32."""

    dtype: str
    median_ms: float
    speedup: float
    max_rel_error: float
    tuned: bool


def variant(mod: tvm.IRModule, dtype: str) -> tvm.IRModule:
    """The module to benchmark for `dtype`: fp32 as is, float16/bfloat16 through AMP's defaults."""
    return mod if dtype == BASELINE else to_mixed_precision(mod, dtype)


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
    vm = relax.VirtualMachine(executable, tvm.cpu())
    args = [tvm.runtime.tensor(x) for x in inputs]
    return vm.time_evaluator("main", tvm.cpu(), number=1, repeat=repeat)(*args).median * 1e3


def benchmark(mod: tvm.IRModule, dtypes: Sequence[str] = ("float32", "bfloat16"), target: str = "cpu",
              tune_logs: str | os.PathLike | None = None, model: str = "model", repeat: int = 10,
              seed: int = 0) -> list[BenchRow]:
    """Build and time every dtype variant of `mod` (fp32 always first), with errors against fp32."""
    order = [BASELINE] + [d for d in dtypes if d != BASELINE]
    inputs = example_inputs(mod, seed)
    measured = {}
    for dtype in order:
        logs = _logs_for(tune_logs, model, dtype, target)
        executable = build(variant(mod, dtype), target, logs)
        outputs = run_executable(executable, inputs)
        measured[dtype] = (_median_ms(executable, inputs, repeat), outputs[0].astype("float64"), logs is not None)
    base_ms, reference, _ = measured[BASELINE]
    scale = max(float(np.abs(reference).max()), 1e-12)
    return [
        BenchRow(dtype, ms, base_ms / ms, float(np.abs(out - reference).max()) / scale, tuned)
        for dtype, (ms, out, tuned) in measured.items()
    ]


def format_rows(rows: Sequence[BenchRow]) -> str:
    """A printable table of benchmark rows."""
    table = [(r.dtype, f"{r.median_ms:.2f}", f"{r.speedup:.2f}x", f"{r.max_rel_error:.2e}", "yes" if r.tuned else "no")
             for r in rows]
    return tabulate(table, headers=("dtype", "median ms", "speed-up vs fp32", "max rel error", "tuned"))


def rows_to_json(rows: Sequence[BenchRow], **context) -> str:
    """Benchmark rows and their context (model, target, ...) as JSON."""
    return json.dumps({**context, "rows": [asdict(r) for r in rows]}, indent=1)
