"""GroupNormsOverChannels: a channels-last group norm as per-channel sums over the spatial axes, then over groups.

TVM legalizes relax.nn.group_norm over [N, H, W, C] by reshaping to [N, H, W, G, C/G] and reducing over three
axes around the group axis: no schedule vectorizes that reduction (its lanes gather across channels and pixels).
Summed per channel first, the reduction is a column reduction over the spatial axes, vectorized across the
contiguous channels (relay_amp.backend.cpu.schedules' ColumnReductionRule); the normalization is one multiply-add
per element that fuses with what follows (a ReLU, a residual add, the cast into the next kernel).

The per-channel sums are of each value's deviation from the channel's first value, and of its square, in one pass
over the tensor (`_moments`: one reduction of two values). E[x²] - E[x]² in fp32 (TVM's legalization) loses the
variance's digits where the mean dwarfs the deviations; the squared deviations from the mean (the exporters'
spelling) keep them but take a second pass after the mean; deviations from a value of the channel keep them in
one. One small function of their own (`_group_affine`, unscheduled and opaque to fusion) turns the C pairs of sums
into each group's mean and variance (its channels' own spread plus their means' spread about the group's mean) and
each channel's scale and shift. Against the two passes and the per-group sums, divides and broadcasts that were
functions of their own, on a 2-core Sapphire Rapids: BiT-R50 bf16 and int8q 0.92-0.93x the time (fp32 0.98-1.01x,
where the kernels' time dominates), PoolFormer-S12 0.96-0.99x, wav2vec2 int8q 0.94x.

A group norm of a bf16 tensor widened to fp32 (AMP keeps group norms fp32: BiT's and ResNetV2's norms) sums the
bf16 tensor, widening it as the sums read it, and only the multiply-add reads it through the cast. A norm of a
bf16 conv's or matmul's fp32 result (AMP gives an fp32 op the accumulators unrounded) reads it rounded to bf16 the
same way, as PyTorch's autocast stores it: the kernel stored fp32 for the norm's passes.
"""

import functools
import math
from collections.abc import Callable

import tvm
from tvm import relax, te

from ..._dead_code import EliminateDeadCode
from ..._ir import (calls_any_op, is_static_shape, opaque_scheduled, read_counts, rewrite_op_calls, tensor_dtype,
                    tensor_shape)
from ...dtypes import LOW_FLOAT_DTYPES
from ...ops import bound_call, bound_value, call_op_name


GROUP_NORM = "relax.nn.group_norm"
CONTRACTIONS = ("relax.nn.conv2d", "relax.matmul")


@tvm.transform.module_pass(opt_level=0, name="relay_amp.GroupNormsOverChannels")
class GroupNormsOverChannels:
    """Every fp32 group norm over its last axis (the channels of an NHWC tensor) and all spatial axes as one pass of
    sums per channel, a function of each channel's scale and shift, and one multiply-add per element; the sums of a
    widened 16-bit float tensor read it as stored."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """`mod` with its channels-last group norms rewritten; the input module is left as it was."""
        if not calls_any_op(mod, [GROUP_NORM]):
            return mod
        rewritten = mod
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                reads = read_counts(func)
                rewrite = functools.partial(_rewritten, reads=reads)
                rewritten = rewrite_op_calls(rewritten, gv.name_hint, {GROUP_NORM: rewrite})
        return EliminateDeadCode()(rewritten)


def _rewritten(call: relax.Call, builder: relax.BlockBuilder, reads: dict) -> "relax.Expr | None":
    """The group norm `call` as sums and a multiply-add, or None where it is not over channels last; `reads` counts
    the readers of each var of the function."""
    if not _over_channels_last(call):
        return None
    data, gamma, beta = call.args
    return _normalized(builder, *_summed_tensors(builder, data, reads), gamma, beta, call.attrs)


def _summed_tensors(builder: relax.BlockBuilder, data: relax.Expr,
                    reads: dict) -> "tuple[relax.Expr, relax.Expr | None]":
    """The fp32 tensor a norm of `data` multiplies and the 16-bit tensor its sums read (None: they read the fp32
    one): a widened tensor's cast and the tensor itself; a bf16 conv's or matmul's result, where the norm is its one
    reader, rounded to bf16 (the kernel's write-back) and widened again; else `data`."""
    cast = bound_call(builder, data, "relax.astype")
    if cast is not None and tensor_dtype(cast.args[0]) in LOW_FLOAT_DTYPES:
        return data, cast.args[0]
    product = bound_value(builder, data)
    if (call_op_name(product) in CONTRACTIONS and tensor_dtype(product.args[0]) in LOW_FLOAT_DTYPES
            and reads.get(data) == 1):  # another reader would keep the kernel storing fp32, and add a rounded copy
        stored = builder.emit(relax.op.astype(data, tensor_dtype(product.args[0])))
        return builder.emit(relax.op.astype(stored, "float32")), stored
    return data, None


def _over_channels_last(call: relax.Call) -> bool:
    """Whether `call` is an fp32 group norm of a static shape over a batched tensor's last axis, normalizing all the
    others but the first, with its scale and shift."""
    shape = tensor_shape(call.args[0])
    if not is_static_shape(shape) or len(shape) < 3 or tensor_dtype(call.args[0]) != "float32":
        return False
    rank = len(shape)
    axes = sorted(int(axis) % rank for axis in call.attrs.axes)
    return (int(call.attrs.channel_axis) % rank == rank - 1 and axes == list(range(1, rank - 1))
            and bool(call.attrs.center) and bool(call.attrs.scale))


def _normalized(builder: relax.BlockBuilder, data: relax.Expr, stored: "relax.Expr | None", gamma: relax.Expr,
                beta: relax.Expr, attrs) -> relax.Expr:
    """data * scale + shift per channel, with scale = gamma / sqrt(var + eps) and shift = beta - mean * scale from
    each channel's group statistics, which one pass over `stored` (the 16-bit tensor `data` widens), else over
    `data`, gathers (`_moments`)."""
    read = data if stored is None else stored
    moments = builder.emit(builder.call_te(_moments, read, primfunc_name_hint="moments"))
    affine = _opaque_call(builder, _group_affine(int(attrs.num_groups), float(attrs.epsilon)), {
        "sums": relax.TupleGetItem(moments, 0), "squares": relax.TupleGetItem(moments, 1), "values": read,
        "gamma": gamma, "beta": beta}, "scale_and_shift")
    return relax.op.add(relax.op.multiply(data, relax.TupleGetItem(affine, 0)), relax.TupleGetItem(affine, 1))


def _moments(values: te.Tensor) -> "list[te.Tensor]":
    """Per image and channel of `values` ([N, *spatial, C], widened to fp32 as it is read), the sum of its values'
    deviations from the channel's first value and the sum of their squares, in one reduction over the spatial axes:
    one pass over the tensor, and the variance keeps its digits where the mean dwarfs the deviations."""
    spatial = [te.reduce_axis((0, extent), f"k{axis}") for axis, extent in enumerate(values.shape[1:-1])]

    def deviations(image, channel):
        deviation = _widened(values[(image, *spatial, channel)]) - _first_value(values, image, channel)
        return SUMS_AND_SQUARES((deviation, deviation * deviation), axis=spatial)
    return list(te.compute((values.shape[0], values.shape[-1]), deviations, name="moments"))


def _first_value(values: te.Tensor, image, channel) -> tvm.ir.Expr:
    """The channel's value at the first spatial position of the image, as fp32."""
    return _widened(values[(image, *[0] * (len(values.shape) - 2), channel)])


def _widened(value: tvm.ir.Expr) -> tvm.ir.Expr:
    """`value` as fp32; a bf16 value's bits shifted into place (TVM's bf16 legalization mistranslates a cast in a
    reduction of two values: its sums came out as garbage)."""
    if value.dtype != "bfloat16":
        return value.astype("float32")
    bits = tvm.tirx.Cast("uint32", tvm.tirx.reinterpret("uint16", value)) << tvm.tirx.const(16, "uint32")
    return tvm.tirx.reinterpret("float32", bits)


SUMS_AND_SQUARES = te.comm_reducer(lambda x, y: (x[0] + y[0], x[1] + y[1]),
                                   lambda t0, t1: (tvm.tirx.const(0, t0), tvm.tirx.const(0, t1)),
                                   name="sums_and_squares")


def _group_affine(groups: int, epsilon: float) -> Callable:
    """A TE function: from the per-channel sums and square sums of deviations from each channel's first value
    (`_moments`), that tensor, gamma and beta, the per-channel scale and shift of a group norm of `groups` groups,
    each [N, 1.., C]. A group's variance is the mean of its channels' own (sums of squared deviations from their
    means) plus their means' spread about the group's mean."""
    def compute(sums: te.Tensor, squares: te.Tensor, values: te.Tensor, gamma: te.Tensor, beta: te.Tensor):
        batch, channels = (int(extent) for extent in sums.shape)
        per_group, count = channels // groups, math.prod(int(extent) for extent in values.shape[1:-1])
        channel_means = te.compute((batch, channels), lambda image, channel: _first_value(
            values, image, channel) + sums[image, channel] * (1 / count), name="channel_mean")
        means = _group_sums(lambda image, _, channel: channel_means[image, channel] * (1 / per_group), batch, groups,
                            per_group, "group_mean")

        def spread(image, group, channel):
            offset = channel_means[image, channel] - means[image, group]
            own = squares[image, channel] - sums[image, channel] * sums[image, channel] * (1 / count)
            return (own + count * offset * offset) * (1 / (count * per_group))
        variances = _group_sums(spread, batch, groups, per_group, "group_variance")
        per_channel = (batch, *[1] * (len(values.shape) - 2), channels)
        scale = te.compute(per_channel, lambda image, *axes: gamma[axes[-1]] * tvm.tirx.rsqrt(
            variances[image, axes[-1] // per_group] + epsilon), name="scale")
        shift = te.compute(per_channel, lambda image, *axes: beta[axes[-1]] - means[image, axes[-1] // per_group]
                           * scale[(image, *axes)], name="shift")
        return [scale, shift]
    return compute


def _group_sums(term: Callable, batch: int, groups: int, per_group: int, name: str) -> te.Tensor:
    """[N, G]: the sum of `term(image, group, channel)` over each group's `per_group` channels."""
    member = te.reduce_axis((0, per_group), "member")
    return te.compute((batch, groups), lambda image, group: te.sum(term(image, group, group * per_group + member),
                                                                 axis=member), name=name)


def _opaque_call(builder: relax.BlockBuilder, te_func: Callable, named_args: dict, name: str) -> relax.Expr:
    """A call of `te_func` on the values of `named_args`, unscheduled (a few values a channel: a loop of its own)
    and opaque to operator fusion (joined to the multiply-add, it would compute the statistics for each element)."""
    args = [builder.emit(arg) if isinstance(arg, relax.TupleGetItem) else arg for arg in named_args.values()]
    placeholders = [te.placeholder(tensor_shape(arg), tensor_dtype(arg), arg_name)
                    for arg_name, arg in zip(named_args, args)]
    outputs = te_func(*placeholders)
    func = te.create_prim_func([*placeholders, *outputs]).without_attr("global_symbol")
    gv = builder.add_func(opaque_scheduled(func), name)
    out_types = [relax.TensorType([int(d) for d in out.shape], out.dtype) for out in outputs]
    return builder.emit(relax.call_tir(gv, args, out_types))
