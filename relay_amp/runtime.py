"""Compile a module on the host CPU and run it on the Relax VM: the numeric ground truth of the tests; the compiler
that runs a model fast on this host for the passes that must run one (calibration); the size of TVM's CPU thread
pool."""

import os
from collections.abc import Callable, Sequence

import numpy as np
import tvm
from tvm import relax

from .errors import OptionError, TargetError
from .targets import host_cores, host_cpus

THREAD_ENV = ("TVM_NUM_THREADS", "OMP_NUM_THREADS")  # what TVM's pool reads for its size, in this order
CUSTOM_CORES = -2  # TVM's kSpecifyCustomCorePolicy: the pool's threads on the CPUs listed


def configure_threads(count: int | None = None) -> int:
    """Size TVM's CPU thread pool to `count` threads, or to one per physical core when `count` is None and neither
    TVM_NUM_THREADS nor OMP_NUM_THREADS is set; returns the threads the pool runs. TVM alone takes half the logical
    CPUs (it assumes two hyperthreads per core), which is one thread on a 2-vCPU VM."""
    if count is not None and count < 1:
        raise OptionError(f"threads must be at least 1, got {count}")
    if count is None and any(name in os.environ for name in THREAD_ENV):
        return pool_threads()
    wanted = count or host_cores()
    os.environ[THREAD_ENV[0]] = str(wanted)  # read when the pool starts: enough if nothing has run in parallel yet
    if pool_threads() != wanted:  # the pool had started: reconfigure it on this process's CPUs
        tvm.get_global_func("runtime.config_threadpool")(CUSTOM_CORES, wanted, [str(c) for c in host_cpus()])
    return pool_threads()


def pool_threads() -> int:
    """The threads TVM's CPU thread pool runs parallel loops on."""
    return int(tvm.get_global_func("runtime.NumThreads")())


def compile_module(mod: tvm.IRModule, target: tvm.target.Target | None = None) -> relax.VMExecutable:
    """Compile `mod` with TVM's default pipeline for `target` (the host CPU when None)."""
    return tvm.compile(mod, target=target or tvm.target.Target("llvm"))


_host_compiler = {"compile": compile_module}  # what compile_for_host calls


def compile_for_host(mod: tvm.IRModule) -> relax.VMExecutable:
    """Compile `mod` to run on this host with the compiler `set_host_compiler` installed: relay_amp's own build (its
    kernels and schedules; `relay_amp.compile` installs it on import), else TVM's default pipeline, whose
    unscheduled loops took 12-16 s a calibration batch of MLP-Mixer-S/16 or a 6-layer BERT."""
    return _host_compiler["compile"](mod)


def set_host_compiler(compiler: Callable[[tvm.IRModule], relax.VMExecutable]) -> None:
    """Make `compiler` the one `compile_for_host` uses (the compile pipeline, which the passes may not import)."""
    if not callable(compiler):
        raise OptionError(f"a host compiler must be a function of an IRModule, got {type(compiler).__name__}")
    _host_compiler["compile"] = compiler


NO_CUDA_RUNTIME = "CUDA runtime is not linked"  # what TVM says when an executable's CUDA kernels cannot load


def virtual_machine(executable: relax.VMExecutable, device: tvm.runtime.Device | None = None) -> relax.VirtualMachine:
    """A Relax VM for `executable` on `device` (the CPU when None); CUDA kernels without a GPU are a TargetError."""
    try:
        return relax.VirtualMachine(executable, device or tvm.cpu())
    except RuntimeError as err:
        if NO_CUDA_RUNTIME in str(err):
            raise TargetError("the executable holds CUDA kernels and this machine cannot run them (no NVIDIA GPU "
                              "or CUDA driver): build for a CPU target to run here, or read them with "
                              "relay_amp.cuda_source") from err
        raise


def run_executable(executable: relax.VMExecutable, inputs: Sequence[np.ndarray], func: str = "main") -> list[np.ndarray]:
    """Run `func` of a compiled module on the CPU; every output as a numpy array."""
    vm = virtual_machine(executable)
    result = vm[func](*(tvm.runtime.tensor(np.ascontiguousarray(x)) for x in inputs))
    return flatten_outputs(result)


def run(mod: tvm.IRModule, inputs: Sequence[np.ndarray], func: str = "main") -> list[np.ndarray]:
    """Compile `mod` for the host CPU and run `func` on `inputs`."""
    return run_executable(compile_module(mod), inputs, func)


def flatten_outputs(result) -> list[np.ndarray]:
    """A VM function's result (a tensor or nested tuples of them; or numpy arrays, as ONNX Runtime returns them) as
    a flat list of numpy arrays."""
    if isinstance(result, np.ndarray):
        return [result]
    if isinstance(result, tvm.runtime.Tensor):
        return [result.numpy()]
    outputs = []
    for item in result:
        outputs.extend(flatten_outputs(item))
    return outputs
