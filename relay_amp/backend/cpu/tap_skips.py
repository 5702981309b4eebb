"""SkipPaddedTaps: a kernel skips, for each of its tiles, the taps of its window that read only padding.

The kernels read their input padded (dispatch pads it) and reduce every output over the whole window. Where a
dilated window reaches far past a small feature map, most of those products read zeros: DeepLabV3's ASPP convs at
rates 12 and 24 on ResNet-50's 32x32 map (a 256x256 image) read the image with 56% and 25% of their taps (rate 36,
whose outer taps never read it, is cut to 1x1 by relay_amp.passes.padding_taps). ONNX Runtime's NCHWc kernels bound
each output's taps by the image, and ran DeepLabV3-ResNet50 in fp32 1.4x as fast as relay_amp (2-core Sapphire
Rapids: 162 vs 232 ms; 173 now).

Dispatch tells a kernel its padding (`kernels.ConvSpec.padding`) where it would skip enough of its products
(`worth_skipping`). A dot-product kernel then gets, in its scheduled function, a test around the reduction over
each tap's input channels: whether a pixel the loops inside read for that tap lies in the image (their range, from
TVM's integer-set analysis of the block's read of the data). An AMX kernel runs each tile pair over the kernel rows,
and where each tap is a run of its own the taps, through which a pixel of the pair reads the image
(`amx._live_taps`). The zeros a skipped tap would have added change no bit of the sums.
"""

import dataclasses

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from . import amx
from .kernels import SPEC_ANNOTATION, ConvSpec, spec_from_json

SKIPPED_SHARE = 0.05  # the share of a conv's products that must read only padding for the kernel to test its taps


def padded_products_share(size: int, taps: int, stride: int, dilation: int, before: int, after: int) -> float:
    """The share of an axis' (output, tap) pairs whose tap reads padding: `before` and `after` padding pixels
    around an image of `size - before - after` pixels, `size` as padded."""
    outputs = (size - (taps - 1) * dilation - 1) // stride + 1
    padded = sum(1 for out in range(outputs) for tap in range(taps)
                 if not before <= out * stride + tap * dilation < size - after)
    return padded / (outputs * taps)


def worth_skipping(spec: ConvSpec, padding: tuple, on_amx: bool) -> bool:
    """Whether the kernel of `spec` skips SKIPPED_SHARE of its products or more when told its `padding` (top, left,
    bottom, right): the AMX kernel's tile pairs' share (`amx.skipped_share`); the dot-product kernel's, at least
    its share along the height (each register tile lies in one output row; how many columns a tile holds is tuned).
    Never for int8 data a dot-product kernel shifts to uint8: its padding reads 128, which the weight sums of every
    tap take back (AMX multiplies int8 by int8 as it is)."""
    if on_amx:
        return amx.skipped_share(dataclasses.replace(spec, padding=padding)) >= SKIPPED_SHARE
    if spec.shifted:
        return False
    top, _, bottom, _ = padding
    share = padded_products_share(spec.input_shape[1], spec.kernel_size[0], spec.strides[0], spec.dilation[0], top,
                                  bottom)
    return share >= SKIPPED_SHARE


def annotated_spec(func: tirx.PrimFunc) -> "ConvSpec | None":
    """The spec a kernel's blocks carry (tensorized, its accumulating block's outer block does not), or None."""
    specs = []

    def visit(block: s_tir.SBlock) -> None:
        if SPEC_ANNOTATION in block.annotations:
            specs.append(spec_from_json(str(block.annotations[SPEC_ANNOTATION])))

    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, visit)])
    return specs[0] if specs else None


def _window_read(func: tirx.PrimFunc, spec: ConvSpec) -> "tuple[tvm.ir.Expr, tvm.ir.Expr, list] | None":
    """The padded input row and column the accumulating block reads (a reducing block's read of a buffer shaped as
    the kernel's input), in terms of the loop variables, and the loop variables its reduction axes are bound to;
    None unless one block reads one."""
    found = []

    def visit(realize: s_tir.SBlockRealize) -> None:
        block = realize.block
        reduced = [value for iter_var, value in zip(block.iter_vars, realize.iter_values)
                   if iter_var.iter_type == tirx.IterVar.CommReduce]
        if not reduced:
            return
        binding = list(zip(block.iter_vars, realize.iter_values))

        def bound(var: tirx.Var) -> tvm.ir.Expr:
            return next((value for iter_var, value in binding if iter_var.var.same_as(var)), var)

        reduction_vars = [var for value in reduced for var in tirx.analysis.undefined_vars(value)]
        found.extend((*(tvm_ffi.structural_map(region.region[axis].min, [(tirx.Var, bound)]) for axis in (1, 2)),
                      reduction_vars)
                     for region in block.reads if tuple(int(d) for d in region.source.shape) == spec.input_shape)

    tvm_ffi.structural_walk(func.body, [(s_tir.SBlockRealize, visit)])
    return found[0] if len(found) == 1 else None


def _tested_tap_loop(func: tirx.PrimFunc, row: tvm.ir.Expr, col: tvm.ir.Expr, reduction_vars: list
                     ) -> "tirx.Var | None":
    """The variable of the loop whose body the test wraps: the innermost serial loop of a reduction axis that the
    read's row or column changes with (the kernel's loop over a kernel row's taps; the accumulators' zeroing lies
    outside every reduction loop, and the register tile's pixels are unrolled inside)."""
    read_vars = [*tirx.analysis.undefined_vars(row), *tirx.analysis.undefined_vars(col)]
    loops = []

    def visit(loop: tirx.For) -> None:
        if loop.kind == tirx.ForKind.SERIAL and all(any(loop.loop_var.same_as(var) for var in variables)
                                                    for variables in (read_vars, reduction_vars)):
            loops.append(loop.loop_var)

    tvm_ffi.structural_walk(func.body, [(tirx.For, visit)], order="post")
    return loops[0] if loops else None


def _reads_image(stmt: tirx.Stmt, row: tvm.ir.Expr, col: tvm.ir.Expr, spec: ConvSpec) -> "tvm.ir.Expr | None":
    """Whether some pixel that `stmt`'s loops read at (`row`, `col`) lies inside the image (None where their range
    has no bounds)."""
    sets = {}

    def visit(loop: tirx.For) -> None:
        sets[loop.loop_var] = tvm.sym.IntervalSet(loop.min, loop.min + loop.extent - 1)

    tvm_ffi.structural_walk(stmt, [(tirx.For, visit)])
    analyzer = tvm.sym.Analyzer()
    top, left, bottom, right = spec.padding
    height, width = spec.input_shape[1:3]
    rows, cols = analyzer.int_set(row, sets), analyzer.int_set(col, sets)
    if not all(isinstance(bounds, tvm.sym.IntervalSet) and _finite(bounds) for bounds in (rows, cols)):
        return None
    return analyzer.simplify(tirx.all(rows.max_value >= top, rows.min_value < height - bottom,
                                      cols.max_value >= left, cols.min_value < width - right))


def _finite(bounds: "tvm.sym.IntervalSet") -> bool:
    """Whether both ends of `bounds` are expressions, not the analysis' infinities."""
    ends = [*tirx.analysis.undefined_vars(bounds.min_value), *tirx.analysis.undefined_vars(bounds.max_value)]
    return not any(var.name in ("pos_inf", "neg_inf") for var in ends)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="SkipPaddedTaps")
def SkipPaddedTaps(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx) -> tirx.PrimFunc:  # noqa: N802
    """A kernel whose spec names its padding: the body of its innermost tap loop under a test that some pixel it
    reads lies in the image."""
    spec = annotated_spec(func)
    if spec is None or not any(spec.padding):
        return func
    read = _window_read(func, spec)
    tap_loop = None if read is None else _tested_tap_loop(func, *read)
    if tap_loop is None:
        return func
    pixel = read[:2]

    def wrap(loop: tirx.For) -> tirx.Stmt:
        if not loop.loop_var.same_as(tap_loop):
            return loop
        test = _reads_image(loop.body, *pixel, spec)
        if test is None:
            return loop
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, tirx.IfThenElse(test, loop.body, None),
                        loop.thread_binding, loop.annotations)

    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, wrap)]))
