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

A part whose channels are off the 16-lane vectors (MixNet's 90, 120 and 300) vectorized by the largest divisor
of its width: 15 lanes, which LLVM loads as 8, 4, 2 and 1 apart, or 8 (half a zmm). Where a concatenation is all
that reads the conv's result (through its bias and cast), the conv computes whole vectors instead, reading the
split tensor's neighbouring channels (after the part where the tensor has them, else before it) with zero weights
for them; its elementwise ops run on the same channels, and the concatenation, a TE function of its own, reads
each part where it lies (a slice would fuse into the conv's function, whose write-back then stored lane by lane).
MixNet-S on Zen 5, one process, outputs bit-identical: bf16 B/A 0.951, fp32 0.976; its convs of 120 channels
0.268 -> 0.144 ms in bf16, of 300 0.158 -> 0.105, of 90 0.126 -> 0.116.

A part that AMP rounds to bf16 for its conv is read the same way, rounded as it is loaded: InceptionNeXt's token
mixer in int8q splits the block's fp32 input, whose identity part is quantized with the concatenation, and each
other part ran as a function of its own slicing and rounding it, convolved on 10 channels by the generic conv
(InceptionNeXt-Atto int8q on Zen 5, one process: B/A 0.953, bit-identical).

Any concatenation of NHWC channels reads its inputs' channel slices so, in place: GhostNet's ghost modules join
a kernel's result and a depthwise conv of it, both computed on channels padded to whole vectors (dispatch) and
sliced, and the depthwise conv's function had taken the slice and stored 24 of its 32 channels lane by lane (in
bf16 0.084 ms against 0.023 without). GhostNet-1.0 on Zen 5, one process, bit-identical: bf16 B/A 0.818, fp32
0.997.
"""

import numpy as np
import tvm
from tvm import relax, te, tirx, topi

from ..._ir import (binding_readers, depthwise_weight, rewrite_each_function, slice_window, split_part_bounds,
                     tensor_dtype, tensor_shape)
from ...ops import bound_call, bound_value, call_op_name, sliced_by_binding, tuple_fields
from .dispatch import WIDENABLE, widenable_operand
from .schedules import ACCUMULATOR_LANES

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
MAX_EXTRA_SHARE = 8  # a part of whole 8-lane vectors gets channels up to 16-lane ones where that adds at most 1/8


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


@relax.expr_functor.mutator
class _SplitPartReader(relax.PyExprMutator):
    """Rewrites depthwise convs of split parts as TE functions reading the split tensor in place, on whole vectors of
    channels where the tensor holds the neighbouring channels that fill them, the elementwise ops after such a conv
    (its bias, a cast) on the same vectors, and concatenations of channel slices as TE functions reading the sliced
    tensors."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        super().__init__(mod)
        self.concatenated = _concatenated_convs(func)
        self.margins: dict[relax.Var, tuple[int, int]] = {}  # a result on whole vectors: channels before, after

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if call_op_name(new_call) == "relax.nn.conv2d":
            replaced = self._depthwise_in_place(new_call, call in self.concatenated)
        elif call_op_name(new_call) == "relax.concat":
            replaced = self._concat_of_wholes(new_call)
        else:
            replaced = self._on_whole_vectors(new_call)
        return new_call if replaced is None else replaced

    def _depthwise_in_place(self, call: relax.Call, concatenated: bool) -> "relax.Expr | None":
        """`call` (a conv2d) as a TE function reading its part of a split tensor in place, where it is a depthwise
        NHWC conv of float data, one output channel per input channel, with a constant weight, of such a part (or
        of its cast, which the function then computes as it reads); else None. Where only a concatenation reads its
        result (through elementwise ops), the function computes the channels `_vector_margins` adds too (zero
        weights), and the concatenation reads its part of the result."""
        attrs, data, weight = call.attrs, call.args[0], call.args[1]
        values = depthwise_weight(call)
        if values is None or tensor_dtype(data) not in FLOAT_DTYPES:
            return None
        layout, channels = str(attrs.kernel_layout), tensor_shape(data)[3]
        part = _split_part(self.builder_, data)
        cast = bound_call(self, data, "relax.astype") if part is None else None
        if cast is not None and tensor_dtype(cast.args[0]) in FLOAT_DTYPES:
            part = _split_part(self.builder_, cast.args[0])  # a part AMP casts for the conv: cast as it is read
        if part is None:
            return None
        whole, offset = part
        before, after = _vector_margins(channels, offset, tensor_shape(whole)[3]) if concatenated else (0, 0)
        hwio = np.transpose(values, [layout.index(axis) for axis in "HWIO"])
        hwio = relax.const(np.ascontiguousarray(np.pad(hwio, [(0, 0)] * 3 + [(before, after)])), tensor_dtype(weight))
        out_dtype = str(attrs.out_dtype)
        out_dtype = tensor_dtype(data) if out_dtype in ("", "void", "None") else out_dtype  # unset: the data's
        window = (offset - before, before + channels + after, tensor_dtype(data))
        result = self.builder_.call_te(_depthwise_nhwc_at, whole, hwio, window, [int(s) for s in attrs.strides],
                                       [int(p) for p in attrs.padding], [int(d) for d in attrs.dilation], out_dtype,
                                       primfunc_name_hint="depthwise_conv2d_at")
        return self._part_of(result, before, after)

    def _on_whole_vectors(self, call: relax.Call) -> "relax.Expr | None":
        """An elementwise op (dispatch's WIDENABLE: one tensor operand, the others constants) of the part of a
        result on whole vectors as the op on the whole vectors, its per-channel constants given the op's neutral
        value on the added channels, sliced after; None for any other call."""
        operand = widenable_operand(call)
        whole = None if operand is None else sliced_by_binding(self, call.args[operand])
        if whole not in self.margins or tensor_shape(call) != tensor_shape(call.args[operand]):
            return None
        before, after = self.margins[whole]
        args = [whole if i == operand else _margined_constant(call, arg, before, after)
                for i, arg in enumerate(call.args)]
        return self._part_of(relax.Call(call.op, args, call.attrs), before, after)

    def _concat_of_wholes(self, call: relax.Call) -> "relax.Expr | None":
        """A concatenation of NHWC channels some of whose inputs are channel slices (the parts of results on whole
        vectors, or a kernel's or depthwise conv's channels padded to whole vectors: GhostNet's ghost modules) as a
        TE function reading each sliced tensor's channels in place: as a slice in a function of its own, it would
        fuse into the producer's, whose write-back then stored its channels lane by lane (GhostNet's depthwise
        convs in bf16 took 3x their fp32 time). None for any other concatenation."""
        fields = tuple_fields(self, call.args[0])
        if not fields or int(call.attrs.axis) % 4 != 3 or len(tensor_shape(call) or ()) != 4:
            return None
        windows = [self._channel_window(field) for field in fields]
        if all(read.same_as(field) for field, (read, _) in zip(fields, windows)):
            return None
        return self.builder_.call_te(_concat_of_parts, [read for read, _ in windows],
                                     [window for _, window in windows], primfunc_name_hint="concatenate")

    def _channel_window(self, field: relax.Expr) -> "tuple[relax.Expr, tuple[int, int]]":
        """(the tensor `field` slices, the channels [begin, end) it takes) where it is a slice of NHWC channels
        alone, else (`field`, all its channels)."""
        sliced = bound_call(self, field, "relax.strided_slice")
        window = None if sliced is None else slice_window(sliced)
        if window is None or window[0][:3] != [0, 0, 0] or window[1][:3] != list(tensor_shape(sliced.args[0])[:3]):
            return field, (0, tensor_shape(field)[3])
        return sliced.args[0], (window[0][3], window[1][3])

    def _part_of(self, result: relax.Expr, before: int, after: int) -> relax.Expr:
        """`result` (NHWC) without the `before` and `after` channels it was computed on to fill whole vectors."""
        if not before and not after:
            return result
        whole = self.builder_.emit(result)
        self.margins[whole] = (before, after)
        return relax.op.strided_slice(whole, axes=[3], begin=[before], end=[tensor_shape(whole)[3] - after])


def _concatenated_convs(func: relax.Function) -> set[relax.Call]:
    """The conv2d calls of `func` whose result only a concatenation of channels reads, through elementwise ops
    (dispatch's WIDENABLE) that only it reads."""
    readers = binding_readers(func)
    return {binding.value for block in func.body.blocks for binding in block.bindings
            if call_op_name(binding.value) == "relax.nn.conv2d" and _only_concatenated(binding.var, readers)}


def _only_concatenated(var: relax.Var, readers: dict) -> bool:
    """Whether a concatenation of NHWC channels is the one reader of `var`, through elementwise ops with one reader
    each."""
    while len(readers.get(var, [])) == 1 and readers[var][0] is not None:
        value = readers[var][0].value
        if call_op_name(value) == "relax.concat":
            return int(value.attrs.axis) % 4 == 3
        operand = widenable_operand(value)
        if operand is None or not value.args[operand].same_as(var):
            return False
        var = readers[var][0].var
    return False


def _vector_margins(channels: int, offset: int, available: int) -> tuple[int, int]:
    """Channels to add before and after a part of `channels` at `offset` in a tensor of `available` channels so that
    its depthwise conv fills whole 16-lane vectors: after it where the tensor has them, else before it. A part of
    whole 8-lane vectors gets them only where they add at most 1/MAX_EXTRA_SHARE (120 of 128: a core that splits a
    zmm operation in two, Zen 4, computes lanes, not vectors). (0, 0) where none fit or none are needed. Vectors
    of 15 lanes (90 and 300 channels) loaded their 8, 4, 2 and 1 channels apart."""
    extra = -channels % ACCUMULATOR_LANES
    if not extra or (channels % 8 == 0 and extra * MAX_EXTRA_SHARE > channels):
        return 0, 0
    if offset + channels + extra <= available:
        return 0, extra
    return (extra, 0) if offset >= extra else (0, 0)


def _margined_constant(call: relax.Call, constant: relax.Expr, before: int, after: int) -> relax.Expr:
    """An elementwise op's constant operand with `before` and `after` channels of the op's neutral value where it
    has one value per channel; any other operand as it is."""
    if not isinstance(constant, tvm.ir.expr.Constant) or constant.value.numpy().ndim == 0:
        return constant
    values = constant.value.numpy()
    if values.shape[-1] == 1:
        return constant
    widths = [(0, 0)] * (values.ndim - 1) + [(before, after)]
    return relax.const(np.pad(values, widths, constant_values=WIDENABLE[call.op.name]), tensor_dtype(constant))


def _depthwise_nhwc_at(data: te.Tensor, weight: te.Tensor, window: tuple, strides, padding, dilation,
                       out_dtype: str) -> te.Tensor:
    """A depthwise NHWC conv of `data`'s channels [offset, offset + channels) cast to dtype, for `window` (offset,
    channels, dtype), by an HWIO `weight` (I = 1)."""
    offset, channels, dtype = int(window[0]), int(window[1]), str(window[2])
    batch, height, width, _ = (int(d) for d in data.shape)
    taps_h, taps_w = int(weight.shape[0]), int(weight.shape[1])
    top, left, bottom, right = padding
    out_h = (height + top + bottom - dilation[0] * (taps_h - 1) - 1) // strides[0] + 1
    out_w = (width + left + right - dilation[1] * (taps_w - 1) - 1) // strides[1] + 1
    zero = tirx.const(0, dtype)
    padded = te.compute(
        (batch, height + top + bottom, width + left + right, channels),
        lambda n, y, x, c: tirx.if_then_else(
            tirx.all(y >= top, y < height + top, x >= left, x < width + left),
            data[n, y - top, x - left, offset + c].astype(dtype), zero), name="pad_temp")
    ry, rx = te.reduce_axis((0, taps_h), "ry"), te.reduce_axis((0, taps_w), "rx")
    return te.compute(
        (batch, out_h, out_w, channels),
        lambda n, y, x, c: te.sum(
            padded[n, y * strides[0] + ry * dilation[0], x * strides[1] + rx * dilation[1], c].astype(out_dtype)
            * weight[ry, rx, 0, c].astype(out_dtype), axis=[ry, rx]),
        name="depthwise_conv2d_nhwc")


def _concat_of_parts(tensors: list[te.Tensor], windows: list[tuple[int, int]]) -> te.Tensor:
    """The channels [begin, end) of each NHWC tensor of `tensors`, concatenated."""
    parts = [topi.strided_slice(tensor, [0, 0, 0, begin], [*tensor.shape[:3], end])
             for tensor, (begin, end) in zip(tensors, windows)]
    return topi.concatenate(parts, axis=3)


@tvm.transform.module_pass(opt_level=0, name="DepthwiseReadsSplitInPlace")
class DepthwiseReadsSplitInPlace:
    """Every depthwise NHWC conv (one output channel per input channel, a constant weight, float data) of a part of
    a channel split as a TE function reading that part of the split tensor in place, and every concatenation of
    NHWC channel slices as a TE function reading the sliced tensors; splits left unread go."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function of `mod`."""
        return rewrite_each_function(mod, _SplitPartReader)
