"""ONNX's Pad, which TVM's importer writes as a call of a TE function, as relax.nn.pad: constant pads, and reflect
and edge pads (TResNet's anti-aliased downsampling, style-transfer and super-resolution nets); one of width zero as
its input."""

import numpy as np
import tvm
from tvm import relax

from ._ir import only_store, rewrite_te_calls


MODES = {"reflect": "reflect", "edge": "replicate"}  # numpy's pad modes -> relax.nn.pad's


def pads_as_ops(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` with every call of a PrimFunc that pads a tensor with a constant (topi.nn.pad, as TVM's ONNX importer
    writes Pad) or by mirroring its border (topi.nn.mirror_pad: reflect and edge modes) as relax.nn.pad: an op the
    passes can see, move and fold (a call_tir is opaque to them)."""
    return rewrite_te_calls(mod, func, _as_pad)


def _as_pad(call: relax.Call, prim_func: tvm.tirx.PrimFunc) -> "relax.Expr | None":
    if len(call.args[1].fields) != 1:
        return None
    data, pad = call.args[1].fields[0], constant_pad(prim_func)
    if pad is not None:
        return relax.op.nn.pad(data, pad[0], pad_value=pad[1])
    gathered = _gathered_reads(prim_func)
    if gathered is None:
        return None
    if _copies(*gathered):
        return data  # a pad of width zero, in any mode (EnCodec's before convs whose padding is 0): no copy
    mirrored = _mirrored(*gathered)
    return None if mirrored is None else relax.op.nn.pad(data, mirrored[0], pad_mode=mirrored[1])


def _gathered_reads(func: "tvm.tirx.PrimFunc | None") -> "tuple[list[list[int]], list[int]] | None":
    """(per output axis the input positions its store reads, the input's shape) of a PrimFunc whose one store gathers
    its input, out[i...] = x[f0(i0), f1(i1), ...], each fi a function of its own axis, else None."""
    node = only_store(func)
    if node is None or len(func.params) != 2 or not isinstance(node.value, tvm.ir.expr.TensorLoad):
        return None
    load = node.value
    in_shape, out_shape = [int(n) for n in load.source.shape], [int(n) for n in node.buffer.shape]
    if len(in_shape) != len(out_shape) or len(node.indices) != len(load.indices):
        return None
    reads = [_reads(index, var, size_out) for index, var, size_out in zip(load.indices, node.indices, out_shape)]
    return None if None in reads else (reads, in_shape)


def _copies(reads: list[list[int]], in_shape: list[int]) -> bool:
    """Whether a gather's `reads` (`_gathered_reads`) read every position of its input where they write it."""
    return all(read == list(range(size)) for read, size in zip(reads, in_shape))


def mirrored_pad(func: "tvm.tirx.PrimFunc | None") -> "tuple[list[int], str] | None":
    """(pad_width as [before0, after0, ...], relax.nn.pad's mode) of a PrimFunc whose one store gathers its input,
    out[i...] = x[f0(i0), f1(i1), ...], each fi the index numpy's reflect or edge pad reads, else None."""
    gathered = _gathered_reads(func)
    return None if gathered is None else _mirrored(*gathered)


def _mirrored(reads: list[list[int]], in_shape: list[int]) -> "tuple[list[int], str] | None":
    """`mirrored_pad` of a gather's `reads` (`_gathered_reads`) from an input of `in_shape`."""
    for mode in MODES:
        widths = [_mirrored_widths(read, size_in, mode) for read, size_in in zip(reads, in_shape)]
        if None not in widths and any(any(pair) for pair in widths):
            return [width for pair in widths for width in pair], MODES[mode]
    return None


def _reads(index, var, size_out: int) -> "list[int] | None":
    """The input position `index` reads for each `var` in [0, size_out), where it depends on `var` alone."""
    if not isinstance(var, tvm.tirx.Var):
        return None
    if index.same_as(var):
        return list(range(size_out))
    read = []
    for at in range(size_out):
        position = _at(index, var, at)
        if not isinstance(position, tvm.tirx.IntImm):
            return None
        read.append(int(position.value))
    return read


def _mirrored_widths(read: list[int], size_in: int, mode: str) -> "tuple[int, int] | None":
    """(before, after) where `read`, an output axis's input positions, is what numpy's `mode` pad of [0, size_in)
    reads, each width under size_in (a wider reflect wraps again, and an axis of one repeated is a broadcast, not a
    pad: grouped attention heads), else None."""
    size_out = len(read)
    if size_out < size_in or (size_in < 2 and size_out > size_in):
        return None
    extra = size_out - size_in
    for before in range(max(0, extra - size_in + 1), min(extra, size_in - 1) + 1):
        if read == np.pad(np.arange(size_in), (before, extra - before), mode=mode).tolist():
            return before, extra - before
    return None


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


def _at(index, var: tvm.tirx.Var, at: int):
    """`index` simplified with `var` bound to `at`: a constant where it depends on `var` alone."""
    analyzer = tvm.sym.Analyzer()
    analyzer.bind(var, tvm.tirx.const(at, str(var.ty.dtype)))
    return analyzer.simplify(index)
