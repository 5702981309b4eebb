"""The exporters' layer norms spelled out as relax.nn.layer_norm: one op, computed in one pass over each row."""

import numpy as np
import tvm
from tvm import relax
from tvm.relax import dpl

from ._ir import reduces_exactly, tensor_dtype, tensor_shape


def layer_norms_as_ops(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with every layer norm over the last axis spelled out, as ONNX exporters write LayerNorm before opset 17
    (ReduceMean, Sub, Pow 2 or Mul by itself, ReduceMean, Add epsilon, Sqrt, Div, then Mul and Add by constants), as
    one relax.nn.layer_norm: spelled out it ran as three functions (the mean, the variance, the normalization)."""
    return _layer_norms_in_function(mod)


@relax.transform.function_pass(opt_level=0, name="relay_amp.LayerNormsAsOpsInFunctions")
def _layer_norms_in_function(func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
    data = dpl.wildcard()
    exponent, epsilon, scale, shift = dpl.is_const(), dpl.is_const(), dpl.is_const(), dpl.is_const()
    mean = dpl.is_op("relax.mean")(data)
    centered = dpl.is_op("relax.subtract")(data, mean)
    squared = dpl.is_op("relax.power")(centered, exponent) | dpl.is_op("relax.multiply")(centered, centered)
    variance = dpl.is_op("relax.mean")(squared)
    deviation = dpl.is_op("relax.sqrt")(dpl.is_op("relax.add")(variance, epsilon) | variance)
    normalized = dpl.is_op("relax.divide")(centered, deviation)
    scaled = dpl.is_op("relax.multiply")(normalized, scale)
    affine = dpl.is_op("relax.add")(scaled, shift) | scaled | normalized

    def rewrite(call: relax.Call, matches: dict) -> relax.Expr:
        shape = tensor_shape(matches[data])
        if (not shape or tensor_dtype(matches[data]) != "float32"
                or not all(reduces_exactly(matches[stat], [len(shape) - 1]) for stat in (mean, variance))
                or (exponent in matches and _scalar(matches, exponent, 0.0) != 2.0)):
            return call
        eps = _scalar(matches, epsilon, 0.0)
        gamma, beta = (_per_feature(matches, name, shape[-1], default)
                       for name, default in ((scale, 1.0), (shift, 0.0)))
        if eps is None or gamma is None or beta is None:
            return call
        return relax.op.nn.layer_norm(matches[data], relax.const(gamma), relax.const(beta), axes=[-1], epsilon=eps)

    return dpl.rewrite_call(affine, rewrite, func)


def _scalar(matches: dict, pattern: dpl.DFPattern, default: float) -> float | None:
    """The one value of the constant `pattern` matched, `default` where the step is absent, None if it has more."""
    if pattern not in matches:
        return default
    values = matches[pattern].value.numpy()
    return float(values.item()) if values.size == 1 else None


def _per_feature(matches: dict, pattern: dpl.DFPattern, features: int, default: float) -> np.ndarray | None:
    """The constant `pattern` matched as one fp32 value per feature of the last axis ([F], [1, 1, F] or a scalar),
    `default` where the affine step is absent, None for any other shape."""
    if pattern not in matches:
        return np.full(features, default, "float32")
    values = matches[pattern].value.numpy()
    if values.size == 1:
        return np.full(features, values.item(), "float32")
    return values.reshape(-1).astype("float32") if values.shape[-1] == features == values.size else None
