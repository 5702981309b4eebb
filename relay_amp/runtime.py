"""Compile a module on the host CPU and run it on the Relax VM: the numeric ground truth of the tests."""

from collections.abc import Sequence

import numpy as np
import tvm
from tvm import relax


def compile_module(mod: tvm.IRModule, target: tvm.target.Target | None = None) -> relax.VMExecutable:
    """Compile `mod` with TVM's default pipeline for `target` (the host CPU when None)."""
    return tvm.compile(mod, target=target or tvm.target.Target("llvm"))


def run_executable(executable: relax.VMExecutable, inputs: Sequence[np.ndarray], func: str = "main") -> list[np.ndarray]:
    """Run `func` of a compiled module on the CPU; every output as a numpy array."""
    vm = relax.VirtualMachine(executable, tvm.cpu())
    result = vm[func](*(tvm.runtime.tensor(np.ascontiguousarray(x)) for x in inputs))
    return _flatten(result)


def run(mod: tvm.IRModule, inputs: Sequence[np.ndarray], func: str = "main") -> list[np.ndarray]:
    """Compile `mod` for the host CPU and run `func` on `inputs`."""
    return run_executable(compile_module(mod), inputs, func)


def _flatten(result) -> list[np.ndarray]:
    if isinstance(result, tvm.runtime.Tensor):
        return [result.numpy()]
    outputs = []
    for item in result:
        outputs.extend(_flatten(item))
    return outputs
