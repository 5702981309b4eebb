"""Bias correction: the mean output error that rounding a layer's weights to int8 makes, taken back out.

Rounding each weight w to its code's value w_q adds (w_q - w) . x to every output. Over the layer's inputs that
error has a mean, (w_q - w) . E[x] per output channel, wherever the input's channels have nonzero means, as a
ReLU's output always has. The mean is the same at every pixel, so it survives the averaging that thins rounding
noise (a global average pool) and builds up layer after layer: on ResNet-50 (int8q, 32 random inputs) the weights'
rounding made about four fifths of the output's squared error. Calibration measures each input channel's mean, and
the layer takes the error out in the per-channel constant its epilogue adds anyway: empirical bias correction, as
in Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias Correction" (ICCV 2019). Zero padding
is not modelled: border pixels see zeros where the correction assumes the channel's mean.
"""

import numpy as np
from tvm import relax

SIGNIFICANT_DIGITS = 7  # of a stored mean (float32's precision): plans stay readable


def input_channel_axis(call: relax.Call) -> int:
    """The axis of a layer's input whose channels its weight contracts: a conv's C, a matmul's last."""
    if call.op.name == "relax.matmul":
        return -1
    return str(call.attrs.data_layout).index("C")


def weight_axes(call: relax.Call) -> tuple[int, int]:
    """The output-channel and the input-channel axis of a conv's or a 2-D matmul's weight."""
    if call.op.name == "relax.matmul":
        return 1, 0
    layout = str(call.attrs.kernel_layout)
    return layout.index("O"), layout.index("I")


class ChannelMeans:
    """The running mean of each channel of a layer's inputs, along one axis, over calibration's batches."""

    def __init__(self, axis: int):
        self.axis = axis
        self.sums: np.ndarray | float = 0.0
        self.count = 0

    def add(self, values: np.ndarray) -> None:
        """Count one batch of the layer's input."""
        axis = self.axis % values.ndim
        self.sums = self.sums + values.sum(axis=tuple(a for a in range(values.ndim) if a != axis), dtype="float64")
        self.count += values.size // values.shape[axis]

    @property
    def means(self) -> tuple[float, ...]:
        """Each channel's mean, to SIGNIFICANT_DIGITS digits."""
        return tuple(float(f"{value:.{SIGNIFICANT_DIGITS}g}") for value in np.atleast_1d(self.sums / self.count))


def rounding_shift(call: relax.Call, weight: np.ndarray, dequantized: np.ndarray,
                   input_means: "tuple[float, ...]") -> np.ndarray:
    """Per output channel, the mean error that rounding `weight` to `dequantized` adds to the layer's output over
    inputs whose channels average `input_means`: (dequantized - weight), summed over each input channel's taps,
    dotted with the means of that output's group's input channels."""
    out_axis, in_axis = weight_axes(call)
    error = np.moveaxis(dequantized.astype("float64") - weight, (out_axis, in_axis), (0, 1))
    per_input = error.reshape(error.shape[0], error.shape[1], -1).sum(axis=2)  # (outputs, inputs of a group)
    groups = int(call.attrs.groups) if call.op.name != "relax.matmul" else 1
    means = np.asarray(input_means, "float64").reshape(groups, 1, -1)
    grouped = per_input.reshape(groups, -1, per_input.shape[1])  # (groups, outputs of a group, inputs of a group)
    return (grouped * means).sum(axis=2).reshape(-1)
