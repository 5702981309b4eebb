"""The exporters' group norms as relax.nn.group_norm: one op that ConvertLayout carries into NHWC and AMP keeps fp32."""

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax import dpl

from ._ir import reduces_exactly, tensor_dtype, tensor_shape


def group_norms_as_ops(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with every group norm spelled as ONNX's InstanceNormalization over a reshape (the ONNX exporters'
    GroupNorm: x [N, C, *spatial] reshaped to [N, G, C/G * spatial], normalized over its last axis, scaled and
    shifted per group, reshaped back unless that shape is x's) as one relax.nn.group_norm over x's channel axis 1,
    and every instance norm over two or more spatial axes (InstanceNormalization over x itself, scaled and shifted
    per channel: a style-transfer or GAN generator's InstanceNorm2d) as one relax.nn.group_norm of C groups: the
    mean, the variance and the normalization were three passes over x, and AMP kept each of them fp32 between casts.
    (Over one axis, [N, C, L], the spelling is also a group norm's after its reshape: left as it is.)"""
    return _instance_norms_in_function(_group_norms_in_function(mod))


@relax.transform.function_pass(opt_level=0, name="relay_amp.GroupNormsAsOpsInFunctions")
def _group_norms_in_function(func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
    grouped = dpl.is_op("relax.reshape")(dpl.wildcard(), dpl.wildcard())
    mean = dpl.is_op("relax.mean")(grouped)
    variance = dpl.is_op("relax.variance")(grouped)
    epsilon = dpl.is_const()
    deviation = dpl.is_op("relax.sqrt")(dpl.is_op("relax.add")(variance, epsilon))
    normalized = dpl.is_op("relax.divide")(dpl.is_op("relax.subtract")(grouped, mean), deviation)
    scale, shift = dpl.is_const(), dpl.is_const()
    affine = dpl.is_op("relax.add")(dpl.is_op("relax.multiply")(normalized, scale), shift)
    grouped_result = affine | normalized
    # an exporter's reshape back is left out where the grouping kept the shape (GroupNorm(C, C) of [N, C, W])
    restored = dpl.is_op("relax.reshape")(grouped_result, dpl.wildcard()) | grouped_result

    def rewrite(call: relax.Call, matches: dict) -> relax.Expr:
        data = matches[grouped].args[0]
        groups = _groups(data, matches[grouped], call, [matches[mean], matches[variance]])
        eps = matches[epsilon].value.numpy()
        if groups is None or eps.size != 1:
            return call
        channels = tensor_shape(data)[1]
        per_group = [_per_group(matches, name, groups, default) for name, default in ((scale, 1.0), (shift, 0.0))]
        if any(values is None for values in per_group):
            return call
        gamma, beta = (relax.const(np.repeat(values, channels // groups).astype("float32")) for values in per_group)
        return relax.op.nn.group_norm(data, gamma, beta, groups, channel_axis=1,
                                      axes=list(range(2, len(tensor_shape(data)))), epsilon=float(eps.item()))

    return dpl.rewrite_call(restored, rewrite, func)


@relax.transform.function_pass(opt_level=0, name="relay_amp.InstanceNormsAsOpsInFunctions")
def _instance_norms_in_function(func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
    data, epsilon, scale, shift = dpl.wildcard(), dpl.is_const(), dpl.is_const(), dpl.is_const()
    mean, variance = dpl.is_op("relax.mean")(data), dpl.is_op("relax.variance")(data)
    deviation = dpl.is_op("relax.sqrt")(dpl.is_op("relax.add")(variance, epsilon))
    normalized = dpl.is_op("relax.divide")(dpl.is_op("relax.subtract")(data, mean), deviation)
    affine = dpl.is_op("relax.add")(dpl.is_op("relax.multiply")(normalized, scale), shift)

    def rewrite(call: relax.Call, matches: dict) -> relax.Expr:
        shape, eps = tensor_shape(matches[data]), matches[epsilon].value.numpy()
        spatial = list(range(2, len(shape or ())))
        if (len(spatial) < 2 or tensor_dtype(matches[data]) != "float32" or eps.size != 1
                or not all(reduces_exactly(matches[stat], spatial) for stat in (mean, variance))):
            return call
        per_channel = [_per_channel(matches, name, shape[1], default) for name, default in ((scale, 1.0), (shift, 0.0))]
        if any(values is None for values in per_channel):
            return call
        gamma, beta = (relax.const(values.astype("float32")) for values in per_channel)
        return relax.op.nn.group_norm(matches[data], gamma, beta, shape[1], channel_axis=1, axes=spatial,
                                      epsilon=float(eps.item()))

    return dpl.rewrite_call(affine | normalized, rewrite, func)


def _per_channel(matches: dict, pattern: dpl.DFPattern, channels: int, default: float) -> np.ndarray | None:
    """The constant `pattern` matched as one value per channel ([C, 1, 1], [1, C, 1, 1], a scalar), `default` where
    the affine step is absent, None for any other shape."""
    if pattern not in matches:
        return np.full(channels, default)
    values = matches[pattern].value.numpy().astype("float64")
    if values.size == 1:
        return np.full(channels, values.item())
    trailing_ones = values.shape[-1] == 1 if values.ndim > 1 else False
    return values.reshape(-1) if values.size == channels and trailing_ones else None


def _groups(data: relax.Expr, grouped: relax.Call, restored: relax.Call, statistics: list[relax.Call]) -> int | None:
    """G where `grouped` is fp32 `data` [N, C, *spatial] as [N, G, C/G * spatial], `restored` reshapes back to data's
    shape and `statistics` reduce over the last axis keeping it; None for any other reshape or reduction."""
    shape, grouped_shape = tensor_shape(data), tensor_shape(grouped)
    if (shape is None or grouped_shape is None or len(shape) < 3 or len(grouped_shape) != 3
            or tensor_shape(restored) != shape or tensor_dtype(data) != "float32"):
        return None
    batch, groups, width = grouped_shape
    if batch != shape[0] or shape[1] % groups or width != shape[1] // groups * math.prod(shape[2:]):
        return None
    if not all(_over_last_axis(call) for call in statistics):
        return None
    return groups


def _over_last_axis(reduction: relax.Call) -> bool:
    axes = [int(axis) for axis in reduction.attrs.axis or ()]
    return bool(reduction.attrs.keepdims) and axes in ([2], [-1])


def _per_group(matches: dict, pattern: dpl.DFPattern, groups: int, default: float) -> np.ndarray | None:
    """The constant `pattern` matched as one value per group ([G, 1], [1, G, 1], a scalar), `default` where the
    affine step is absent, None for any other shape."""
    if pattern not in matches:
        return np.full(groups, default)
    values = matches[pattern].value.numpy().astype("float64")
    if values.size == 1:
        return np.full(groups, values.item())
    squeezed = values.reshape(-1)
    return squeezed if squeezed.size == groups and values.shape[-1] == 1 else None
