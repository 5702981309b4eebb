"""DropPaddingTaps: the taps of a convolution's window that read only padding, for every output, are cut off.

An atrous conv whose dilation reaches past a small feature map multiplies its outer taps by zeros alone: DeepLabV3's
ASPP convs at rate 36 on a 28x28 map (a 224x224 input) read the image only through their centre tap, and so compute a
1x1 conv nine times over; at rate 24 on MobileNetV3's 14x14 map, the same. The window is cut to its taps that read
the image for some output, the padding shrunk by the rows or columns cut, so the output is the same; a window cut to
one tap along an axis is undilated along it, so a cut 3x3 conv is a plain 1x1 conv to every pass after this one.
"""

import numpy as np
import tvm
from tvm import relax

from .._ir import rewrite_op_calls, tensor_dtype, tensor_shape

SPATIAL = "HW"


def live_taps(size: int, taps: int, stride: int, dilation: int, before: int, outputs: int) -> "tuple[int, int] | None":
    """The first and last taps along an axis of `size` pixels that read a pixel of the image for at least one of
    `outputs` outputs, with `before` padding pixels ahead of it; None when every tap reads only padding."""
    live = [tap for tap in range(taps)
            if any(0 <= out * stride + tap * dilation - before < size for out in range(outputs))]
    return (live[0], live[-1]) if live else None


def _cut(call: relax.Call) -> "relax.Expr | None":
    """`call` (a conv2d over a constant weight) with the taps that read only padding cut off, or None where it has
    none to cut (or cutting them would take padding below zero)."""
    attrs, weight = call.attrs, call.args[1]
    data_shape, out_shape = tensor_shape(call.args[0]), tensor_shape(call)
    if not isinstance(weight, tvm.ir.expr.Constant) or data_shape is None or out_shape is None:
        return None
    data_layout, kernel_layout = str(attrs.data_layout), str(attrs.kernel_layout)
    out_layout = str(attrs.out_layout or attrs.data_layout)
    values = weight.value.numpy()
    padding = [int(p) for p in attrs.padding]  # top, left, bottom, right
    slices, dilation = [slice(None)] * values.ndim, [int(d) for d in attrs.dilation]
    for axis, name in enumerate(SPATIAL):
        taps = values.shape[kernel_layout.index(name)]
        live = live_taps(data_shape[data_layout.index(name)], taps, int(attrs.strides[axis]), dilation[axis],
                         padding[axis], out_shape[out_layout.index(name)])
        if live is None:
            return None
        first, last = live
        padding[axis] -= first * dilation[axis]
        padding[axis + 2] -= (taps - 1 - last) * dilation[axis]
        slices[kernel_layout.index(name)] = slice(first, last + 1)
        dilation[axis] = 1 if first == last else dilation[axis]
    cut = values[tuple(slices)]
    if cut.shape == values.shape or min(padding) < 0:
        return None
    return relax.op.nn.conv2d(call.args[0], relax.const(np.ascontiguousarray(cut), tensor_dtype(weight)),
                              strides=attrs.strides, padding=padding, dilation=dilation, groups=attrs.groups,
                              data_layout=data_layout, kernel_layout=kernel_layout, out_layout=attrs.out_layout,
                              out_dtype=attrs.out_dtype)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.DropPaddingTaps")
class DropPaddingTaps:
    """Cut from each conv2d over a constant weight the taps of its window that read only padding."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_op_calls(mod, self.func, {"relax.nn.conv2d": lambda call, _: _cut(call)})
