"""ONNX's constant Pad, which TVM's importer writes as a call of a TE function, as relax.nn.pad."""

import tvm
from tvm import relax

from ._ir import only_store, rewrite_te_calls


def pads_as_ops(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` with every call of a PrimFunc that pads a tensor with a constant (topi.nn.pad, as TVM's ONNX importer
    writes Pad) as relax.nn.pad: an op the passes can see, move and fold (a call_tir is opaque to them)."""
    return rewrite_te_calls(mod, func, _as_pad)


def _as_pad(call: relax.Call, prim_func: tvm.tirx.PrimFunc) -> "relax.Expr | None":
    pad = constant_pad(prim_func)
    if pad is None or len(call.args[1].fields) != 1:
        return None
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
