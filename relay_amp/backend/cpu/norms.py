"""GroupNormsOverChannels: a channels-last group norm as per-channel sums over the spatial axes, then over groups.

TVM legalizes relax.nn.group_norm over [N, H, W, C] by reshaping to [N, H, W, G, C/G] and reducing over three
axes around the group axis: no schedule vectorizes that reduction (its lanes gather across channels and pixels).
Summed per channel first, the reduction is a column reduction over the spatial axes, vectorized across the
contiguous channels (relay_amp.backend.cpu.schedules' ColumnReductionRule); the per-group sums of those C values,
the statistics and the per-channel scale and shift are tiny; the normalization is one multiply-add per element that
fuses with what follows (a ReLU, a residual add, the cast into the next kernel). The variance is the mean of squared
deviations from the mean, as the exporters' spelling computes it, not E[x²] - E[x]².
"""

import math

import tvm
from tvm import relax
from tvm.relax import dpl

from ..._ir import tensor_dtype, tensor_shape


@relax.transform.function_pass(opt_level=0, name="relay_amp.GroupNormsOverChannels")
class GroupNormsOverChannels:
    """Every fp32 group norm over its last axis (the channels of an NHWC tensor) and all spatial axes as sums per
    channel, sums per group and one multiply-add per element."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
        """`func` with its channels-last group norms rewritten; the input module is left as it was."""
        data, gamma, beta = dpl.wildcard(), dpl.wildcard(), dpl.wildcard()

        def rewrite(call: relax.Call, matches: dict) -> relax.Expr:
            if not _over_channels_last(call):
                return call
            return _normalized(matches[data], matches[gamma], matches[beta], call.attrs)

        return dpl.rewrite_call(dpl.is_op("relax.nn.group_norm")(data, gamma, beta), rewrite, func)


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


def _normalized(data: relax.Expr, gamma: relax.Expr, beta: relax.Expr, attrs) -> relax.Expr:
    """data * scale + shift per channel, with scale = gamma / sqrt(var + eps) and shift = beta - mean * scale from
    each channel's group statistics."""
    shape = tensor_shape(data)
    batch, channels, groups = shape[0], shape[-1], int(attrs.num_groups)
    count = math.prod(shape[1:-1]) * channels // groups
    per_channel = [batch] + [1] * (len(shape) - 2) + [channels]

    grouped = (batch, groups, channels // groups)
    mean = relax.op.reshape(relax.op.broadcast_to(_group_mean(data, shape, groups, count), grouped), per_channel)
    deviation = relax.op.subtract(data, mean)
    variance = _group_mean(relax.op.multiply(deviation, deviation), shape, groups, count)
    inverse = relax.op.rsqrt(relax.op.add(variance, relax.const(float(attrs.epsilon), "float32")))
    scale = relax.op.reshape(relax.op.multiply(inverse, relax.op.reshape(gamma, grouped[1:])), per_channel)
    beta_per_channel = relax.op.reshape(beta, [1] * (len(shape) - 1) + [channels])  # one for every image
    shift = relax.op.subtract(beta_per_channel, relax.op.multiply(mean, scale))
    return relax.op.add(relax.op.multiply(data, scale), shift)


def _group_mean(values: relax.Expr, shape: tuple, groups: int, count: int) -> relax.Expr:
    """The mean of `values` ([N, *spatial, C] `shape`) over the spatial axes and each group's channels, as [N, G, 1]."""
    sums = relax.op.sum(values, axis=list(range(1, len(shape) - 1)))
    grouped = relax.op.sum(relax.op.reshape(sums, (shape[0], groups, shape[-1] // groups)), axis=[2], keepdims=True)
    return relax.op.divide(grouped, relax.const(float(count), "float32"))
