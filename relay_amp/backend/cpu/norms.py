"""GroupNormsOverChannels: a channels-last group norm as per-channel sums over the spatial axes, then over groups.

TVM legalizes relax.nn.group_norm over [N, H, W, C] by reshaping to [N, H, W, G, C/G] and reducing over three
axes around the group axis: no schedule vectorizes that reduction (its lanes gather across channels and pixels).
Summed per channel first, the reduction is a column reduction over the spatial axes, vectorized across the
contiguous channels (relay_amp.backend.cpu.schedules' ColumnReductionRule); the per-group sums of those C values,
the statistics and the per-channel scale and shift are tiny; the normalization is one multiply-add per element that
fuses with what follows (a ReLU, a residual add, the cast into the next kernel). The variance is the mean of squared
deviations from the mean, as the exporters' spelling computes it, not E[x²] - E[x]².

A group norm of a bf16 tensor widened to fp32 (AMP keeps group norms fp32: BiT's and ResNetV2's norms) sums the
bf16 tensor, widening it as each sum reads it, in two TE functions, and only the multiply-add reads it through the
cast. A norm of a bf16 conv's or matmul's fp32 result (AMP gives an fp32 op the accumulators unrounded) reads it
rounded to bf16 the same way, as PyTorch's autocast stores it: the kernel stored fp32 for the norm's three passes.
"""

import functools
import math
from collections.abc import Callable

import tvm
from tvm import relax, te, topi

from ..._dead_code import EliminateDeadCode
from ..._ir import calls_any_op, read_counts, rewrite_op_calls, tensor_dtype, tensor_shape
from ...dtypes import LOW_FLOAT_DTYPES
from ...ops import bound_call, bound_value, call_op_name


GROUP_NORM = "relax.nn.group_norm"
CONTRACTIONS = ("relax.nn.conv2d", "relax.matmul")


@tvm.transform.module_pass(opt_level=0, name="relay_amp.GroupNormsOverChannels")
class GroupNormsOverChannels:
    """Every fp32 group norm over its last axis (the channels of an NHWC tensor) and all spatial axes as sums per
    channel, sums per group and one multiply-add per element; the sums of a widened 16-bit float tensor read it as
    stored."""

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
    return _normalized(_ChannelSums(builder, *_summed_tensors(builder, data, reads)), gamma, beta, call.attrs)


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
    """Whether `call` is an fp32 group norm over a batched tensor's last axis, normalizing all the others but the
    first, with its scale and shift."""
    shape = tensor_shape(call.args[0])
    if shape is None or len(shape) < 3 or tensor_dtype(call.args[0]) != "float32":
        return False
    rank = len(shape)
    axes = sorted(int(axis) % rank for axis in call.attrs.axes)
    return (int(call.attrs.channel_axis) % rank == rank - 1 and axes == list(range(1, rank - 1))
            and bool(call.attrs.center) and bool(call.attrs.scale))


class _ChannelSums:
    """Per-channel sums over the spatial axes of a group norm's fp32 input `data`, or of its squared deviations
    from a mean: Relax sums of `data`, or TE functions reading `stored` (the 16-bit tensor `data` widens), if
    given."""

    def __init__(self, builder: relax.BlockBuilder, data: relax.Expr, stored: "relax.Expr | None"):
        self.builder, self.data, self.stored = builder, data, stored
        self.shape = tensor_shape(data)
        self.axes = list(range(1, len(self.shape) - 1))

    def of_values(self) -> relax.Expr:
        """The sums of the input's values."""
        if self.stored is None:
            return relax.op.sum(self.data, axis=self.axes)
        return self.builder.call_te(_widened_sums(self.axes), self.stored, primfunc_name_hint="sum")

    def of_squared_deviations(self, mean: relax.Expr) -> relax.Expr:
        """The sums of the input's squared deviations from `mean` (per channel, broadcast over the spatial axes)."""
        if self.stored is None:
            deviation = relax.op.subtract(self.data, mean)
            return relax.op.sum(relax.op.multiply(deviation, deviation), axis=self.axes)
        return self.builder.call_te(_widened_sums(self.axes, squared=True), self.stored, mean,
                                    primfunc_name_hint="subtract_multiply_sum")


def _widened_sums(axes: list[int], squared: bool = False) -> Callable:
    """A TE function: sums over `axes` of its input widened to fp32 as it is read (with `squared`, of the squared
    deviations from its second input)."""
    def compute(stored: te.Tensor, mean: "te.Tensor | None" = None) -> te.Tensor:
        values = topi.cast(stored, "float32")
        if squared:
            deviation = topi.subtract(values, mean)
            values = topi.multiply(deviation, deviation)
        return topi.sum(values, axis=axes)
    return compute


def _normalized(sums: _ChannelSums, gamma: relax.Expr, beta: relax.Expr, attrs) -> relax.Expr:
    """data * scale + shift per channel, with scale = gamma / sqrt(var + eps) and shift = beta - mean * scale from
    each channel's group statistics."""
    shape, data = sums.shape, sums.data
    batch, channels, groups = shape[0], shape[-1], int(attrs.num_groups)
    count = math.prod(shape[1:-1]) * channels // groups
    per_channel = [batch] + [1] * (len(shape) - 2) + [channels]

    grouped = (batch, groups, channels // groups)
    mean = sums.builder.emit(relax.op.reshape(
        relax.op.broadcast_to(_group_mean(sums.of_values(), shape, groups, count), grouped), per_channel))
    variance = _group_mean(sums.of_squared_deviations(mean), shape, groups, count)
    inverse = relax.op.rsqrt(relax.op.add(variance, relax.const(float(attrs.epsilon), "float32")))
    scale = relax.op.reshape(relax.op.multiply(inverse, relax.op.reshape(gamma, grouped[1:])), per_channel)
    beta_per_channel = relax.op.reshape(beta, [1] * (len(shape) - 1) + [channels])  # one for every image
    shift = relax.op.subtract(beta_per_channel, relax.op.multiply(mean, scale))
    return relax.op.add(relax.op.multiply(data, scale), shift)


def _group_mean(sums: relax.Expr, shape: tuple, groups: int, count: int) -> relax.Expr:
    """The mean over each group's channels of per-channel `sums` ([N, C] of an [N, *spatial, C] `shape`) of `count`
    values per group, as [N, G, 1]."""
    grouped = relax.op.sum(relax.op.reshape(sums, (shape[0], groups, shape[-1] // groups)), axis=[2], keepdims=True)
    return relax.op.divide(grouped, relax.const(float(count), "float32"))
