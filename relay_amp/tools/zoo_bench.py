"""The zoo benchmark: relay_amp against the runtimes users would pick instead, every zoo model, one process.

For each model, one ONNX file (the TorchScript exporter's) goes to relay_amp and to ONNX Runtime, and the
same torch module runs in PyTorch: eager fp32, and bf16 under autocast (channels_last for CNNs, PyTorch's
best bf16 on CPU), optionally `torch.compile`d. Every runner is timed in rotating blocks (a block of runs of
each in turn, several rounds, the median of the block medians), so a noisy neighbour slows them all alike;
ONNX Runtime's thread pool does not spin, so it does not steal the next runner's cores. Errors are against
PyTorch fp32. The profile of relay_amp's fp32 and bf16 builds names the call groups that are slower in bf16.
"""

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import tvm
from tabulate import tabulate
from tvm import relax

from .. import frontend
from ..backend.cpu.cores import target_core
from ..backend.fusion import AUTO
from ..compile.build import build
from ..errors import OptionError, RelayAmpError, one_line
from ..passes.quantize import realize_qdq
from ..runtime import virtual_machine
from ..serialization import atomic_write_bytes, atomic_write_text
from ..targets import get_target, host_cores
from . import zoo
from .bench import BASELINE, QUANTIZED, max_relative_error, relay_runner, variant
from .metrics import cosine_similarity, top1_agreement
from .peers import ort_quantized, ort_runner, ort_session, rotating_medians
from .profile import ProfileRow, call_times, profile, profile_rows
from .pytorch import channels_last

SLOW_RATIO = 1.1  # a call group this much slower in bf16 than in fp32 is a slow path
SLOW_SHARE = 0.02  # ... when the difference is at least this share of the bf16 inference
PROFILE_RUNS = 15  # profiled runs per variant: with 5, LeViT's softmax read 0.38 -> 0.59 ms once (1.07x in 20)
TORCH_BF16 = "torch bf16"  # autocast, channels_last for CNNs
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8"}
ORT_INT8 = "onnxruntime int8"  # static QDQ for CNNs, dynamic for transformers: ONNX Runtime's own advice
ORT_FILE_INT8 = "relay_amp on ORT's int8 file"  # ONNX Runtime's quantized file, realized by realize_qdq
RELAY_INT8Q = f"relay_amp {QUANTIZED}"  # relay_amp's calibrated int8 runner
INT8_RUNNERS = (RELAY_INT8Q, ORT_INT8, ORT_FILE_INT8)  # the agreement column's order
CALIBRATION_INPUTS = 16
AGREEMENT_INPUTS = 32


@dataclass
class ZooResult:
    """One model: median ms per runner, relative error per runner against PyTorch fp32, bf16 slow paths, the
    int8 runners' agreement with fp32, why the model could not be benchmarked (empty when it was), and why a
    peer's runner could not run (ONNX Runtime's quantizer failing on the file) while the others did."""

    model: str
    ms: dict[str, float] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)
    slow_paths: list[str] = field(default_factory=list)
    agreement: dict[str, float] = field(default_factory=dict)  # int8 runners: top-1 share (CNNs) or min cosine
    failure: str = ""
    peer_failures: dict[str, str] = field(default_factory=dict)  # peer runner -> why it could not run


def _torch_runners(name: str, inputs: list[np.ndarray], compiled: bool,
                   tiny: bool) -> dict[str, Callable[[], torch.Tensor]]:
    module = zoo.torch_module(name, tiny)
    tensors = [torch.from_numpy(x) for x in inputs]
    cnn = zoo.entry(name).kind == "cnn"  # a second copy in channels_last: the conversion works in place
    fast, fast_inputs = channels_last(zoo.torch_module(name, tiny), tensors) if cnn else (module, tensors)

    def eager() -> torch.Tensor:
        with torch.inference_mode():
            return module(*tensors)

    def bf16(model=fast) -> torch.Tensor:
        with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):
            return model(*fast_inputs)

    runners = {"torch fp32": eager, TORCH_BF16: bf16}
    if compiled:
        compiled_model = torch.compile(fast)
        runners["torch.compile bf16"] = lambda: bf16(compiled_model)
    return runners


def _relay_runner_on(executable: relax.VMExecutable) -> Callable[[list[np.ndarray]], np.ndarray]:
    vm = virtual_machine(executable)
    return lambda inputs: _output(vm["main"](*(tvm.runtime.tensor(x) for x in inputs)))


def _ort_runner_on(session) -> Callable[[list[np.ndarray]], np.ndarray]:
    names = [i.name for i in session.get_inputs()]
    return lambda inputs: _output(session.run(None, dict(zip(names, inputs))))


def _int8_agreement(name: str, tiny: bool, fp32: relax.VMExecutable,
                    int8_runners: dict[str, Callable[[list[np.ndarray]], np.ndarray]]) -> dict[str, float]:
    """Per int8 runner, against relay_amp fp32 on AGREEMENT_INPUTS inputs the calibration never saw: the share of
    equal top-1 classes for CNNs, the smallest output cosine for transformers and audio models."""
    reference = _relay_runner_on(fp32)
    inputs = [zoo.example_inputs(name, tiny, seed) for seed in range(100, 100 + AGREEMENT_INPUTS)]
    expected = [reference(x) for x in inputs]
    agreement = {}
    for runner, run in int8_runners.items():
        outputs = [run(x) for x in inputs]
        if zoo.entry(name).kind != "cnn":
            agreement[runner] = min(cosine_similarity(o, e) for o, e in zip(outputs, expected))
        else:
            agreement[runner] = float(np.mean([top1_agreement(o, e) for o, e in zip(outputs, expected)]))
    return agreement


def _output(result) -> np.ndarray:
    """The first output of any runner as a float64 numpy array."""
    while isinstance(result, list | tuple | tvm.ir.Array) and not isinstance(result, tvm.runtime.Tensor):
        result = result[0]
    if isinstance(result, torch.Tensor):
        return result.float().numpy().astype("float64")
    return np.asarray(result.numpy() if hasattr(result, "numpy") else result, dtype="float64")


def bench_model(name: str, dtypes: Sequence[str], target: str, rounds: int = 3, repeat: int = 5,
                torch_compile: bool = False, tiny: bool = False) -> ZooResult:
    """Time one zoo model (`tiny`: its test size) in every relay_amp dtype and every peer, in rotating blocks."""
    torch.set_num_threads(host_cores())
    inputs = zoo.example_inputs(name, tiny)
    result = ZooResult(name)
    with tempfile.TemporaryDirectory() as tmp:
        path = zoo.export_onnx(name, Path(tmp) / f"{name}.onnx", tiny)
        mod = frontend.from_onnx(path)
        calibration = _calibration(name, tiny)
        executables = {dtype: build(variant(mod, dtype, calibration), target) for dtype in [BASELINE, *dtypes]}
        runners = {f"relay_amp {SHORT.get(d, d)}": relay_runner(ex, inputs) for d, ex in executables.items()}
        runners.update(_torch_runners(name, inputs, torch_compile, tiny))
        runners["onnxruntime fp32"] = ort_runner(ort_session(path), inputs)
        int8_runs = {}
        if QUANTIZED in dtypes:
            timed, int8_runs = _ort_int8_runners(name, path, calibration, target, Path(tmp), inputs, result)
            runners.update(timed)
            int8_runs[RELAY_INT8Q] = _relay_runner_on(executables[QUANTIZED])
        result.ms = rotating_medians(runners, rounds, repeat)
        reference = _output(runners["torch fp32"]())
        result.error = {runner: max_relative_error(_output(run()), reference) for runner, run in runners.items()}
        if int8_runs:
            result.agreement = _int8_agreement(name, tiny, executables[BASELINE], int8_runs)
    if "bfloat16" in executables:
        rows = profile_rows(call_times({d: executables[d] for d in (BASELINE, "bfloat16")}, inputs, PROFILE_RUNS))
        result.slow_paths = slow_paths(rows)
    return result


def profile_model(name: str, dtypes: Sequence[str], target: str, repeat: int = 5, *, by_shape: bool = False,
                  conv_layout: "str | list[str] | None" = AUTO, tiny: bool = False) -> list[ProfileRow]:
    """`profile` of a zoo model as the zoo bench builds it: the same ONNX export, example inputs and int8q
    calibration inputs (`tiny`: its test size)."""
    with tempfile.TemporaryDirectory() as tmp:
        mod = frontend.from_onnx(zoo.export_onnx(name, Path(tmp) / f"{name}.onnx", tiny))
    return profile(mod, dtypes, target, repeat, conv_layout=conv_layout, by_shape=by_shape,
                   inputs=zoo.example_inputs(name, tiny), calibration=_calibration(name, tiny))


def _calibration(name: str, tiny: bool) -> list:
    """int8q's calibration batches of a zoo model: CALIBRATION_INPUTS example inputs of seeds other than the
    timed one's."""
    return [zoo.example_inputs(name, tiny, seed) for seed in range(1, CALIBRATION_INPUTS + 1)]


def _ort_int8_runners(name: str, path: Path, calibration: list, target: str, work_dir: Path,
                      inputs: list[np.ndarray], result: ZooResult) -> tuple[dict, dict]:
    """ONNX Runtime on its own int8 model of the file and relay_amp on that model: runners timed on `inputs`, and
    runs of any inputs for the agreement; none where ONNX Runtime's quantizer fails on the file (recorded in
    `result.peer_failures`: the model's other runners still run)."""
    try:
        ort_file = ort_quantized(path, calibration, zoo.entry(name).kind == "cnn", work_dir)
    except Exception as err:  # ONNX Runtime's quantizer raises bare Exceptions
        result.peer_failures[ORT_INT8] = one_line(f"ONNX Runtime's quantizer failed: {err}")
        return {}, {}
    session, on_ort_file = ort_session(ort_file), build(realize_qdq(frontend.from_onnx(ort_file)), target)
    return ({ORT_INT8: ort_runner(session, inputs), ORT_FILE_INT8: relay_runner(on_ort_file, inputs)},
            {ORT_INT8: _ort_runner_on(session), ORT_FILE_INT8: _relay_runner_on(on_ort_file)})


def _bench_or_failure(name: str, dtypes: Sequence[str], target: str, options: dict) -> ZooResult:
    """`bench_model`'s result, or one whose `failure` says why the model failed (relay_amp's error, or TVM's),
    so that one model's failure does not end a run of the zoo."""
    try:
        return bench_model(name, dtypes, target, **options)
    except (RelayAmpError, RuntimeError) as err:  # tvm.error's errors are RuntimeErrors
        return ZooResult(name, failure=(str(err).strip().splitlines() or [type(err).__name__])[-1])


def failures(results: Sequence[ZooResult]) -> str:
    """One line naming the models that failed and why ('' when none did)."""
    failed = [f"{r.model} ({r.failure})" for r in results if r.failure]
    return f"{len(failed)} of {len(results)} zoo models failed: {'; '.join(failed)}" if failed else ""


def slow_paths(rows: Sequence[ProfileRow], first: str = BASELINE, last: str = "bfloat16") -> list[str]:
    """The call groups at least SLOW_RATIO slower in `last` than in `first`, by SLOW_SHARE of `last`'s time or more."""
    total = sum(row.ms.get(last, 0.0) for row in rows)
    found = []
    for row in rows:
        before, after = row.ms.get(first, 0.0), row.ms.get(last, 0.0)
        if after - before >= SLOW_SHARE * total and after >= SLOW_RATIO * before:
            found.append(f"{row.group} {before:.2f}->{after:.2f} ms")
    return found


def markdown_table(results: Sequence[ZooResult]) -> str:
    """One row per model: each runner's ms (and error), then relay_amp bf16's ratio to its peers."""
    runners = list(dict.fromkeys(runner for r in results for runner in [*r.ms, *r.peer_failures]))
    headers = ["model", *runners, "bf16 vs fp32", "bf16 vs torch bf16", "fp32 vs ORT", "bf16 slow paths"]
    quantized = any(r.agreement for r in results)
    if quantized:
        headers += ["int8q vs fp32", "int8q vs ORT int8", "ORT's int8 file: relay_amp vs ORT",
                    "int8 agreement with fp32 (ours / ORT / ours on ORT's file)"]
    rows = []
    for r in results:
        if r.failure:
            rows.append([r.model, f"failed: {r.failure}"])
            continue
        torch_bf16, bf16 = r.ms.get(TORCH_BF16), r.ms.get("relay_amp bf16")
        rows.append([r.model, *(_cell(r, runner) for runner in runners),
                     _ratio(r.ms.get("relay_amp fp32"), bf16), _ratio(torch_bf16, bf16),
                     _ratio(r.ms.get("onnxruntime fp32"), r.ms.get("relay_amp fp32")),
                     "; ".join(r.slow_paths) or "none"])
        if quantized:
            ours = r.ms.get(RELAY_INT8Q)
            rows[-1] += [_ratio(r.ms.get("relay_amp fp32"), ours), _ratio(r.ms.get(ORT_INT8), ours),
                         _ratio(r.ms.get(ORT_INT8), r.ms.get(ORT_FILE_INT8)),
                         " / ".join(f"{r.agreement[x]:.4g}" if x in r.agreement else "-" for x in INT8_RUNNERS)]
    return tabulate(rows, headers=headers, tablefmt="github")


def _cell(result: ZooResult, runner: str) -> str:
    """A runner's ms and error, why a peer's runner could not run, or nothing (a runner of other models)."""
    if runner in result.ms:
        return f"{result.ms[runner]:.2f} ({result.error[runner]:.0e})"
    return f"failed: {result.peer_failures[runner]}" if runner in result.peer_failures else ""


def _ratio(baseline: float | None, ours: float | None) -> str:
    return f"{baseline / ours:.2f}x" if baseline and ours else ""


def bar_chart(results: Sequence[ZooResult], path: Path) -> None:
    """Speed of every runner relative to PyTorch fp32 (higher is faster), one group of bars per model."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    results = [r for r in results if not r.failure]
    runners = list(dict.fromkeys(runner for r in results for runner in r.ms))
    figure, axes = plt.subplots(figsize=(max(8, 1.6 * len(results)), 4.5))
    width = 0.8 / len(runners)
    for i, runner in enumerate(runners):
        speed = [r.ms["torch fp32"] / r.ms[runner] if runner in r.ms else 0 for r in results]
        label = f"{runner} (channels_last for CNNs)" if runner == TORCH_BF16 else runner
        axes.bar(np.arange(len(results)) + i * width, speed, width, label=label)
    axes.set_xticks(np.arange(len(results)) + 0.4 - width / 2, [r.model for r in results], rotation=20)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_ylabel("speed-up over PyTorch fp32 eager")
    axes.set_title(f"zoo, batch 1, {host_cores()} threads, untuned")
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    with tempfile.NamedTemporaryFile(suffix=".png") as tmp:
        figure.savefig(tmp.name, dpi=110)
        atomic_write_bytes(path, Path(tmp.name).read_bytes())
    plt.close(figure)


def bench_zoo(names: Sequence[str], dtypes: Sequence[str] = ("bfloat16",), target: str = "cpu",
              results_dir: "str | Path | None" = None, progress: Callable[[ZooResult], None] | None = None,
              **options) -> list[ZooResult]:
    """Benchmark zoo models; with `results_dir`, write zoo.json (with the target and the core it names), zoo.md and
    zoo.png there. A model that fails is recorded with why (`ZooResult.failure`), and the run goes on."""
    results = []
    for name in names:
        results.append(_bench_or_failure(zoo.entry(name).name, dtypes, target, options))
        if progress:
            progress(results[-1])
    if results_dir is not None:
        out = Path(results_dir)
        context = {"target": target, "core": target_core(get_target(target)), "threads": host_cores(),
                   "dtypes": list(dtypes), **options}
        atomic_write_text(out / "zoo.json", json.dumps({**context, "models": [asdict(r) for r in results]}, indent=1))
        atomic_write_text(out / "zoo.md", markdown_table(results) + "\n")
        if not all(r.failure for r in results):
            bar_chart(results, out / "zoo.png")
    return results
