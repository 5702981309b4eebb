"""TransposedConvsAsConvs: a transposed convolution as one convolution per output phase, its outputs interleaved.

TVM computes conv2d_transpose as a generic loop nest that no kernel takes: a GAN generator's 4x4, stride-2 layer over
28x28x256 ran at 6 GMAC/s on Zen 4 where a conv of its size runs at 90 (fp32) and 170 (bf16). Along an axis of
stride s, the outputs whose index (plus the leading padding) leaves remainder r read the weight's taps r, r + s,
r + 2s, ... over consecutive input pixels: a plain convolution of J = ceil(k / s) taps (the ones past the kernel
zero). The s x s phases become the output channels of one stride-1 convolution over the input, padded J - 1 ahead;
its outputs are interleaved back into pixels (a reshape, a transpose and a reshape) and cropped to the transposed
conv's padding. That convolution goes to relay_amp's dot-product kernels like any other. A 1-D transposed conv (a
vocoder's upsampling, HiFi-GAN's) is taken as a 2-D one of one row.
"""

import numpy as np
import tvm
from tvm import relax

from .._ir import rewrite_op_calls, tensor_dtype, tensor_shape

# data layout -> (the phase conv's output shape with its channels split by phase, from batch, channels, grid rows,
# grid columns, row stride, column stride; the transpose putting each phase beside its grid row and column; the
# interleaved shape, from batch, channels, rows, columns)
INTERLEAVES = {
    "NHWC": (lambda n, c, h, w, sh, sw: (n, h, w, sh, sw, c), [0, 1, 3, 2, 4, 5], lambda n, c, h, w: (n, h, w, c)),
    "NCHW": (lambda n, c, h, w, sh, sw: (n, sh, sw, c, h, w), [0, 3, 4, 1, 5, 2], lambda n, c, h, w: (n, c, h, w)),
}


def phase_weight(weight_hwio: np.ndarray, strides: tuple[int, int]) -> np.ndarray:
    """The HWIO weight of the phase convolution: for row phase a and column phase b (output channels ordered
    (a, b, o)), tap (m, n) holds the transposed conv's tap (a + s_h * (J_h - 1 - m), b + s_w * (J_w - 1 - n)), zero
    past the kernel."""
    rows, cols, ins, outs = weight_hwio.shape
    (s_h, s_w), (j_h, j_w) = strides, (-(-rows // strides[0]), -(-cols // strides[1]))
    out = np.zeros((j_h, j_w, ins, s_h, s_w, outs), weight_hwio.dtype)
    for m in range(j_h):
        for n in range(j_w):
            for a in range(s_h):
                for b in range(s_w):
                    row, col = a + s_h * (j_h - 1 - m), b + s_w * (j_w - 1 - n)
                    if row < rows and col < cols:
                        out[m, n, :, a, b, :] = weight_hwio[row, col]
    return out.reshape(j_h, j_w, ins, s_h * s_w * outs)


def _axis_plan(size: int, taps: int, stride: int, before: int, length: int) -> "tuple[int, int, int, int] | None":
    """(input padding ahead, input padding after, phase outputs, crop start) along one axis of `size` input pixels
    for `length` outputs, or None where the phase conv would have to crop its input."""
    window = -(-taps // stride)
    skipped = min(before // stride, window - 1)  # whole phase rows before the first output: not computed
    rows = -(-(before + length) // stride)
    after = rows - size
    return (window - 1 - skipped, after, rows - skipped, before - stride * skipped) if after >= 0 else None


def _as_phase_conv(call: relax.Call) -> "relax.Expr | None":
    """The transposed conv `call` as a phase convolution and its interleave, or None where it is not one the
    rewrite takes (a runtime or grouped weight, dilation, a layout other than NHWC or NCHW)."""
    attrs, data, weight = call.attrs, call.args[0], call.args[1]
    layout, kernel_layout = str(attrs.data_layout), str(attrs.kernel_layout)
    shape, out_shape = tensor_shape(data), tensor_shape(call)
    if (not isinstance(weight, tvm.ir.expr.Constant) or layout not in INTERLEAVES or str(attrs.out_layout) != layout
            or int(attrs.groups) != 1 or any(int(d) != 1 for d in attrs.dilation)):
        return None
    if shape is None or out_shape is None:
        return None
    hwio = np.transpose(weight.value.numpy(), [kernel_layout.index(axis) for axis in "HWIO"])
    strides = tuple(int(s) for s in attrs.strides)
    padding = [int(p) for p in attrs.padding]
    plans = [_axis_plan(shape[layout.index(axis)], hwio.shape[i], strides[i], padding[i], out_shape[layout.index(axis)])
             for i, axis in enumerate("HW")]
    if None in plans:
        return None
    (top, bottom, rows, crop_h), (left, right, cols, crop_w) = plans
    phases = relax.op.nn.conv2d(data, relax.const(phase_weight(hwio, strides), tensor_dtype(weight)),
                                padding=[top, left, bottom, right], data_layout=layout, kernel_layout="HWIO",
                                out_layout=layout, out_dtype=attrs.out_dtype)
    return _interleaved(phases, layout, shape[0], hwio.shape[3], (rows, cols), strides, (crop_h, crop_w),
                        (out_shape[layout.index("H")], out_shape[layout.index("W")]))


def _interleaved(phases: relax.Expr, layout: str, batch: int, channels: int, grid: tuple, strides: tuple,
                 crop: tuple, size: tuple) -> relax.Expr:
    """The phase conv's outputs as pixels: each phase channel block moved to its row and column phase, then the
    rows and columns of the transposed conv's output cropped out."""
    split, order, pixels = INTERLEAVES[layout]
    split_shape = split(batch, channels, *grid, *strides)
    moved = relax.op.permute_dims(relax.op.reshape(phases, split_shape), order)
    whole = relax.op.reshape(moved, pixels(batch, channels, grid[0] * strides[0], grid[1] * strides[1]))
    axes = [layout.index("H"), layout.index("W")]
    return relax.op.strided_slice(whole, axes=axes, begin=list(crop), end=[c + s for c, s in zip(crop, size)])


def _as_two_dimensional(call: relax.Call) -> "relax.Expr | None":
    """A conv1d_transpose over a constant weight as a conv2d_transpose of one row, or None (another layout)."""
    attrs, data, weight = call.attrs, call.args[0], call.args[1]
    layout, kernel_layout = str(attrs.data_layout), str(attrs.kernel_layout)
    if not isinstance(weight, tvm.ir.expr.Constant) or layout not in ("NCW", "NWC") or str(attrs.out_layout) != layout:
        return None
    row = relax.const(np.expand_dims(weight.value.numpy(), kernel_layout.index("W")), tensor_dtype(weight))
    (padding_before, padding_after), = [[int(p) for p in attrs.padding]]
    return relax.op.nn.conv2d_transpose(
        relax.op.expand_dims(data, layout.index("W")), row, strides=(1, int(attrs.strides[0])),
        padding=(0, padding_before, 0, padding_after), output_padding=(0, int(attrs.output_padding[0])),
        dilation=(1, int(attrs.dilation[0])), groups=attrs.groups, data_layout=layout.replace("W", "HW"),
        kernel_layout=kernel_layout.replace("W", "HW"), out_dtype=attrs.out_dtype)


def _one_dimensional(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    """A conv1d_transpose's phase conv, made on its one-row conv2d_transpose, its row axis dropped after; None
    where the 2-D one is not one the rewrite takes."""
    as_2d = _as_two_dimensional(call)
    rewritten = None if as_2d is None else _as_phase_conv(builder.normalize(as_2d))
    return None if rewritten is None else relax.op.squeeze(rewritten, [str(call.attrs.data_layout).index("W")])


@tvm.transform.module_pass(opt_level=0, name="relay_amp.TransposedConvsAsConvs")
class TransposedConvsAsConvs:
    """Rewrite each conv2d_transpose (conv1d_transpose: as one row) over a constant, ungrouped, undilated weight in
    NHWC or NCHW (NWC, NCW) into a phase convolution whose outputs are interleaved into pixels."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_op_calls(mod, self.func, {"relax.nn.conv2d_transpose": lambda call, _: _as_phase_conv(call),
                                                 "relax.nn.conv1d_transpose": _one_dimensional})
