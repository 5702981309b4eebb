"""gpu-check: the CUDA path end to end on this machine's NVIDIA GPU (build, run, compare with the CPU, time).

For each built-in model: float16 AMP, int8 recast and int4 recast (convolutions in HWNC, the stem left in fp32,
as the seed workflow lays them out) and calibrated int8 (`quantize`, int8 x int8 codes, float16 between), built
for the tensor-core preset of the GPU's compute capability (`cuda-tensorcore` for sm_8x, `cuda-tensorcore-sm90`
for Hopper), run there through TVM's CUDA runtime, checked against the fp32 model run on the CPU (an int variant
also against the same module built for the CPU), and timed next to the PyTorch twin in float16 on the same GPU.
Without a GPU it is one TargetError, before anything is built.
"""

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tvm
from tabulate import tabulate
from tvm import relax

from ..compile.build import build
from ..errors import OptionError, TargetError
from ..passes.amp import to_mixed_precision
from ..passes.layers import count_layers
from ..passes.layout import LayoutConfig, convert_layout
from ..passes.quantize import quantize
from ..passes.recast import recast
from ..runtime import flatten_outputs, run_executable, virtual_machine
from ..serialization import atomic_write_text
from . import pytorch
from .bench import max_relative_error
from .models import example_inputs, get_model

MODELS = ("resnet18", "bert")
VARIANTS = ("float16", "int8", "int4", "int8q")
BASELINE = "float32"  # the unconverted model on the GPU (dlight's schedules): what float16 and int8 should beat
TARGET = "cuda-tensorcore"  # sm_80: what the variants are checked against without a GPU
HOPPER_TARGET = "cuda-tensorcore-sm90"
TOLERANCE = {"float32": 1e-4, "float16": 0.05, "int8q": 0.05}  # against the fp32 model on the CPU
RECASTS = ("int8", "int4")  # uncalibrated, so far from fp32: judged against the same recast built for the CPU
RECAST_TOLERANCE = 0.01  # the same integer arithmetic on both
STEM = 0  # the layer recast leaves in fp32 (its 3 input channels fill no tensor-core tile)
CALIBRATION_INPUTS = 16  # random inputs int8q is calibrated on


@dataclass(frozen=True)
class GpuRow:
    """One model variant on the GPU: its median latency, its errors against the CPU, PyTorch fp16's latency."""

    model: str
    variant: str
    gpu: str
    median_ms: float
    max_rel_error: float  # against the fp32 model on the CPU (an uncalibrated int recast is far off: reported only)
    cpu_twin_error: float | None  # an int variant against the same module built for the CPU; None for float ones
    passed: bool
    torch_fp16_ms: float | None


def require_gpu() -> tvm.runtime.Device:
    """The first CUDA device, or a TargetError saying there is none."""
    device = tvm.cuda(0)
    if not device.exist:
        raise TargetError("no NVIDIA GPU on this machine (TVM's CUDA runtime sees no device): gpu-check runs the "
                          "CUDA path on one; without a GPU use `relay_amp.cuda_source` or `compile_ptx`")
    return device


def target_for(compute_version: str) -> str:
    """The tensor-core target preset for a GPU of compute capability `compute_version` ("8.6", "9.0")."""
    major = int(compute_version.split(".")[0])
    if major < 8:
        raise TargetError(f"the GPU's compute capability {compute_version} is below 8.0: relay_amp's tensor-core "
                          "kernels (wmma int8/float16, mma s4) are built for sm_80 and newer")
    return HOPPER_TARGET if major >= 9 else TARGET


def variant(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    """The module gpu-check builds for variant `name`: as is (float32), float16 AMP, int8/int4 recast with HWNC
    convolutions, or calibrated int8 (int8q)."""
    if name == BASELINE:
        return mod
    if name == "float16":
        return to_mixed_precision(mod, "float16")
    if name == "int8q":  # wmma multiplies int8 by int8 (no uint8 x int8 as VNNI); float16 is the GPU's fallback
        calibration = [example_inputs(mod, seed) for seed in range(1, CALIBRATION_INPUTS + 1)]
        return quantize(mod, calibration, activation_dtype="int8", fallback_dtype="float16")
    if name not in VARIANTS:
        raise OptionError(f"unknown gpu-check variant {name!r}; choose from {[BASELINE, *VARIANTS]}")
    if not count_layers(mod, ["relax.nn.conv2d"]):  # a transformer: every matmul recast, no layout to change
        return recast(mod, name, "int32", ops=["relax.matmul"])
    recast_mod = recast(mod, name, "int32", ops=["relax.nn.conv2d", "relax.matmul"], skip_layers=[STEM])
    with LayoutConfig(skip_layers=[STEM]):
        return convert_layout(recast_mod, {"relax.nn.conv2d": ["HWNC", "default"]})


def _run_on_gpu(executable: relax.VMExecutable, inputs: Sequence[np.ndarray], device, repeat: int):
    vm = virtual_machine(executable, device)
    args = [tvm.runtime.tensor(x, device=device) for x in inputs]
    output = flatten_outputs(vm["main"](*args))[0]
    median = vm.time_evaluator("main", device, number=1, repeat=repeat)(*args).median * 1e3
    return output.astype("float64"), median


def _torch_fp16_ms(name: str, repeat: int) -> float | None:
    """PyTorch's float16 twin on the GPU at its best (weights in float16, channels_last for CNNs), or None
    where torch has no CUDA."""
    torch = pytorch.load_torch()
    if not torch.cuda.is_available():
        return None
    module, example = pytorch.twin(name)
    module, example = module.cuda().half(), example.cuda()
    if example.is_floating_point():  # an image: channels_last is cuDNN's fastest float16 layout
        module, (example,) = pytorch.channels_last(module, [example.half()])
    with torch.inference_mode():
        module(example)
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
        for start, end in events:
            start.record()
            module(example)
            end.record()
        torch.cuda.synchronize()
    return float(np.median([start.elapsed_time(end) for start, end in events]))


def check_model(name: str, variants: Sequence[str] = VARIANTS, repeat: int = 20) -> list[GpuRow]:
    """Every variant of built-in model `name` on the GPU, against the fp32 model on the CPU and, for int variants,
    against the same module built for the CPU (which an int recast's tensor-core kernels must match)."""
    device = require_gpu()
    target = target_for(device.compute_version)
    mod = get_model(name)
    inputs = example_inputs(mod)
    reference = run_executable(build(mod, "cpu"), inputs)[0].astype("float64")
    torch_ms = _torch_fp16_ms(name, repeat)
    rows = []
    for variant_name in variants:
        variant_mod = variant(mod, variant_name)
        output, median = _run_on_gpu(build(variant_mod, target), inputs, device, repeat)
        error = max_relative_error(output, reference)
        twin_error = None
        if variant_name.startswith("int"):
            cpu_output = run_executable(build(variant_mod, "cpu"), inputs)[0].astype("float64")
            twin_error = max_relative_error(output, cpu_output)
        passed = twin_error <= RECAST_TOLERANCE if variant_name in RECASTS else error <= TOLERANCE[variant_name]
        rows.append(GpuRow(name, variant_name, device.device_name, median, error, twin_error, passed, torch_ms))
    return rows


def gpu_check(model_names: Sequence[str] = MODELS, variants: Sequence[str] = VARIANTS, repeat: int = 20,
              results: str | Path | None = None) -> list[GpuRow]:
    """`check_model` for each model; with `results`, gpu_check.json and gpu_check.md written there."""
    require_gpu()
    rows = [row for name in model_names for row in check_model(name, variants, repeat)]
    if results is not None:
        root = Path(results)
        root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(root / "gpu_check.json", json.dumps([asdict(r) for r in rows], indent=1))
        atomic_write_text(root / "gpu_check.md", format_rows(rows) + "\n")
    return rows


def format_rows(rows: Sequence[GpuRow]) -> str:
    """gpu-check rows as a markdown table."""
    table = [[r.model, r.variant, r.gpu, f"{r.median_ms:.3f}", f"{r.max_rel_error:.2e}",
              "" if r.cpu_twin_error is None else f"{r.cpu_twin_error:.2e}", "yes" if r.passed else "NO",
              "" if r.torch_fp16_ms is None else f"{r.torch_fp16_ms:.3f}",
              "" if r.torch_fp16_ms is None else f"{r.torch_fp16_ms / r.median_ms:.2f}x"] for r in rows]
    headers = ["model", "variant", "GPU", "GPU ms", "max rel error vs CPU fp32",
               "vs the same module on CPU", "within tolerance", "torch fp16 ms",
               "speed-up vs torch fp16"]
    return tabulate(table, headers=headers, tablefmt="github", disable_numparse=True)
