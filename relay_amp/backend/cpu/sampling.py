"""GridSamplesChannelsLast: grid_sample (bilinear or nearest, zeros or border padding) reading channels-last data;
FuseWeightedSamples: multi-scale deformable attention's weighted sum computed as it samples.

TVM's grid_sample computes each output element [n, c, h, w] on its own: the vector lanes run over output positions,
so each of a bilinear sample's four reads is a gather, and each position's arithmetic is done again for every
channel. Deformable attention (Deformable DETR, RT-DETR, Mask2Former's pixel decoder) samples each query's points
this way; in a Deformable DETR at 512x512 the samples took 206 of its 428 ms in bf16. With the data moved
channels-last, each output position's corners and weights are computed once and its channels read as whole
vectors, and the result moves back channels-first in a transpose that fuses into what reads it. Each output
element is computed with TVM's arithmetic, in its order, so the results are the same.

Deformable attention then stacks its levels' samples ([N, C, Q, levels, points]) and sums them over the levels'
points weighted by the attention: `(stack(samples).flatten(-2) * weights).sum(-1)`, the canonical PyTorch form
(`ms_deform_attn_core_pytorch`) that Deformable DETR, DINO, Mask2Former and RT-DETR export. The stacked samples are
a materialized tensor of every query's points (89 MB a Deformable DETR encoder layer at 512x512), written once and
read once by a memory-bound sum: 39 ms of that model's 277 in bf16. FuseWeightedSamples computes each query's sum
as it samples, channels-last, and stores only the [N, Q, C] result.
"""

import tvm
from tvm import relax, te

from ..._dead_code import EliminateDeadCode
from ..._ir import calls_any_op, rewrite_op_calls, tensor_dtype, tensor_shape
from ...ops import bound_call, tuple_fields

SAMPLE = "relax.image.grid_sample"
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
        if not calls_any_op(mod, [SAMPLE]):
            return mod
        return rewrite_op_calls(mod, self.func, {SAMPLE: _channels_last})


@tvm.transform.module_pass(opt_level=0, name="relay_amp.FuseWeightedSamples")
class FuseWeightedSamples:
    """Rewrite each sum over the last axis of weights times the bilinear, zero-padded grid samples of several maps
    stacked along it as one TE function that samples and sums channels-last, and a transpose back."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod` (the samples no one reads then removed); the input module is left as it was."""
        if not calls_any_op(mod, [SAMPLE]):
            return mod
        rewritten = rewrite_op_calls(mod, self.func, {"relax.sum": _weighted_samples})
        return EliminateDeadCode([self.func])(rewritten)


def _weighted_samples(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    found = _stacked_samples(call, builder)
    if found is None:
        return None
    samples, weights = found
    moved = [builder.emit(relax.op.permute_dims(sample.args[0], [0, 2, 3, 1])) for sample in samples]
    compute = _weighted_sampler(len(samples), bool(samples[0].attrs.align_corners))
    summed = builder.emit(builder.call_te(compute, *moved, *[sample.args[1] for sample in samples], weights,
                                          primfunc_name_hint="weighted_grid_samples"))
    return relax.op.permute_dims(summed, [0, 2, 1])


def _stacked_samples(call: relax.Call, builder) -> "tuple[list[relax.Call], relax.Expr] | None":
    """The grid samples and the weights of `call`, a sum over the last axis of [N, C, Q, levels x points] samples
    times [N, 1, Q, levels x points] weights; None for any other sum."""
    shape = tensor_shape(call.args[0])
    axes = [int(axis) % 4 for axis in call.attrs.axis] if shape and len(shape) == 4 and call.attrs.axis else []
    product = bound_call(builder, call.args[0], "relax.multiply") if axes == [3] else None
    if product is None or bool(call.attrs.keepdims):
        return None
    for stacked, weights in (product.args, product.args[::-1]):
        samples = _samples_stacked(builder, stacked)
        if samples and tensor_shape(weights) == (shape[0], 1, shape[2], shape[3]) and tensor_dtype(weights) == WIDE:
            return samples, weights
    return None


def _samples_stacked(builder, stacked: relax.Expr) -> "list[relax.Call] | None":
    """The grid_sample calls `stacked` reshapes from their stack along a new axis after the points, where each is
    a bilinear, zero-padded NCHW sampling of fp32 data of the same shape; else None."""
    flattened = bound_call(builder, stacked, "relax.reshape")
    joined = bound_call(builder, flattened.args[0], "relax.concat") if flattened is not None else None
    fields = tuple_fields(builder, joined.args[0]) if joined is not None else None
    if not fields or int(joined.attrs.axis) % 5 != 3:
        return None
    expanded = [bound_call(builder, field, "relax.expand_dims") for field in fields]
    if any(call is None or [int(axis) % 5 for axis in call.attrs.axis] != [3] for call in expanded):
        return None
    samples = [bound_call(builder, call.args[0], SAMPLE) for call in expanded]
    if any(sample is None or not _alike(sample, samples[0]) for sample in samples):
        return None
    batch, channels, queries, points = tensor_shape(samples[0])
    return samples if tensor_shape(stacked) == (batch, channels, queries, len(samples) * points) else None


def _alike(sample: relax.Call, first: relax.Call) -> bool:
    """Whether `sample` is a bilinear, zero-padded NCHW grid sample of fp32 data, of `first`'s shape and corner
    alignment."""
    attrs = sample.attrs
    return (attrs.layout == "NCHW" and attrs.method == "bilinear" and attrs.padding_mode == "zeros"
            and bool(attrs.align_corners) == bool(first.attrs.align_corners) and tensor_dtype(sample) == WIDE
            and tensor_dtype(sample.args[0]) == WIDE
            and tensor_shape(sample) == tensor_shape(first) and None not in (tensor_shape(sample) or [None]))


def _weighted_sampler(levels: int, align_corners: bool):
    """A TE function of `levels` NHWC maps, their grids [N, 2, Q, points] and the weights [N, 1, Q, levels x
    points]: out[n, q, c] = sum over levels and points of weight x the bilinear sample of the map's channel c."""
    def compute(*tensors: te.Tensor) -> te.Tensor:
        maps, grids, weights = tensors[:levels], tensors[levels:2 * levels], tensors[2 * levels]
        batch, _, queries, points = grids[0].shape
        point = te.reduce_axis((0, points), "point")

        def summed(n, q, c):
            terms = [_sample_at(data, grid, n, q, point, c, align_corners) * weights[n, 0, q, level * points + point]
                     for level, (data, grid) in enumerate(zip(maps, grids))]
            total = terms[0]
            for term in terms[1:]:
                total = total + term
            return te.sum(total, axis=point)

        return te.compute((batch, queries, maps[0].shape[3]), summed, name="weighted_grid_samples")
    return compute


def _sample_at(data: te.Tensor, grid: te.Tensor, n, q, point, c, align_corners: bool) -> tvm.ir.Expr:
    """The bilinear, zero-padded sample of NHWC `data`'s channel c at grid[n, :, q, point]."""
    y = _unnormalized(grid[n, 1, q, point], data.shape[1], align_corners)
    x = _unnormalized(grid[n, 0, q, point], data.shape[2], align_corners)
    return _bilinear(lambda row, column: _pixel(data, n, row, column, c), y, x)


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
