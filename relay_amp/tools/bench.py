"""Benchmarks: each dtype variant of one model built, timed and checked against fp32 in one process."""

import contextlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tvm
from tabulate import tabulate
from tvm import relax

from ..backend.fusion import AUTO
from ..compile.build import build
from ..compile.tuning import LOG_FILES, log_dir
from ..errors import MissingDependencyError, OptionError, TuningError
from ..passes.amp import to_mixed_precision
from ..passes.layers import list_layers
from ..passes.quantize import quantize
from ..passes.recast import recast
from ..passes.weight_only import quantize_weights
from ..runtime import flatten_outputs, virtual_machine
from ..targets import host_cores
from . import pytorch
from .calibration import random_batches
from .models import example_inputs
from .peers import ort_quantized, ort_runner, ort_session, rotating_medians

BASELINE = "float32"
QUANTIZED = "int8q"  # calibrated int8 (quantize), beside recast's int8
WEIGHT_ONLY = "int4w"  # bf16 activations (AMP) and int4 weights, packed (quantize_weights)
INT8_OPS = ("relax.nn.conv2d", "relax.matmul")
# --layout: the backend's choice (auto), a data layout to force, or the model's own (keep)
LAYOUTS = {AUTO: AUTO, "NHWC": "NHWC", "NCHW": "NCHW", "keep": None}
RELAY_AMP, ONNXRUNTIME, TORCH = "relay_amp", "onnxruntime", "torch"  # runners
ORT_INT8_STATIC = "int8 (static QDQ)"  # ONNX Runtime's quantized model of the file, as its docs advise for CNNs
ORT_INT8_DYNAMIC = "int8 (dynamic)"  # ... and for transformers


@dataclass(frozen=True)
class BenchRow:
    """One variant of one runner (relay_amp, or ONNX Runtime on the same file): its median latency, speed-up over
    relay_amp fp32 (same run) and output error against relay_amp fp32."""

    dtype: str
    median_ms: float
    speedup: float
    max_rel_error: float
    tuned: bool
    torch_ms: float | None = None
    runner: str = "relay_amp"


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
    if dtype == QUANTIZED:  # per-row scales pay on transformers (no convolutions)
        return quantize(mod, random_batches(mod) if calibration is None else calibration,
                        dynamic_matmuls=not _convolutional(mod))
    return to_mixed_precision(mod, dtype)


def logs_for(tune_logs: str | os.PathLike | None, model: str, dtype: str, target: str) -> Path | None:
    """`tune_logs` where it holds one log, else its MODEL-DTYPE-TARGET log where there is one; None without logs."""
    if tune_logs is None:
        return None
    root = Path(tune_logs)
    if not root.is_dir():
        raise TuningError(f"tuning log directory {root} does not exist")
    if all((root / name).is_file() for name in LOG_FILES):
        return root
    candidate = log_dir(root, model, dtype, target)
    return candidate if candidate.is_dir() else None


def relay_runner(executable: relax.VMExecutable, inputs: Sequence[np.ndarray]) -> Callable[[], object]:
    """A call that runs `executable`'s main on `inputs` (copied to TVM tensors once) and returns its result."""
    vm = virtual_machine(executable)
    args = [tvm.runtime.tensor(np.ascontiguousarray(x)) for x in inputs]
    return lambda: vm["main"](*args)


def benchmark(mod: tvm.IRModule, dtypes: Sequence[str] = ("float32", "bfloat16"), target: str = "cpu",
              tune_logs: str | os.PathLike | None = None, model: str = "model", repeat: int = 10,
              seed: int = 0, *, layout: str = AUTO, torch_twin: str | None = None,
              onnx_file: str | os.PathLike | None = None, calibration: Sequence | None = None, rounds: int = 3,
              fast_math: bool = True) -> list[BenchRow]:
    """Build every dtype variant of `mod` (fp32 always first) and time them in rotating blocks (`rounds` rounds of
    `repeat` runs each) in one process, with errors against fp32.

    `layout` is a key of LAYOUTS (build's conv_layout: "auto" lets the backend choose); `torch_twin` names a
    built-in model whose PyTorch twin (relay_amp.tools.pytorch) is timed for fp32 and bf16 on the same threads;
    `onnx_file` (the file `mod` came from) adds ONNX Runtime's rows: fp32 on it, and with int8q its own int8 model
    of it (static QDQ on the same calibration batches for models with convolutions, else dynamic);
    `calibration` holds int8q's input batches (random ones by default); `fast_math` goes to build.
    """
    order = [BASELINE] + [d for d in dtypes if d != BASELINE]
    if layout not in LAYOUTS:
        raise OptionError(f"unknown benchmark layout {layout!r}; choose one of {list(LAYOUTS)}")
    inputs = example_inputs(mod, seed)
    if calibration is None and QUANTIZED in order:
        calibration = random_batches(mod)
    runners, tuned = {}, {}
    for dtype in order:
        logs = logs_for(tune_logs, model, dtype, target)
        executable = build(variant(mod, dtype, calibration), target, logs, fast_math, LAYOUTS[layout])
        runners[(RELAY_AMP, dtype)] = relay_runner(executable, inputs)
        tuned[(RELAY_AMP, dtype)] = logs is not None
    runners.update(_torch_runners(torch_twin, order))
    with tempfile.TemporaryDirectory() as work_dir:
        if onnx_file is not None:
            runners.update(_ort_runners(Path(onnx_file), _convolutional(mod), order, inputs, calibration,
                                        Path(work_dir)))
        ms = rotating_medians(runners, rounds, repeat)
        outputs = {key: _first_output(run()) for key, run in runners.items() if key[0] != TORCH}
    return _rows(ms, outputs, tuned)


def _convolutional(mod: tvm.IRModule) -> bool:
    return bool(list_layers(mod, ["relax.nn.conv2d"]))


def _torch_runners(twin: str | None, dtypes: Sequence[str]) -> dict[tuple[str, str], Callable[[], object]]:
    if twin is None:
        return {}
    return {(TORCH, d): pytorch.twin_runner(twin, d, host_cores()) for d in dtypes if d in pytorch.TORCH_DTYPES}


def _ort_runners(path: Path, convolutional: bool, dtypes: Sequence[str], inputs: Sequence[np.ndarray],
                 calibration: Sequence | None, work_dir: Path) -> dict[tuple[str, str], Callable[[], object]]:
    """ONNX Runtime on the file in fp32 and, beside int8q, on its own int8 model of the file; a row ONNX Runtime
    fails to make is left out with a warning (relay_amp's rows still stand)."""
    found = {}
    with _peer_failures_warned(f"ONNX Runtime cannot run {path}"):
        found[(ONNXRUNTIME, BASELINE)] = ort_runner(ort_session(path), inputs)
    if QUANTIZED in dtypes:
        dtype = ORT_INT8_STATIC if convolutional else ORT_INT8_DYNAMIC
        with _peer_failures_warned(f"ONNX Runtime cannot make its {dtype} model of {path}"):
            quantized = ort_quantized(path, calibration, convolutional, work_dir)
            found[(ONNXRUNTIME, dtype)] = ort_runner(ort_session(quantized), inputs)
    return found


@contextlib.contextmanager
def _peer_failures_warned(what: str):
    """Turn a peer's failure (any exception but a missing dependency) into a warning saying `what`."""
    try:
        yield
    except MissingDependencyError:
        raise
    except Exception as err:  # ONNX Runtime raises its own types, and its tools Python's
        warnings.warn(f"{what} ({type(err).__name__}: {err}); its row is left out", stacklevel=4)


def _first_output(result) -> np.ndarray:
    return flatten_outputs(result)[0].astype("float64")


def _rows(ms: dict, outputs: dict, tuned: dict) -> list[BenchRow]:
    """One row per relay_amp or ONNX Runtime runner, the PyTorch twin's time beside relay_amp's row of its dtype."""
    base_ms, reference = ms[(RELAY_AMP, BASELINE)], outputs[(RELAY_AMP, BASELINE)]
    return [
        BenchRow(dtype, ms[(runner, dtype)], base_ms / ms[(runner, dtype)],
                 max_relative_error(outputs[(runner, dtype)], reference), tuned.get((runner, dtype), False),
                 ms.get((TORCH, dtype)) if runner == RELAY_AMP else None, runner)
        for runner, dtype in outputs
    ]


def format_rows(rows: Sequence[BenchRow]) -> str:
    """A printable table of benchmark rows (with a runner column when ONNX Runtime ran beside relay_amp, and PyTorch
    columns when any row was compared with PyTorch)."""
    headers = ["dtype", "median ms", "speed-up vs fp32", "max rel error", "tuned"]
    table = [[r.dtype, f"{r.median_ms:.2f}", f"{r.speedup:.2f}x", f"{r.max_rel_error:.2e}", "yes" if r.tuned else "no"]
             for r in rows]
    if any(r.runner != RELAY_AMP for r in rows):
        headers.insert(0, "runner")
        for line, r in zip(table, rows):
            line.insert(0, r.runner)
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
