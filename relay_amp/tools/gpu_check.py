"""gpu-check: the CUDA path end to end on this machine's NVIDIA GPU (build, run, compare with the CPU, time).

For each built-in model: float16 AMP, int8 recast and int4 recast (convolutions in HWNC, the stem left in fp32,
as the seed workflow lays them out) built for `cuda-tensorcore`, run on the GPU through TVM's CUDA runtime,
checked against the fp32 model run on the CPU, and timed next to the PyTorch twin in float16 on the same GPU.
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
from ..passes.layout import LayoutConfig, convert_layout
from ..passes.recast import recast
from ..runtime import flatten_outputs, run_executable, virtual_machine
from ..serialization import atomic_write_text
from . import pytorch
from .models import example_inputs, get_model

MODELS = ("resnet18", "bert")
VARIANTS = ("float16", "int8", "int4")
TARGET = "cuda-tensorcore"
TOLERANCE = {"float16": 0.05, "int8": None, "int4": None}  # recast int8/int4 are not calibrated: reported, not judged
STEM = 0  # the layer recast leaves in fp32 (its 3 input channels fill no tensor-core tile)


@dataclass(frozen=True)
class GpuRow:
    """One model variant on the GPU: its median latency, error against CPU fp32, PyTorch fp16's latency."""

    model: str
    variant: str
    median_ms: float
    max_rel_error: float
    passed: bool | None  # None: no tolerance (uncalibrated recast)
    torch_fp16_ms: float | None


def require_gpu() -> tvm.runtime.Device:
    """The first CUDA device, or a TargetError saying there is none."""
    device = tvm.cuda(0)
    if not device.exist:
        raise TargetError("no NVIDIA GPU on this machine (TVM's CUDA runtime sees no device): gpu-check runs the "
                          "CUDA path on one; without a GPU use `relay_amp.cuda_source` or `compile_ptx`")
    return device


def variant(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    """The module gpu-check builds for variant `name`: float16 AMP, or int8/int4 recast with HWNC convolutions."""
    if name == "float16":
        return to_mixed_precision(mod, "float16")
    if name not in VARIANTS:
        raise OptionError(f"unknown gpu-check variant {name!r}; choose from {list(VARIANTS)}")
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
    """PyTorch's float16 twin on the GPU (autocast), or None where torch has no CUDA."""
    torch = pytorch.load_torch()
    if not torch.cuda.is_available():
        return None
    module, example = pytorch.twin(name)
    module, example = module.cuda(), example.cuda()
    with torch.inference_mode(), torch.autocast("cuda", torch.float16):
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
    """Every variant of built-in model `name` on the GPU against its fp32 CPU output."""
    device = require_gpu()
    mod = get_model(name)
    inputs = example_inputs(mod)
    reference = run_executable(build(mod, "cpu"), inputs)[0].astype("float64")
    scale = max(float(np.abs(reference).max()), 1e-12)
    torch_ms = _torch_fp16_ms(name, repeat)
    rows = []
    for variant_name in variants:
        output, median = _run_on_gpu(build(variant(mod, variant_name), TARGET), inputs, device, repeat)
        error = float(np.abs(output - reference).max()) / scale
        tolerance = TOLERANCE[variant_name]
        rows.append(GpuRow(name, variant_name, median, error, None if tolerance is None else error <= tolerance,
                           torch_ms))
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
    table = [[r.model, r.variant, f"{r.median_ms:.3f}", f"{r.max_rel_error:.2e}",
              {True: "yes", False: "NO", None: "-"}[r.passed],
              "" if r.torch_fp16_ms is None else f"{r.torch_fp16_ms:.3f}",
              "" if r.torch_fp16_ms is None else f"{r.torch_fp16_ms / r.median_ms:.2f}x"] for r in rows]
    headers = ["model", "variant", "GPU ms", "max rel error vs CPU fp32", "within tolerance", "torch fp16 ms",
               "speed-up vs torch fp16"]
    return tabulate(table, headers=headers, tablefmt="github")
