"""Compile a module on the host CPU and run it on the Relax VM: the numeric ground truth of the tests."""

from collections.abc import Sequence

import numpy as np
import tvm
from tvm import relax

from .errors import TargetError


def compile_module(mod: tvm.IRModule, target: tvm.target.Target | None = None) -> relax.VMExecutable:
    """Compile `mod` with TVM's default pipeline for `target` (the host CPU when None)."""
    return tvm.compile(mod, target=target or tvm.target.Target("llvm"))


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
    """A VM function's result (a tensor or nested tuples of them) as a flat list of numpy arrays."""
    if isinstance(result, tvm.runtime.Tensor):
        return [result.numpy()]
    outputs = []
    for item in result:
        outputs.extend(flatten_outputs(item))
    return outputs
