"""GridSamplesChannelsLast: grid_sample (bilinear or nearest, zeros or border padding) reading channels-last data.

TVM's grid_sample computes each output element [n, c, h, w] on its own: the vector lanes run over output positions,
so each of a bilinear sample's four reads is a gather, and each position's arithmetic is done again for every
channel. Deformable attention (Deformable DETR, RT-DETR, Mask2Former's pixel decoder) samples each query's points
this way; in a Deformable DETR at 512x512 the samples took 206 of its 428 ms in bf16. With the data moved
channels-last, each output position's corners and weights are computed once and its channels read as whole
vectors, and the result moves back channels-first in a transpose that fuses into what reads it. Each output
element is computed with TVM's arithmetic, in its order, so the results are the same.
"""

import tvm
from tvm import relax, te

from ..._ir import rewrite_op_calls, tensor_dtype, tensor_shape

METHODS = ("bilinear", "nearest")
PADDINGS = ("zeros", "border")  # reflection and bicubic sampling stay TVM's
MIN_CHANNELS = 8  # fewer channels than half a vector gain nothing from contiguous reads (a flow's correlation: 1)
WIDE = "float32"


@tvm.transform.module_pass(opt_level=0, name="relay_amp.GridSamplesChannelsLast")
class GridSamplesChannelsLast:
    """Rewrite each NCHW grid_sample of `METHODS` and `PADDINGS` over MIN_CHANNELS or more channels as a transpose
    to NHWC, a sampling TE function over whole channel vectors, and a transpose back."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_op_calls(mod, self.func, {"relax.image.grid_sample": _channels_last})


def _channels_last(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    attrs = call.attrs
    shape = tensor_shape(call.args[0])
    if (attrs.layout != "NCHW" or attrs.method not in METHODS or attrs.padding_mode not in PADDINGS
            or shape is None or not isinstance(shape[1], int) or shape[1] < MIN_CHANNELS):
        return None
    data, grid = call.args
    moved = builder.emit(relax.op.permute_dims(data, [0, 2, 3, 1]))
    compute = _sampler(attrs.method, attrs.padding_mode, bool(attrs.align_corners), tensor_dtype(call))
    sampled = builder.emit(builder.call_te(compute, moved, grid, primfunc_name_hint="grid_sample"))
    return relax.op.permute_dims(sampled, [0, 3, 1, 2])


def _sampler(method: str, padding: str, align_corners: bool, dtype: str):
    """A TE function: `method` sampling of NHWC `data` at TVM's grid [N, 2 (x, y), H_out, W_out] of positions in
    [-1, 1], as [N, H_out, W_out, C] of `dtype`."""
    def compute(data: te.Tensor, grid: te.Tensor) -> te.Tensor:
        _, height, width, channels = data.shape

        def position(n, h, w):
            y = _unnormalized(grid[n, 1, h, w], height, align_corners)
            x = _unnormalized(grid[n, 0, h, w], width, align_corners)
            if padding == "border":
                return _clipped(y, height), _clipped(x, width)
            return y, x

        def sample(n, h, w, c):
            y, x = position(n, h, w)
            pixel = lambda row, column: _pixel(data, n, row, column, c)  # noqa: E731 (one read per corner)
            value = _bilinear(pixel, y, x) if method == "bilinear" else _nearest(pixel, y, x)
            return value.astype(dtype)

        return te.compute((grid.shape[0], grid.shape[2], grid.shape[3], channels), sample, name="grid_sample")
    return compute


def _unnormalized(coordinate: tvm.ir.Expr, size, align_corners: bool) -> tvm.ir.Expr:
    """A grid coordinate in [-1, 1] as a pixel coordinate (TVM's and PyTorch's formula)."""
    coordinate = coordinate.astype(WIDE)
    if align_corners:
        return (coordinate + 1) * (size - 1) / 2
    return -0.5 + (coordinate + 1) * size / 2


def _clipped(coordinate: tvm.ir.Expr, size) -> tvm.ir.Expr:
    return te.min(te.max(coordinate, 0), size - 1)


def _pixel(data: te.Tensor, n, row, column, c) -> tvm.ir.Expr:
    """data[n, row, column, c] widened, 0 outside the image; the read itself clamped inside, so that the lanes of
    a channel vector load whole from memory whatever the position."""
    height, width = data.shape[1], data.shape[2]
    inside = te.all(row >= 0, column >= 0, row < height, column < width)
    clamped = data[n, te.max(te.min(row, height - 1), 0), te.max(te.min(column, width - 1), 0), c]
    return tvm.tirx.Select(inside, clamped.astype(WIDE), tvm.tirx.const(0.0, WIDE))


def _bilinear(pixel, y: tvm.ir.Expr, x: tvm.ir.Expr) -> tvm.ir.Expr:
    """The four corners around (y, x) weighted by their distances, in TVM's order of operations."""
    y0, x0 = te.floor(y).astype("int32"), te.floor(x).astype("int32")
    y1, x1 = y0 + 1, x0 + 1
    return (pixel(y0, x0) * (1.0 - (y - y0)) * (1.0 - (x - x0))
            + pixel(y0, x1) * (1.0 - (y - y0)) * (x - x0)
            + pixel(y1, x0) * (y - y0) * (1.0 - (x - x0))
            + pixel(y1, x1) * (y - y0) * (x - x0))


def _nearest(pixel, y: tvm.ir.Expr, x: tvm.ir.Expr) -> tvm.ir.Expr:
    """The pixel nearest (y, x), halves rounded to even."""
    return pixel(te.nearbyint(y).astype("int32"), te.nearbyint(x).astype("int32"))
