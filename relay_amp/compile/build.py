"""build: compile a (converted) module for a target, with tuning records when given."""

import contextlib
import os

import tvm
from tvm import relax

from ..backend import pipeline_for
from ..backend.fusion import AUTO
from ..errors import TargetError, TuningError
from ..targets import check_host, get_target
from .tuning import load_database, prepared_records


def build(mod: tvm.IRModule, target: "str | tvm.target.Target" = "cpu",
          tune_logs: str | os.PathLike | None = None, fast_math: bool = True,
          conv_layout: "str | list[str] | None" = AUTO) -> relax.VMExecutable:
    """Compile `mod` for `target`: dot-product kernels, then tuning records (when given), then default schedules.

    On CPU targets GELU/erf/exp/tanh/softmax become vectorizable approximations (relay_amp.backend.cpu.fastmath; turn off
    with `fast_math=False`), and matmuls and NHWC convs with constant weights go to relay_amp.backend.cpu.kernels where the
    target has the instruction; MetaSchedule records from `tune_logs` schedule what they cover; relay_amp's
    rule-based schedules (relay_amp.backend.cpu.schedules) the rest. On CUDA targets matmuls and convs in int8 or float16
    run on tensor cores (relay_amp.backend.cuda.tensorcore), and TVM's dlight rules schedule the rest.
    `conv_layout` "auto" lets the backend choose the convolutions' layout (CPU: NHWC, converted at the graph's
    edges; CUDA: as the model has it); a data layout such as "NCHW" forces one, None keeps the model's.
    """
    check_host(target)
    tgt = get_target(target)
    database = None if tune_logs is None else load_database(tune_logs)
    backend = pipeline_for(tgt)
    with tgt, database or contextlib.nullcontext(), tvm.transform.PassContext(opt_level=3, config=backend.PASS_CONFIG):
        prepared = backend.prepare_passes(tgt, fast_math, conv_layout)(mod)  # once: the record check and the build share it
        if database is not None:
            _require_records(prepared_records(database, prepared, tgt), tune_logs)
        return relax.build(prepared, target=tgt, relax_pipeline=backend.lowering_passes(tgt, database is not None))


def _require_records(count: int, tune_logs) -> None:
    if count == 0:
        raise TuningError(f"tuning log {tune_logs} has no record for any operator of this module "
                          "(tuned for another model, dtype or target?)")


def cuda_source(executable: relax.VMExecutable) -> str:
    """The CUDA C source TVM generated for a CUDA build (no GPU needed to read it)."""
    modules = [executable.mod, *_imports(executable.mod)]
    cuda = [m for m in modules if m.kind == "cuda"]
    if not cuda:
        raise TargetError("the executable holds no CUDA module: build it for a CUDA target")
    return cuda[0].inspect_source("cuda")


def _imports(module) -> list:
    found = []
    for child in module.imports:
        found += [child, *_imports(child)]
    return found


def compile_ptx(source: str, target: "str | tvm.target.Target" = "cuda-tensorcore") -> str:
    """Compile CUDA source to PTX with nvcc for the target's architecture (nvcc must be installed)."""
    from tvm.support import nvcc

    with get_target(target):
        return bytes(nvcc.compile_cuda(source, target_format="ptx", compiler="nvcc")).decode()
