"""ONNX's constant Pad, which TVM's importer writes as a call of a TE function, as relax.nn.pad."""

import tvm
from tvm import relax

from ._ir import called_prim_func, only_store, rewrite_function


def pads_as_ops(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` with every call of a PrimFunc that pads a tensor with a constant (topi.nn.pad, as TVM's ONNX importer
    writes Pad) as relax.nn.pad: an op the passes can see, move and fold (a call_tir is opaque to them)."""
    lifted = rewrite_function(_PadLifter(mod), mod, func)
    return relax.transform.DeadCodeElimination([func])(lifted)


@relax.expr_functor.mutator
class _PadLifter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        pad = constant_pad(called_prim_func(self.mod, call))
        if pad is None or len(call.args[1].fields) != 1:
            return call
        widths, value = pad
        return relax.op.nn.pad(call.args[1].fields[0], widths, pad_value=value)


def constant_pad(func: "tvm.tirx.PrimFunc | None") -> "tuple[list[int], float] | None":
    """(pad_width as [before0, after0, before1, ...], value) of a PrimFunc whose one store is
    out[i...] = if_then_else(cond, x[i0 - before0, ...], value), else None."""
    node = only_store(func)
    if node is None or len(func.params) != 2 or not _is_if_then_else(node.value):
        return None
    load, fill = node.value.args[1], node.value.args[2]
    if not isinstance(load, tvm.ir.expr.TensorLoad) or not isinstance(fill, tvm.tirx.FloatImm | tvm.tirx.IntImm):
        return None
    befores = [_offset(index, var) for index, var in zip(load.indices, node.indices)]
    in_shape, out_shape = load.source.shape, node.buffer.shape
    if None in befores or len(befores) != len(in_shape):
        return None
    widths = []
    for before, size_in, size_out in zip(befores, in_shape, out_shape):
        widths += [before, int(size_out) - int(size_in) - before]
    return (widths, float(fill.value)) if min(widths) >= 0 else None


def _is_if_then_else(value) -> bool:
    return isinstance(value, tvm.ir.expr.Call) and getattr(value.op, "name", "") == "prim.if_then_else"


def _offset(index, var) -> int | None:
    """c where `index` is `var - c` (0 where it is `var`), None otherwise."""
    if index.same_as(var):
        return 0
    if isinstance(index, tvm.tirx.Sub) and index.a.same_as(var) and isinstance(index.b, tvm.tirx.IntImm):
        return int(index.b.value)
    return None
