"""peers: the runtimes users would pick instead of relay_amp (ONNX Runtime), and timing runners side by side.

Runners are timed in rotating blocks (a block of runs of each in turn, several rounds, the median of the block
medians), so a noisy neighbour slows them all alike. ONNX Runtime's thread pool does not spin, so it does not
steal the next runner's cores. ONNX Runtime is imported on first use: it comes with the `zoo` extra.
"""

import contextlib
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import numpy as np

from ..errors import MissingDependencyError, OptionError
from ..targets import host_cores


def rotating_medians(runners: dict[Hashable, Callable[[], object]], rounds: int,
                     repeat: int) -> dict[Hashable, float]:
    """Median ms of each runner: `rounds` rounds of `repeat`-run blocks, runners in turn, median of block medians."""
    if rounds < 1 or repeat < 1:
        raise OptionError(f"rounds and repeat must be at least 1, got {rounds} and {repeat}")
    blocks = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            run()
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            blocks[name].append(statistics.median(times))
    return {name: statistics.median(medians) * 1e3 for name, medians in blocks.items()}


def _onnxruntime():
    try:
        import onnxruntime  # pylint: disable=import-outside-toplevel
        import onnxruntime.quantization  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError as err:
        raise MissingDependencyError("ONNX Runtime columns need onnxruntime: pip install -e '.[zoo]'") from err
    return onnxruntime


def ort_session(path: str | Path):
    """An ONNX Runtime CPU session on the host's cores, its thread pool not spinning."""
    onnxruntime = _onnxruntime()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = host_cores()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_runner(session, inputs: Sequence[np.ndarray]) -> Callable[[], list]:
    """A call that runs `session` on `inputs` (in the order of its graph inputs) and returns its outputs."""
    feed = dict(zip([i.name for i in session.get_inputs()], inputs))
    return lambda: session.run(None, feed)


def ort_quantized(path: Path, calibration: Sequence[Sequence[np.ndarray]], static: bool, work_dir: Path) -> Path:
    """ONNX Runtime's int8 model of the file at `path`, written to `work_dir`, as its docs recommend: static QDQ
    (per-channel int8 weights, uint8 activations) calibrated on `calibration` (input batches) for CNNs, dynamic
    int8 (weights int8, activation scales at run time) for transformers. Its preprocessing runs in `work_dir`,
    where its shape inference writes its temporary model (and leaves it, 110 MB for Swin-V2-T, where it fails)."""
    quantization = _onnxruntime().quantization
    source, work_dir = Path(path).resolve(), Path(work_dir).resolve()  # before the preprocessing's change of directory
    prepared, quantized = work_dir / f"{source.stem}.pre.onnx", work_dir / f"{source.stem}.int8.onnx"
    with contextlib.chdir(work_dir):
        _preprocess(quantization, source, prepared)
    if not static:
        quantization.quantize_dynamic(str(prepared), str(quantized), weight_type=quantization.QuantType.QInt8)
        return quantized
    names = [i.name for i in ort_session(prepared).get_inputs()]
    feeds = iter([dict(zip(names, batch)) for batch in calibration])

    class Feeds(quantization.CalibrationDataReader):
        def get_next(self):
            return next(feeds, None)

    quantization.quantize_static(str(prepared), str(quantized), Feeds(), quant_format=quantization.QuantFormat.QDQ,
                                 per_channel=True, activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8)
    return quantized


def _preprocess(quantization, source: Path, prepared: Path) -> None:
    """ONNX Runtime's quant_pre_process; where its symbolic shape inference fails (Swin-T, Swin-V2-T: "Incomplete
    symbolic shape inference"), again without that step, which its `skip_symbolic_shape` option leaves out."""
    try:
        quantization.quant_pre_process(str(source), str(prepared))
    except Exception:  # ONNX Runtime raises a bare Exception there
        quantization.quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
