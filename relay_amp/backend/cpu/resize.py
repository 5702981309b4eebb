"""SeparableResizes: a bilinear NCHW resize2d as two 1-D resizes, along W and then along H; the transpose of an
enlarging NHWC one's result to NCHW moved before it.

TVM's resize2d computes each output element on its own: in NCHW the vector lanes run along W, so each of a bilinear
sample's four reads is a gather and every lane computes its own coordinates and weights. A segmentation model's
logits upsampled to the input's size at its end are such a resize (convs run NHWC, and the transpose back to the
model's NCHW fuses into the resize): LR-ASPP-MobileNetV3's 21 classes upsampled 8x to 256x256 took 2.05 of its 3.95
ms in bf16 on an AMX host. Bilinear interpolation is separable, and TVM's resize2d interpolates the two rows along W
first and then between them along H; topi's resize1d along W (the channels and rows folded into its batch axes) and
then along H (the new columns as its channels, read as whole rows) does the same arithmetic in the same order, the
intermediate kept in fp32 as resize2d keeps it (LLVM may contract a product and a sum into an FMA in one function and
not the other: the results agree to an fp32 rounding); that resize took 0.28 ms against 1.98. The enlarging NHWC
resize read only by its transpose to NCHW runs in NCHW on its transposed input instead (the transpose then copies the
small tensor). Nearest-neighbour resizes and NHWC ones (whose lanes run along the channels, contiguous) stay TVM's:
made separable they measured as fast or slower.
"""

import tvm
from tvm import relax, topi

from ..._dead_code import EliminateDeadCode
from ..._ir import calls_any_op, is_static_shape, read_counts, rewrite_op_calls, tensor_dtype, tensor_shape
from ...ops import bound_call, bound_value, call_op_name
from ...passes.transposes import UNARY

RESIZE = "relax.image.resize2d"
TRANSPOSE = "relax.permute_dims"
TO_NCHW = [0, 3, 1, 2]
SEPARABLE_MODES = ("half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel")  # not tf_crop_and_resize's ROI
WIDE = "float32"


@tvm.transform.module_pass(opt_level=0, name="relay_amp.SeparableResizes")
class SeparableResizes:
    """Move each NHWC->NCHW transpose of an enlarging bilinear NHWC resize (read only by it) before the resize, then
    rewrite each bilinear NCHW resize2d of static shape as a resize along W and one along H."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod` (the resizes left unread removed); the input module is left as it was."""
        if not calls_any_op(mod, [RESIZE]):
            return mod
        reads = read_counts(mod[self.func])
        moved = rewrite_op_calls(mod, self.func,
                                 {TRANSPOSE: lambda call, builder: _resized_first(call, builder, reads)})
        moved = EliminateDeadCode([self.func])(moved)
        return rewrite_op_calls(moved, self.func, {RESIZE: _separable})


def _resized_first(call: relax.Call, builder: relax.BlockBuilder, reads: dict) -> "relax.Expr | None":
    """`call`, a transpose to NCHW of an enlarging bilinear NHWC resize (through elementwise ops of one operand: a bf16
    model's cast back to fp32), each result read by the next alone, as those ops of the NCHW resize of the transposed
    input; None for any other call."""
    steps, source = [], call.args[0]
    while call_op_name(step := bound_value(builder, source)) in UNARY and len(step.args) == 1:
        if reads.get(source, 0) != 1:
            return None
        steps.append(step)
        source = step.args[0]
    resize = bound_call(builder, source, RESIZE)
    if (resize is None or reads.get(source, 0) != 1 or not _bilinear(resize) or resize.attrs.layout != "NHWC"
            or [int(axis) for axis in call.attrs.axes or []] != TO_NCHW):
        return None
    _, height, width, _ = tensor_shape(resize.args[0])
    _, new_height, new_width, _ = tensor_shape(resize)
    if new_height * new_width < height * width:
        return None  # a shrinking resize: its result is the smaller tensor to transpose
    transposed = builder.emit(relax.op.permute_dims(resize.args[0], TO_NCHW))
    attrs = resize.attrs
    result = relax.op.image.resize2d(transposed, resize.args[1], [float(v) for v in attrs.roi], "NCHW", attrs.method,
                                     attrs.coordinate_transformation_mode, attrs.rounding_method, attrs.cubic_alpha,
                                     attrs.cubic_exclude, attrs.extrapolation_value)
    for step in reversed(steps):
        result = relax.Call(step.op, [builder.emit(result)], step.attrs)
    return result


def _separable(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    """`call`, a bilinear NCHW resize2d, as a resize along W ([N, C x H, W] in NCW, computed in fp32) and one along H
    ([N x C, H, W'] in NWC, the new columns as channels); None for any other resize or one of neither axis."""
    if not _bilinear(call) or call.attrs.layout != "NCHW":
        return None
    batch, channels, height, width = tensor_shape(call.args[0])
    _, _, new_height, new_width = tensor_shape(call)
    if (new_height, new_width) == (height, width):
        return None
    data, dtype = call.args[0], tensor_dtype(call)
    if new_width != width:
        rows = builder.emit(relax.op.reshape(data, (batch, channels * height, width)))
        along_w = _resize1d(call.attrs, "NCW", new_width, WIDE if new_height != height else dtype)
        data = builder.emit(builder.call_te(along_w, rows, primfunc_name_hint="resize_w"))
    if new_height != height:
        columns = builder.emit(relax.op.reshape(data, (batch * channels, height, new_width)))
        along_h = _resize1d(call.attrs, "NWC", new_height, dtype)
        data = builder.emit(builder.call_te(along_h, columns, primfunc_name_hint="resize_h"))
    return relax.op.reshape(data, (batch, channels, new_height, new_width))


def _resize1d(attrs, layout: str, size: int, out_dtype: str):
    """A TE function: topi's resize1d along the W axis of `layout` to `size`, with resize2d `attrs`' interpolation,
    into `out_dtype`."""
    return lambda data: topi.image.resize1d(data, [0.0, 0.0], [size], layout, attrs.method,
                                            attrs.coordinate_transformation_mode, attrs.rounding_method,
                                            attrs.cubic_alpha, attrs.cubic_exclude, attrs.extrapolation_value,
                                            out_dtype=out_dtype)


def _bilinear(call: relax.Call) -> bool:
    """Whether `call` is a bilinear resize2d of a static 4-D float tensor, whose interpolation separates (a
    coordinate mode without a region of interest), into its own dtype."""
    shape, result = tensor_shape(call.args[0]), tensor_shape(call)
    return (call.attrs.method == "linear" and call.attrs.coordinate_transformation_mode in SEPARABLE_MODES
            and is_static_shape(shape) and is_static_shape(result) and len(shape) == 4
            and tensor_dtype(call) == tensor_dtype(call.args[0]) and tensor_dtype(call).startswith(("float", "bfloat")))
