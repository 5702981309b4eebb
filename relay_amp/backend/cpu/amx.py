"""amx: bf16 and int8 convolutions and matmuls on AMX tiles, as implicit GEMMs over NHWC data.

One call of the kernel's LLVM function computes a block of 2 x 16 output channels for two tiles of up to 16
output pixels (`tdpbf16ps` for bf16 -> fp32, `tdpbssd` / `tdpbusd` for int8 / uint8 -> int32). In NHWC the
inputs one output pixel reads for one kernel row are contiguous: KW x C values. So an A tile is M pixels of one
output row, each row of the tile K values of that run, and the tile's row stride (stride x C) covers strided
convolutions; a matmul is the 1x1 case. Stride-1 outputs whose rows tile badly are tiled flattened over the
input's width instead (see `Tiling`). The weight is the one `kernels.pack_weight` packs, [O/16, KH, KW, C/g,
16, g], which is AMX's B-tile layout (g = 2 for bf16, 4 for int8), so signed int8 needs no shift to uint8.
"""

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import tvm
from tvm import relax, s_tir
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ...errors import DTypeError
from ...targets import ARCH_REQ_XCOMP_PERM, SYS_ARCH_PRCTL, XFEATURE_XTILEDATA
from . import cores, kernels
from .kernels import LANES, ConvSpec, Epilogue
from .schedules import CACHE_BYTES, largest_divisor

TILE_BYTES = 64  # bytes in one row of a tile
MAX_TILE_ROWS = 16
MIN_TILE_ROWS = 4  # below this a tile wastes most of each tdp instruction: the AVX-512 kernel does better
FLAT_GAIN = 1.25  # flat tiling (an extra pad) where it fills tiles this many times better than rows
PANELS = 2  # output-channel panels of 16 per call
FUSABLE_ATTR = "relay_amp.amx_spec"  # on an AMX kernel without an epilogue: its ConvSpec as JSON
PARALLEL_ITEMS = 32  # parallel items a kernel aims for (the expert kernel's; this one's where the target names no cores)
READ_WRITE = 3  # tvm_access_ptr's access mask: read (1) and write (2)


@dataclass(frozen=True)
class AmxProduct:
    """One AMX dot-product instruction: its data dtype, accumulator dtype and data element size."""
    instruction: str
    data_dtype: str
    acc_dtype: str
    element_bytes: int

    @property
    def symbol(self) -> str:
        """The name of the LLVM IR function that runs one block on this instruction."""
        return f"relay_amp_amx_{self.instruction}"


PRODUCTS = {product.data_dtype: product for product in (
    AmxProduct("tdpbf16ps", "bfloat16", "float32", 2),
    AmxProduct("tdpbssd", "int8", "int32", 1),
    AmxProduct("tdpbusd", "uint8", "int32", 1),
)}
TARGET_FEATURES = {"bfloat16": "amx-bf16", "int8": "amx-int8", "uint8": "amx-int8"}


def _tile_config() -> str:
    """LLVM IR filling the 64-byte tile configuration: tiles 0-3 accumulate (M x 64 bytes), 4-5 hold A rows
    (M x K bytes), 6-7 B panels (K/4 x 64 bytes)."""
    shapes = [("%m8", "64")] * 4 + [("%m8", "%kt16")] * 2 + [("%kr8", "64")] * 2
    lines = []
    for tile, (rows, colsb) in enumerate(shapes):
        lines += [f"  %cb{tile} = getelementptr i8, ptr %cfg, i64 {16 + 2 * tile}", f"  store i16 {colsb}, ptr %cb{tile}",
                  f"  %rw{tile} = getelementptr i8, ptr %cfg, i64 {48 + tile}", f"  store i8 {rows}, ptr %rw{tile}"]
    return "\n".join(lines)


def llvm_ir(product: AmxProduct) -> str:
    """LLVM IR of three functions: `<symbol>_config` (tile shapes for M pixels and K steps of kt bytes; the
    first call in a process asks Linux for AMX tile state, so a library exported and loaded elsewhere runs),
    `<symbol>` (one block: C tiles, ldc bytes per pixel, = A (pixels lda bytes apart, kernel rows a_kh bytes
    apart, kwc K bytes per kernel row in `taps` runs a_tap bytes apart (a grouped conv's taps: its group's
    channels of each input pixel), each in steps of kt) x B (two packed panels of 16 output channels, kh kernel
    rows each), over the first kh_run kernel rows and taps_run taps from A's and B's pointers) and
    `<symbol>_release`. A kernel configures the tiles once for many blocks: ldtilecfg costs as much as a block."""
    loads = "\n".join(f"  call void @llvm.x86.tileloadd64(i8 {tile}, ptr %{ptr}, i64 %{stride})" for tile, ptr, stride in
                      ((4, "pa0", "lda"), (5, "pa1", "lda"), (6, "pb0", "ldb"), (7, "pb1", "ldb")))
    products = "\n".join(f"  call void @llvm.x86.{product.instruction}(i8 {c}, i8 {a}, i8 {b})"
                         for c, a, b in ((0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7)))
    stores = "\n".join(f"  call void @llvm.x86.tilestored64(i8 {tile}, ptr %{ptr}, i64 %ldc)"
                       for tile, ptr in ((0, "c0"), (1, "c0b"), (2, "c1"), (3, "c1b")))
    zeros = "\n".join(f"  call void @llvm.x86.tilezero(i8 {tile})" for tile in range(4))
    return f"""
declare void @llvm.x86.ldtilecfg(ptr)
declare void @llvm.x86.tilerelease()
declare void @llvm.x86.tilezero(i8 immarg)
declare void @llvm.x86.tileloadd64(i8 immarg, ptr, i64)
declare void @llvm.x86.{product.instruction}(i8 immarg, i8 immarg, i8 immarg)
declare void @llvm.x86.tilestored64(i8 immarg, ptr, i64)
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1 immarg)
declare i64 @syscall(i64, ...)
@{product.symbol}_granted = internal global i8 0
define void @{product.symbol}_config(i64 %m, i64 %kt) {{
entry:
  %cfg = alloca [64 x i8], align 64
  %granted = load atomic i8, ptr @{product.symbol}_granted monotonic, align 1
  %ask = icmp eq i8 %granted, 0
  br i1 %ask, label %request, label %configure
request:
  %answer = call i64 (i64, ...) @syscall(i64 {SYS_ARCH_PRCTL}, i64 {ARCH_REQ_XCOMP_PERM}, i64 {XFEATURE_XTILEDATA})
  store atomic i8 1, ptr @{product.symbol}_granted monotonic, align 1
  br label %configure
configure:
  call void @llvm.memset.p0.i64(ptr align 64 %cfg, i8 0, i64 64, i1 false)
  store i8 1, ptr %cfg
  %m8 = trunc i64 %m to i8
  %kt16 = trunc i64 %kt to i16
  %kr = lshr i64 %kt, 2
  %kr8 = trunc i64 %kr to i8
{_tile_config()}
  call void @llvm.x86.ldtilecfg(ptr %cfg)
  ret void
}}
define void @{product.symbol}_release() {{
entry:
  call void @llvm.x86.tilerelease()
  ret void
}}
define void @{product.symbol}(ptr %c0, ptr %c1, ptr %a0, ptr %a1, ptr %b, i64 %kt, i64 %lda, i64 %a_kh, i64 %kh,
                               i64 %kwc, i64 %ldc, i64 %taps, i64 %a_tap, i64 %kh_run, i64 %taps_run) {{
entry:
{zeros}
  %ldb = add i64 0, {TILE_BYTES}
  %weights = mul i64 %kh, %kwc
  %panel = shl i64 %weights, 4
  %b1 = getelementptr i8, ptr %b, i64 %panel
  %tap_bytes = udiv i64 %kwc, %taps
  br label %row
row:
  %r = phi i64 [ 0, %entry ], [ %rnext, %row_end ]
  %arow = mul i64 %r, %a_kh
  %brow = mul i64 %r, %kwc
  br label %tap
tap:
  %t = phi i64 [ 0, %row ], [ %tnext, %tap_end ]
  %atap = mul i64 %t, %a_tap
  %atapoff = add i64 %arow, %atap
  %btap = mul i64 %t, %tap_bytes
  %btapoff = add i64 %brow, %btap
  br label %step
step:
  %k = phi i64 [ 0, %tap ], [ %knext, %step ]
  %aoff = add i64 %atapoff, %k
  %pa0 = getelementptr i8, ptr %a0, i64 %aoff
  %pa1 = getelementptr i8, ptr %a1, i64 %aoff
  %bk = add i64 %btapoff, %k
  %boff = shl i64 %bk, 4
  %pb0 = getelementptr i8, ptr %b, i64 %boff
  %pb1 = getelementptr i8, ptr %b1, i64 %boff
{loads}
{products}
  %knext = add i64 %k, %kt
  %kdone = icmp uge i64 %knext, %tap_bytes
  br i1 %kdone, label %tap_end, label %step
tap_end:
  %tnext = add i64 %t, 1
  %tdone = icmp uge i64 %tnext, %taps_run
  br i1 %tdone, label %row_end, label %tap
row_end:
  %rnext = add i64 %r, 1
  %rdone = icmp uge i64 %rnext, %kh_run
  br i1 %rdone, label %exit, label %row
exit:
  %c0b = getelementptr i8, ptr %c0, i64 {TILE_BYTES}
  %c1b = getelementptr i8, ptr %c1, i64 {TILE_BYTES}
{stores}
  ret void
}}
"""


@dataclass(frozen=True)
class Tiling:
    """How a convolution maps onto pixel tiles, and the input buffer shape the kernel takes for it.

    Row tiling: a tile is `tile_rows` pixels of one output row. Flat tiling (stride 1 only): a tile is 16
    consecutive pixels of the output flattened over the input's width, whose pixels are C apart in the input
    too; the columns past the output's width are computed but not stored (the epilogue skips them). The last tile
    ends at the last output pixel, overlapping the one before (it recomputes and stores again some of its pixels,
    the same values), so that it reads no pixel past the input; only an output of fewer than 16 pixels gets zero
    rows at the bottom of its input for its one tile to read. Overlapping rows (strided): tiles of 16 pixels along
    each output row, the last one ending at the row's end, overlapping the one before likewise.
    """
    tile_rows: int
    tiles_per_image: int
    data_shape: tuple[int, int, int, int]  # the input buffer: the spec's, plus any zero rows
    out_shape: tuple[int, int, int, int]  # the output as the tiles number it: the spec's, or input-wide (flat)
    step_bytes: int  # K bytes per tdp step
    row_bytes: int  # K bytes per kernel row: KW x C elements (grouped: KW x the group's channels)
    taps: int = 1  # runs of K bytes per kernel row: one (KW x C contiguous), or KW (a grouped conv's)
    run_tiles: int = 0  # overlapping tiles: tiles in each run (an output row; flat: all); 0: none overlap
    run_span: int = 0  # the pixels of the tile buffer each run covers, the last tile ending at its end

    def tile_start(self, tile):
        """The first pixel of the tile buffer (flattened) that tile `tile` of an image computes: tile x tile_rows,
        or in runs of overlapping tiles, each run an output row of the tile buffer on."""
        if not self.run_tiles:
            return tile * self.tile_rows
        return tile // self.run_tiles * self.out_shape[2] + T.min(tile % self.run_tiles * self.tile_rows,
                                                                  self.run_span - self.tile_rows)


def _row_tiling(spec: ConvSpec) -> Tiling:
    _, out_h, out_w, _ = spec.out_shape
    rows = largest_divisor(out_w, MAX_TILE_ROWS)
    return Tiling(rows, out_h * out_w // rows, spec.data_shape, spec.out_shape, *_k_steps(spec))


def _k_steps(spec: ConvSpec) -> tuple[int, int, int]:
    """(K bytes per tdp step, K bytes per kernel row, runs of them): a kernel row's KW x C values are one run; a
    grouped conv's, and a conv's whose taps are spaced apart along the row (dilated), are KW runs of its group's
    channels, one per tap."""
    element_bytes = PRODUCTS[spec.data_dtype].element_bytes
    taps = spec.kernel_size[1] if spec.groups > 1 or spec.dilation[1] > 1 else 1
    run_bytes = spec.kernel_size[1] * spec.depth * element_bytes // taps
    step_bytes = max(d for d in range(4, TILE_BYTES + 1, 4) if run_bytes % d == 0)  # channels fill 4-byte groups
    return step_bytes, run_bytes * taps, taps


def _flat_tiling(spec: ConvSpec) -> Tiling:
    batch, height, width, channels = spec.data_shape
    _, out_h, out_w, out_c = spec.out_shape
    span = (out_h - 1) * width + out_w  # from the first output pixel to the last, flattened over the input's width
    if span >= MAX_TILE_ROWS:  # the last tile ends at the last output pixel: it reads no pixel past the input
        tiles = -(-span // MAX_TILE_ROWS)
        return Tiling(MAX_TILE_ROWS, tiles, spec.data_shape, (batch, out_h, width, out_c), *_k_steps(spec), tiles,
                      span)
    read = MAX_TILE_ROWS - 1 + (spec.window[0] - 1) * width + spec.window[1]  # one tile's input pixels
    return Tiling(MAX_TILE_ROWS, 1, (batch, max(height, -(-read // width)), width, channels),
                  (batch, -(-MAX_TILE_ROWS // width), width, out_c), *_k_steps(spec))


def _overlapping_row_tiling(spec: ConvSpec) -> Tiling:
    _, out_h, out_w, _ = spec.out_shape
    row_tiles = -(-out_w // MAX_TILE_ROWS) if out_w >= MAX_TILE_ROWS else 0
    if not row_tiles:
        return _row_tiling(spec)
    return Tiling(MAX_TILE_ROWS, out_h * row_tiles, spec.data_shape, spec.out_shape, *_k_steps(spec), row_tiles,
                  out_w)


def tiling(spec: ConvSpec) -> Tiling:
    """Row tiling, or where it fills tiles at least FLAT_GAIN times better (a 7x7 output: 44% vs 77%), flat tiling
    (stride 1) or overlapping rows (strided: tiles of 16 pixels along each output row, the last one ending at the
    row's end: a conv1d's 799 output pixels as 50 tiles of 16, where 799 = 17 x 47 tiles only by 1)."""
    rows = _row_tiling(spec)
    other = (_flat_tiling if spec.strides == (1, 1) else _overlapping_row_tiling)(spec)
    _, out_h, out_w, _ = spec.out_shape
    other_filled = out_h * out_w / (other.tiles_per_image * MAX_TILE_ROWS)
    return other if other_filled >= FLAT_GAIN * rows.tile_rows / MAX_TILE_ROWS else rows


def supports(spec: ConvSpec) -> bool:
    """Whether the AMX kernel computes `spec`: every output pixel and channel stored (the dot-product
    kernel's stored_width and stored_channels are not the AMX kernel's), bf16 -> fp32 or int8/uint8 -> int32, at
    least 32 output channels in 16-blocks per group, each group's input channels in whole 4-byte groups (as
    `kernels.pack_weight` packs them), tiles of at least MIN_TILE_ROWS pixels. Dilated (atrous) convs read their
    taps spaced apart: each kernel row `dilation` input rows after the one before, each tap a run of its own."""
    product = PRODUCTS.get(spec.data_dtype)
    if (product is None or spec.stored_width or spec.stored_channels
            or spec.out_dtype != product.acc_dtype or not _panel_fits(spec)
            or not kernels.supports(spec.out_channels, spec.data_shape[-1], spec.dot, spec.groups)):
        return False
    return tiling(spec).tile_rows >= MIN_TILE_ROWS


def _panel_fits(spec: ConvSpec) -> bool:
    """Whether each group's output channels fill AMX panels: at least a panel's 32, or (ungrouped) one 16-lane
    block, computed against a weight padded with a zero block (`padded_weight`)."""
    return spec.out_channels // spec.groups >= PANELS * LANES or (spec.groups == 1 and spec.out_channels == LANES)


def padded_weight(packed: "np.ndarray | relax.Expr", spec: ConvSpec) -> "np.ndarray | relax.Expr":
    """`kernels.pack_weight`'s weight for `spec` (a constant, or a runtime operand packed by Relax ops) with the zero
    block of output channels that completes a 16-channel conv's panel pair (the block function multiplies two); the
    weight itself where it fills whole panels."""
    if spec.out_channels >= PANELS * LANES:
        return packed
    block_axis = 1 if spec.weight_batch else 0
    if isinstance(packed, np.ndarray):
        return np.concatenate([packed, np.zeros_like(packed)], axis=block_axis)
    return relax.op.concat([packed, relax.op.zeros_like(packed)], axis=block_axis)


def target_dtypes(target: tvm.target.Target) -> frozenset[str]:
    """The data dtypes `target` (an llvm target) may compute on AMX tiles."""
    has = tvm.target.codegen.target_has_features
    if target.kind.name != "llvm" or not has("amx-tile", target):
        return frozenset()
    return frozenset(dtype for dtype, feature in TARGET_FEATURES.items() if has(feature, target))


def conv2d_nhwc(spec: ConvSpec, epilogue: Epilogue = Epilogue()) -> tvm.tirx.PrimFunc:
    """The AMX kernel for `spec` (see `supports`) with `epilogue` fused into its write-back: it takes the input
    buffer `tiling(spec)` describes, the weight `kernels.pack_weight` packs (no weight sums; one per image where
    `spec.weight_batch`), the epilogue's operands, and writes `spec.out_shape` in the epilogue's dtype."""
    if not supports(spec):
        raise DTypeError(f"the AMX kernel takes bf16 -> fp32 or int8 -> int32 with at least "
                         f"{PANELS * LANES} output channels in {LANES}-blocks per group, input channels filling 4-byte "
                         f"groups (2 bf16, 4 int8) and output rows of at least {MIN_TILE_ROWS} pixels; got {spec}")
    sch = s_tir.Schedule(_kernel(spec, PRODUCTS[spec.data_dtype], tiling(spec), epilogue, spec.out_shape))
    sch.annotate(sch.get_loops(sch.get_sblock("amx_block"))[0], "pragma_import_llvm",
                 llvm_ir(PRODUCTS[spec.data_dtype]))
    return kernels.mark_fusable(sch.mod["main"].without_attr("global_symbol").with_attr("tirx.is_scheduled", True),
                                spec, epilogue, FUSABLE_ATTR)


def _kernel(spec: ConvSpec, product: AmxProduct, tiles: Tiling, epilogue: Epilogue,
            out_shape: tuple) -> tvm.tirx.PrimFunc:
    """The PrimFunc: a parallel loop over workers, each a run of units (32 output channels x a pair of pixel tiles,
    see `_unit_panel_and_pair`); per unit one LLVM call into a scratch accumulator, then the epilogue stores its
    pixels. With a weight per image (`weight_batch`) the two tiles of a pair come from one image.

    Tile t of an image starts at pixel t x tile_rows of the tile buffer flattened (row tiling: rows tile the
    output's width exactly; flat tiling: the tile buffer is as wide as the input, and pixels past the output's
    width or height are not stored), at (y, x) there, which reads the input from (y x stride, x x stride)."""
    batch, _, _, channels = tiles.data_shape
    tile_width = tiles.out_shape[2]
    group, rows, block = 4 // product.element_bytes, tiles.tile_rows, PANELS * LANES
    group_width = out_shape[3] // spec.groups
    positions, panels = batch * tiles.tiles_per_image, spec.groups * -(-group_width // block)
    sharing = tiles.tiles_per_image if spec.weight_batch else positions  # pixel tiles that read one weight
    pairs_per_weight = (sharing + 1) // 2  # a pair shares its weight: an odd count repeats its last tile
    pairs = positions // sharing * pairs_per_weight
    units = panels * pairs
    workers = min(units, _worker_count())
    pixels_first = pixels_outermost(spec)
    with IRBuilder() as builder:
        with T.prim_func(s_tir=True):
            T.func_name("main")
            T.func_attr({"tirx.noalias": True})
            data = T.arg("data", T.Buffer(tiles.data_shape, spec.data_dtype))
            weights = (spec.weight_batch,) if spec.weight_batch else ()
            blocks = max(out_shape[3] // LANES, PANELS)  # a 16-channel conv's weight: its block and a zero one
            packed = T.arg("packed", T.Buffer((*weights, blocks, *spec.kernel_size, spec.depth // group, LANES, group),
                                              spec.data_dtype if group == 2 else "int8"))
            operands = [T.arg(f"operand{i}", T.Buffer(*epilogue.operand_buffer(step, out_shape)))
                        for i, step in enumerate(epilogue.operand_steps)]
            out = T.arg("out", T.Buffer(out_shape, epilogue.out_dtype or product.acc_dtype))
            with T.parallel(0, workers) as worker:
                with T.sblock("amx_block"):
                    T.reads([buffer[tuple(slice(0, d) for d in buffer.shape)] for buffer in (data, packed, *operands)])
                    T.writes(out[tuple(slice(0, d) for d in out_shape)])
                    acc = T.alloc_buffer((2, rows, block), product.acc_dtype)
                    T.evaluate(T.call_extern("int32", f"{product.symbol}_config", T.int64(rows),
                                             T.int64(tiles.step_bytes)))
                    with T.serial(worker * units // workers, (worker + 1) * units // workers) as unit:
                        panel, pair = _unit_panel_and_pair(unit, panels, pairs, pixels_first)
                        channel, stored_from = _panel_channel(panel, group_width)
                        first_input = channel // group_width * spec.depth  # the group's first input channel
                        weight = pair // pairs_per_weight
                        first = weight * sharing + pair % pairs_per_weight * 2
                        pixels = [(p // tiles.tiles_per_image, tiles.tile_start(p % tiles.tiles_per_image))
                                  for p in (first, T.min(first + 1, weight * sharing + sharing - 1))]
                        first_row, rows_run, first_tap, taps_run = _live_taps(spec, tiles, [p for _, p in pixels])
                        panel_start = (*([weight] if spec.weight_batch else []), channel // LANES, first_row,
                                       first_tap, 0, 0, 0)
                        T.evaluate(_block_call(spec, product, tiles, acc, [
                            data[image, pixel // tile_width * spec.strides[0] + first_row * spec.dilation[0],
                                 pixel % tile_width * spec.strides[1] + first_tap * spec.dilation[1], first_input]
                            for image, pixel in pixels], packed[panel_start], (rows_run, taps_run)))
                        for tile, (image, pixel) in enumerate(pixels):
                            _store_tile(epilogue, acc, tile, operands, out, (image, pixel, tile_width, channel),
                                        (rows, stored_from, group_width))
                    T.evaluate(T.call_extern("int32", f"{product.symbol}_release"))
    return builder.get()


def pixels_outermost(spec: ConvSpec) -> bool:
    """Whether the AMX kernel's workers take pixel tiles outermost: wherever the packed weight fits CACHE_BYTES,
    larger than the data or not (`kernels.pixels_outermost`, for the dot-product kernels, also asks that). Tiles
    multiply so fast that where its operands lie bounds a small layer: split by output channels, each thread reads
    every pixel, half of them written by the other core (7x7x160 -> 960 -> 160 in bf16, weights in L2: 43.5 us by
    channels, 22.9 by pixels on two threads, 32 on one); split by pixels, each reads the whole weight, from its own
    L2 once it is there."""
    return kernels.packed_weight_bytes(spec) <= CACHE_BYTES


def _worker_count() -> int:
    """The parallel workers a kernel wants: one per core of the target it is built for (its `num-cores`, the threads
    relay_amp sizes TVM's pool to), else PARALLEL_ITEMS. A worker is a run of units; fewer, longer runs were faster:
    whole runs of BERT in bf16 7.62 ms on 32 workers, 7.08 on 8, 6.68 on 2 (this 2-core host; RegNetY-400MF 1.59,
    1.48, 1.44; MobileNetV2 1.06, 1.02, 1.00), more than the ~90 ns a tile configuration costs accounts for."""
    return cores.target_cores() or PARALLEL_ITEMS


def _unit_panel_and_pair(unit, panels: int, pairs: int, pixels_first: bool) -> tuple:
    """The weight panel and the pair of pixel tiles of work unit `unit`: consecutive units take one pair through
    every panel where `pixels_first`, else one panel through every pair. Each worker takes a run of consecutive
    units, as many as the next one (+-1), and configures the tiles once for them."""
    if pixels_first:
        return unit % panels, unit // panels
    return unit // pairs, unit % pairs


def _block_call(spec: ConvSpec, product: AmxProduct, tiles: Tiling, acc, first_inputs: list, weight_panel,
                runs: tuple):
    """The LLVM call of one block: two pixel tiles (their first input elements) x one weight panel pair into the
    scratch accumulator `acc`, over `runs` (kernel rows, taps) from those."""
    width, channels = tiles.data_shape[2:]
    pixel_bytes = channels * product.element_bytes
    step_y, step_x = spec.dilation
    return block_call(product, acc, [T.address_of(element) for element in first_inputs], T.address_of(weight_panel),
                      tiles.step_bytes, spec.strides[1] * pixel_bytes, tiles.row_bytes,
                      (spec.kernel_size[0], step_y * width * pixel_bytes), (tiles.taps, step_x * pixel_bytes), runs)


class _Ops(NamedTuple):
    """The min, max and select that `_live_taps` computes with: TIR's in a kernel, Python's for an estimate."""
    minimum: Callable
    maximum: Callable
    select: Callable


_TIR_OPS = _Ops(T.min, T.max, T.Select)
_PYTHON_OPS = _Ops(min, max, lambda condition, then, otherwise: then if condition else otherwise)


def _live_taps(spec: ConvSpec, tiles: Tiling, starts: list, ops: _Ops = _TIR_OPS) -> tuple:
    """(first kernel row, kernel rows, first tap, taps) a pair of tiles starting at tile-buffer pixels `starts`
    reads: all, unless the spec names its padding (tap_skips); then those through which some pixel of the pair
    reads the image (a tap per kernel row where each is a run of its own), at least one (reading zeros)."""
    if not any(spec.padding):
        return 0, spec.kernel_size[0], 0, tiles.taps
    top, left, bottom, right = spec.padding
    width = tiles.out_shape[2]
    ends = [start + tiles.tile_rows - 1 for start in starts]
    rows = _live_range([start // width for start in starts], [end // width for end in ends], spec.strides[0],
                       spec.dilation[0], (top, spec.data_shape[1] - bottom), spec.kernel_size[0], ops)
    if tiles.taps != spec.kernel_size[1]:
        return (*rows, 0, tiles.taps)
    in_one_row = [start // width == end // width for start, end in zip(starts, ends)]
    columns = _live_range([ops.select(one, start % width, 0) for one, start in zip(in_one_row, starts)],
                          [ops.select(one, end % width, width - 1) for one, end in zip(in_one_row, ends)],
                          spec.strides[1], spec.dilation[1], (left, spec.data_shape[2] - right), spec.kernel_size[1],
                          ops)
    return (*rows, *columns)


def _live_range(lows: list, highs: list, stride: int, dilation: int, image: tuple, taps: int, ops: _Ops) -> tuple:
    """(first tap, taps) along an axis through which some output from min(`lows`) to max(`highs`) reads the image
    (its padded pixels `image`: first, end), at least one."""
    low, high = ops.minimum(*lows), ops.maximum(*highs)
    first = ops.minimum(ops.maximum((image[0] - high * stride + dilation - 1) // dilation, 0), taps - 1)
    last = ops.minimum((image[1] - 1 - low * stride) // dilation, taps - 1)
    return first, ops.maximum(last - first + 1, 1)


def skipped_share(spec: ConvSpec) -> float:
    """The share of the products of `spec`'s kernel (its padding named) that its tile pairs skip, in one image."""
    tiles = tiling(spec)
    starts = [int(tiles.tile_start(tile)) for tile in range(tiles.tiles_per_image)]
    pairs = [(starts[tile], starts[min(tile + 1, len(starts) - 1)]) for tile in range(0, len(starts), 2)]
    runs = [_live_taps(spec, tiles, list(pair), _PYTHON_OPS) for pair in pairs]
    return 1 - sum(rows * taps for _, rows, _, taps in runs) / (len(pairs) * spec.kernel_size[0] * tiles.taps)


def block_call(product: AmxProduct, acc, a_tiles: list, b_panels, step_bytes: int, lda: int, row_bytes: int,
               kernel_rows: tuple = (1, 0), taps: tuple = (1, 0), runs: "tuple | None" = None):
    """The call of `llvm_ir`'s block function: the two A tiles at `a_tiles` (pointers; rows `lda` bytes apart)
    times the two B panels from `b_panels` into the scratch accumulator `acc`, over `kernel_rows` (count, bytes
    apart in A) of `row_bytes` K bytes each, in `taps` runs (count, bytes apart in A), in steps of `step_bytes`;
    of those, the (kernel rows, taps) in `runs` from the pointers (all where None)."""
    runs = runs or (kernel_rows[0], taps[0])
    return T.call_extern(
        "int32", product.symbol, whole_tile(acc, 0), whole_tile(acc, 1), *a_tiles, b_panels,
        T.int64(step_bytes), T.int64(lda), T.int64(kernel_rows[1]), T.int64(kernel_rows[0]), T.int64(row_bytes),
        T.int64(PANELS * LANES * 4), T.int64(taps[0]), T.int64(taps[1]), *map(_int64, runs))


def _int64(value):
    """`value` (a Python int or an expression) as an int64 argument."""
    return T.int64(value) if isinstance(value, int) else T.Cast("int64", value)


def whole_tile(tiles, tile: int):
    """A pointer to tile `tile` of a scratch of tiles (its first axis) that declares all its rows read and
    written, as the tile loads and stores touch them. Through `address_of` TVM saw one element, and its buffer
    compaction cut an accumulator to the rows the epilogue reads: a 2x2 output's 4 of 16, so the store overran the
    stack (or a heap workspace, before StackBuffers)."""
    size = tiles.shape[1] * tiles.shape[2]
    return T.tvm_access_ptr(T.type_annotation(tiles.dtype), tiles.data, tile * size, size, READ_WRITE)


def _panel_channel(panel, group_width: int) -> tuple:
    """(the first output channel the block of `panel` computes, the first it stores): each group's panels in turn,
    32 channels apart, except that a group's last panel of only 16 channels overlaps the one before (it computes
    the 32 channels that end the group, and stores the new 16)."""
    block = PANELS * LANES
    per_group = -(-group_width // block)
    first = panel // per_group * group_width
    stored = first + panel % per_group * block
    last = max(group_width - block, 0)  # a 16-channel conv's one panel: the block and the padded weight's zeros
    return (stored if group_width % block == 0 else first + T.min(panel % per_group * block, last),
            stored)


def _store_tile(epilogue: Epilogue, acc, tile: int, operands: list, out, at: tuple, rows_from: tuple) -> None:
    """The epilogue of one tile: acc[tile] (rows pixels x 32 channels from `channel`) through the steps into `out`
    from pixel `pixel` of the tile buffer (`tile_width` wide) of `image`; pixels off the output skipped, and, where
    a group's last panel may overlap the one before, channels below `stored_from` (that panel's); a 16-channel
    conv's first half alone."""
    image, pixel, tile_width, channel = at
    rows, stored_from, group_width = rows_from
    overlapping = group_width % (PANELS * LANES) != 0
    _, out_h, out_w, _ = out.shape
    with T.serial(0, rows) as row:
        y, x = (pixel + row) // tile_width, (pixel + row) % tile_width
        with T.If(tvm.tirx.all(y < out_h, x < out_w) if tile_width != out_w else y < out_h):
            with T.Then():
                if not overlapping:
                    _store_lanes(epilogue, acc, (tile, row, 0), operands, out, (image, y, x, channel), PANELS * LANES)
                else:  # the last panel overlaps the one before: each half is stored unless that panel's
                    for half in range(min(PANELS, group_width // LANES)):
                        with T.If(channel + half * LANES >= stored_from):
                            with T.Then():
                                _store_lanes(epilogue, acc, (tile, row, half * LANES), operands, out,
                                             (image, y, x, channel + half * LANES), LANES)


def _store_lanes(epilogue: Epilogue, acc, first: tuple, operands: list, out, index: tuple, lanes: int) -> None:
    """`lanes` accumulators of the scratch `acc` from `first` on through the epilogue into `out` from `index` on."""
    tile, row, first_lane = first
    image, y, x, channel = index
    with T.vectorized(0, lanes) as lane:
        at = (image, y, x, channel + lane)
        value = epilogue.apply(acc[tile, row, first_lane + lane], str(out.dtype),
                               lambda i, step: operands[i][epilogue.operand_index(step, at)])
        T.buffer_store(out, value, at)
