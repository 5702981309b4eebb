"""Relax functions rebuilt from binding blocks as given (TVM's normalizer would join adjacent dataflow blocks), and
modules with one function replaced."""

import tvm
from tvm import relax


def with_blocks(func: relax.Function, blocks: list) -> relax.Function:
    """`func` with the binding blocks of its body replaced by `blocks`, kept apart, the body's type as before."""
    body = relax.SeqExpr(blocks, func.body.body)
    relax.expr._update_type(body, func.body.ty)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def with_function(mod: tvm.IRModule, gvar: "relax.GlobalVar | str", func: relax.Function) -> tvm.IRModule:
    """A copy of `mod` with the function of `gvar` (or of that name) replaced by `func`."""
    updated = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    updated[gvar] = func
    return updated
