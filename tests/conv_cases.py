"""Random operands and a float64 numpy reference for relay_amp's NHWC convolution kernels (kernels, amx)."""

import ml_dtypes
import numpy as np

from relay_amp.backend.cpu import kernels


def random_operands(spec: kernels.ConvSpec, rng) -> tuple[np.ndarray, np.ndarray]:
    """Data (NHWC) and an OIHW weight in the spec's dtypes: normal floats, integers over their whole range (weight
    codes over seven bits for AVX2_BYTE_DOT, whose pairs must fit: kernels.byte_pairs_fit)."""
    weight_shape = (spec.out_channels, spec.depth, *spec.kernel_size)
    if spec.data_dtype in ("bfloat16", "float32"):
        dtype = ml_dtypes.bfloat16 if spec.data_dtype == "bfloat16" else "float32"
        return rng.standard_normal(spec.data_shape).astype(dtype), rng.standard_normal(weight_shape).astype(dtype)
    low = 0 if spec.data_dtype == "uint8" else -128
    weight_low, weight_high = (-64, 63) if spec.dot is kernels.AVX2_BYTE_DOT else (-128, 127)  # any pair fits it
    return (rng.integers(low, low + 256, spec.data_shape).astype(spec.data_dtype),
            rng.integers(weight_low, weight_high + 1, weight_shape).astype("int8"))


def reference_conv(data: np.ndarray, weight_oihw: np.ndarray, spec: kernels.ConvSpec) -> np.ndarray:
    """The unpadded NHWC convolution `spec` describes (each block of output channels over its block of input
    channels, for `spec.groups`; taps `spec.dilation` apart), in float64."""
    data, weight = data.astype("float64"), weight_oihw.astype("float64")
    _, out_h, out_w, _ = spec.out_shape
    stride_h, stride_w = spec.strides
    width = spec.out_channels // spec.groups
    out = np.zeros(spec.out_shape)
    for row in range(spec.kernel_size[0]):
        for col in range(spec.kernel_size[1]):
            top, left = row * spec.dilation[0], col * spec.dilation[1]
            window = data[:, top:top + (out_h - 1) * stride_h + 1:stride_h, left:left + (out_w - 1) * stride_w + 1:stride_w]
            for group in range(spec.groups):
                outs, ins = slice(group * width, (group + 1) * width), slice(group * spec.depth, (group + 1) * spec.depth)
                out[..., outs] += np.einsum("nhwc,oc->nhwo", window[..., ins], weight[outs, :, row, col])
    return out


def max_relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    """The largest absolute difference, relative to the largest expected magnitude."""
    return float(np.abs(got.astype("float64") - expected).max() / np.abs(expected).max())
