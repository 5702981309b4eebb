"""build: compile a (converted) module for a target, with tuning records when given."""

import contextlib
import os
import warnings
from pathlib import Path

import tvm
from tvm import relax

from ..backend import pipeline_for
from ..backend.fusion import AUTO
from ..errors import ModuleError, OptionError, TargetError, TuningError
from ..passes.shapes import bind_advice, symbolic_dims
from ..runtime import set_host_compiler
from ..serialization import atomic_path
from ..targets import check_host, get_target, host_preset
from .tuning import load_database, prepared_records

LIBRARY_SUFFIXES = (".so", ".tar")  # export_library's formats: TVM links a .so with the host compiler, tars a .tar
LIBRARY_MODE = 0o755  # a shared library's usual mode


def build(mod: tvm.IRModule, target: "str | tvm.target.Target" = "cpu",
          tune_logs: str | os.PathLike | None = None, fast_math: bool = True,
          conv_layout: "str | list[str] | None" = AUTO) -> relax.VMExecutable:
    """Compile `mod` for `target`: dot-product kernels, then tuning records (when given), then default schedules.

    On CPU targets GELU/erf/exp/tanh/softmax become vectorizable approximations (relay_amp.backend.cpu.fastmath) and,
    on Zen 4, bf16 3x3 convs run as Winograd's (relay_amp.backend.cpu.winograd: errors about PyTorch's own bf16's);
    `fast_math=False` turns both off. Matmuls and NHWC convs with constant weights go to
    relay_amp.backend.cpu.kernels where the target has the instruction; MetaSchedule records from `tune_logs` schedule
    what they cover; relay_amp's rule-based schedules (relay_amp.backend.cpu.schedules) the rest. On CUDA targets
    matmuls and convs in int8 or float16 run on tensor cores (relay_amp.backend.cuda.tensorcore), and TVM's dlight
    rules schedule the rest.
    `conv_layout` "auto" lets the backend choose the convolutions' layout (CPU: NHWC, converted at the graph's
    edges; CUDA: NHWC for a model's NCHW convs that run on tensor cores, float16 or int8); a data layout such as
    "NCHW" forces one, None keeps the model's.
    Inputs with symbolic dims (an export's dynamic axes) get a warning: the kernels need static shapes, so bind them
    first (`frontend.from_onnx(path, dims=...)`, `specialize`); where TVM cannot compile the dynamic model, the
    ModuleError says so.
    """
    check_host(target)
    tgt = get_target(target)
    dims = _symbolic_input_dims(mod)
    if dims:
        warnings.warn(f"the model's inputs have symbolic dims ({', '.join(dims)}): convolutions and matmuls over "
                      f"them run on generic schedules, not relay_amp's kernels, several times slower; {bind_advice(dims)}",
                      stacklevel=2)
    try:
        return _build(mod, tgt, tune_logs, fast_math, conv_layout)
    except tvm.error.InternalError as err:
        if not dims:
            raise
        raise ModuleError(f"TVM cannot compile this model with symbolic input dims ({', '.join(dims)}): "
                          f"{str(err).strip().splitlines()[-1]}; {bind_advice(dims)}") from err


def _build(mod: tvm.IRModule, tgt: tvm.target.Target, tune_logs, fast_math: bool,
           conv_layout) -> relax.VMExecutable:
    database = None if tune_logs is None else load_database(tune_logs)
    backend = pipeline_for(tgt)
    with tgt, database or contextlib.nullcontext(), tvm.transform.PassContext(opt_level=3, config=backend.PASS_CONFIG):
        prepared = backend.prepare_passes(tgt, fast_math, conv_layout)(mod)  # once: the record check and the build share it
        if database is not None:
            _require_records(prepared_records(database, prepared, tgt), tune_logs)
        return relax.build(prepared, target=tgt, relax_pipeline=backend.lowering_passes(tgt, database is not None),
                           tir_pipeline=backend.TIR_PIPELINE)


def build_for_host(mod: tvm.IRModule) -> relax.VMExecutable:
    """`build` for this host's fastest CPU preset: what calibration runs its probes on (`runtime.compile_for_host`)."""
    return build(mod, host_preset())


set_host_compiler(build_for_host)


def library_path(path: str | os.PathLike) -> Path:
    """`path` as a Path, or an OptionError where it does not name a library export_library writes."""
    if Path(path).suffix not in LIBRARY_SUFFIXES:
        raise OptionError(f"a built model is written as {' or '.join(LIBRARY_SUFFIXES)}, got {str(path)!r}")
    return Path(path)


def export_library(executable: relax.VMExecutable, path: str | os.PathLike) -> Path:
    """Write a built model to `path` as a shared library (.so) or a tar of its objects (.tar), atomically; the plain
    TVM runtime runs it without relay_amp (tvm.runtime.load_module, then relax.VirtualMachine). Returns the path."""
    target = library_path(path)
    try:
        with atomic_path(target, LIBRARY_MODE) as temp:
            executable.export_library(str(temp))
    except RuntimeError as err:  # the host compiler's failure to link, or TVM's (its errors are RuntimeErrors)
        raise ModuleError(f"cannot write {target}: {str(err).strip().splitlines()[-1]}") from err
    return target


def _symbolic_input_dims(mod: tvm.IRModule) -> list[str]:
    """The symbolic dims of main's inputs ([] for a module without a Relax main)."""
    has_main = any(gv.name_hint == "main" and isinstance(f, relax.Function) for gv, f in mod.functions_items())
    return symbolic_dims(mod) if has_main else []


def _require_records(count: int, tune_logs) -> None:
    if count == 0:
        raise TuningError(f"tuning log {tune_logs} has no record for any operator of this module "
                          "(tuned for another model, dtype, target or core?)")


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
