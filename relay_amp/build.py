"""build: compile a (converted) module for a target, with tuning records when given."""

import os

import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from .errors import TargetError, TuningError
from .targets import check_host, get_target
from .tuning import load_database, matching_records


def build(mod: tvm.IRModule, target: "str | tvm.target.Target" = "cpu",
          tune_logs: str | os.PathLike | None = None) -> relax.VMExecutable:
    """Compile `mod` for `target`, applying the MetaSchedule records in `tune_logs` when given."""
    check_host(target)
    tgt = get_target(target)
    if tune_logs is None:
        return tvm.compile(mod, target=tgt)
    database = load_database(tune_logs)
    if matching_records(database, mod, tgt) == 0:
        raise TuningError(f"tuning log {tune_logs} has no record for any operator of this module "
                          "(tuned for another model, dtype or target?)")
    return ms.relax_integration.compile_relax(database, mod, tgt, params=None)


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
