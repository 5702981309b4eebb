"""Small Relax modules for tests: one `main` whose single dataflow output is an expression of its parameters."""

from collections.abc import Callable

import tvm
from tvm import relax


def tensor(name: str, shape: tuple, dtype: str = "float32") -> relax.Var:
    """A tensor parameter of `main`."""
    return relax.Var(name, relax.TensorType(shape, dtype))


def single_output_module(build_body: Callable[..., relax.Expr], *params: relax.Var) -> tvm.IRModule:
    """`main(*params)` returning `build_body(*params)`, bound once as the dataflow block's output."""
    bb = relax.BlockBuilder()
    with bb.function("main", list(params)):
        with bb.dataflow():
            out = bb.emit_output(build_body(*params))
        bb.emit_func_output(out)
    return bb.get()
