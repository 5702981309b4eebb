"""amx: bf16 and int8 convolutions and matmuls on AMX tiles, as implicit GEMMs over NHWC data.

One call of the kernel's LLVM function computes a block of 2 x 16 output channels for two tiles of up to 16
output pixels (`tdpbf16ps` for bf16 -> fp32, `tdpbssd` / `tdpbusd` for int8 / uint8 -> int32). In NHWC the
inputs one output pixel reads for one kernel row are contiguous: KW x C values. So an A tile is M pixels of one
output row, each row of the tile K values of that run, and the tile's row stride (stride x C) covers strided
convolutions; a matmul is the 1x1 case. The weight is the one `kernels.pack_weight` packs, [O/16, KH, KW, C/g,
16, g], which is AMX's B-tile layout (g = 2 for bf16, 4 for int8), so signed int8 needs no shift to uint8.
"""

from dataclasses import dataclass

import tvm
from tvm import s_tir
from tvm.script import tirx as T

from .errors import DTypeError
from . import kernels
from .kernels import LANES, ConvSpec
from .schedules import largest_divisor

TILE_BYTES = 64  # bytes in one row of a tile
MAX_TILE_ROWS = 16
MIN_TILE_ROWS = 4  # below this a tile wastes most of each tdp instruction: the AVX-512 kernel does better
PANELS = 2  # output-channel panels of 16 per call
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


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
    """LLVM IR of one block: C tiles (ldc bytes per pixel) += A (pixels lda bytes apart, kernel rows a_kh bytes
    apart, K bytes per kernel row in steps of kt) x B (two packed panels of 16 output channels)."""
    loads = "\n".join(f"  call void @llvm.x86.tileloadd64(i8 {tile}, ptr %{ptr}, i64 %{stride})" for tile, ptr, stride in
                      ((4, "pa0", "lda"), (5, "pa1", "lda"), (6, "pb0", "ldb"), (7, "pb1", "ldb")))
    products = "\n".join(f"  call void @llvm.x86.{product.instruction}(i8 {c}, i8 {a}, i8 {b})"
                         for c, a, b in ((0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7)))
    stores = "\n".join(f"  call void @llvm.x86.tilestored64(i8 {tile}, ptr %{ptr}, i64 %ldc)"
                       for tile, ptr in ((0, "c0"), (1, "c0b"), (2, "c1"), (3, "c1b")))
    return f"""
declare void @llvm.x86.ldtilecfg(ptr)
declare void @llvm.x86.tilerelease()
declare void @llvm.x86.tilezero(i8 immarg)
declare void @llvm.x86.tileloadd64(i8 immarg, ptr, i64)
declare void @llvm.x86.{product.instruction}(i8 immarg, i8 immarg, i8 immarg)
declare void @llvm.x86.tilestored64(i8 immarg, ptr, i64)
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1 immarg)
define void @{product.symbol}(ptr %c0, ptr %c1, ptr %a0, ptr %a1, ptr %b, i64 %m, i64 %kt, i64 %lda, i64 %a_kh,
                               i64 %kh, i64 %kwc, i64 %ldc) {{
entry:
  %cfg = alloca [64 x i8], align 64
  call void @llvm.memset.p0.i64(ptr align 64 %cfg, i8 0, i64 64, i1 false)
  store i8 1, ptr %cfg
  %m8 = trunc i64 %m to i8
  %kt16 = trunc i64 %kt to i16
  %kr = lshr i64 %kt, 2
  %kr8 = trunc i64 %kr to i8
{_tile_config()}
  call void @llvm.x86.ldtilecfg(ptr %cfg)
  call void @llvm.x86.tilezero(i8 0)
  call void @llvm.x86.tilezero(i8 1)
  call void @llvm.x86.tilezero(i8 2)
  call void @llvm.x86.tilezero(i8 3)
  %ldb = add i64 0, {TILE_BYTES}
  %weights = mul i64 %kh, %kwc
  %panel = shl i64 %weights, 4
  %b1 = getelementptr i8, ptr %b, i64 %panel
  br label %row
row:
  %r = phi i64 [ 0, %entry ], [ %rnext, %row_end ]
  %arow = mul i64 %r, %a_kh
  %brow = mul i64 %r, %kwc
  br label %step
step:
  %k = phi i64 [ 0, %row ], [ %knext, %step ]
  %aoff = add i64 %arow, %k
  %pa0 = getelementptr i8, ptr %a0, i64 %aoff
  %pa1 = getelementptr i8, ptr %a1, i64 %aoff
  %bk = add i64 %brow, %k
  %boff = shl i64 %bk, 4
  %pb0 = getelementptr i8, ptr %b, i64 %boff
  %pb1 = getelementptr i8, ptr %b1, i64 %boff
{loads}
{products}
  %knext = add i64 %k, %kt
  %kdone = icmp uge i64 %knext, %kwc
  br i1 %kdone, label %row_end, label %step
row_end:
  %rnext = add i64 %r, 1
  %rdone = icmp uge i64 %rnext, %kh
  br i1 %rdone, label %exit, label %row
exit:
  %c0b = getelementptr i8, ptr %c0, i64 {TILE_BYTES}
  %c1b = getelementptr i8, ptr %c1, i64 {TILE_BYTES}
{stores}
  call void @llvm.x86.tilerelease()
  ret void
}}
"""


@dataclass(frozen=True)
class _Blocking:
    """How a convolution maps onto tiles: M pixels per tile, `positions` tiles of pixels, K bytes per step."""
    tile_rows: int
    x_blocks: int
    positions: int
    step_bytes: int
    row_bytes: int  # K bytes per kernel row: KW x C elements


def _blocking(spec: ConvSpec) -> _Blocking:
    batch, out_h, out_w, _ = spec.out_shape
    tile_rows = largest_divisor(out_w, MAX_TILE_ROWS)
    row_bytes = spec.kernel_size[1] * spec.data_shape[-1] * PRODUCTS[spec.data_dtype].element_bytes
    step_bytes = max(d for d in range(4, TILE_BYTES + 1, 4) if row_bytes % d == 0)  # channels fill 4-byte groups
    return _Blocking(tile_rows, out_w // tile_rows, batch * out_h * (out_w // tile_rows), step_bytes, row_bytes)


def supports(spec: ConvSpec) -> bool:
    """Whether the AMX kernel computes `spec`: bf16 -> fp32 or int8/uint8 -> int32, output channels in 32-blocks,
    input channels in whole 4-byte groups (as `kernels.pack_weight` packs them), output rows tiling into at
    least MIN_TILE_ROWS pixels."""
    product = PRODUCTS.get(spec.data_dtype)
    if (product is None or spec.out_dtype != product.acc_dtype or spec.out_channels % (PANELS * LANES)
            or not kernels.supports(spec.out_channels, spec.data_shape[-1], spec.dot)):
        return False
    return _blocking(spec).tile_rows >= MIN_TILE_ROWS


def target_dtypes(target: tvm.target.Target) -> frozenset[str]:
    """The data dtypes `target` (an llvm target) may compute on AMX tiles."""
    has = tvm.target.codegen.target_has_features
    if target.kind.name != "llvm" or not has("amx-tile", target):
        return frozenset()
    return frozenset(dtype for dtype, feature in TARGET_FEATURES.items() if has(feature, target))


def conv2d_nhwc(spec: ConvSpec) -> tvm.tirx.PrimFunc:
    """The AMX kernel for `spec` (see `supports`), taking the weight `kernels.pack_weight` packs (no weight sums)."""
    if not supports(spec):
        raise DTypeError(f"the AMX kernel takes bf16 -> fp32 or int8 -> int32 with output channels divisible by "
                         f"{PANELS * LANES}, input channels filling 4-byte groups (2 bf16, 4 int8) and output rows "
                         f"of at least {MIN_TILE_ROWS} pixels; got {spec}")
    request_permission()
    sch = s_tir.Schedule(_kernel(spec, PRODUCTS[spec.data_dtype], _blocking(spec)))
    sch.annotate(sch.get_loops(sch.get_sblock("amx_block"))[0], "pragma_import_llvm",
                 llvm_ir(PRODUCTS[spec.data_dtype]))
    return sch.mod["main"].without_attr("global_symbol").with_attr("tirx.is_scheduled", True)


def _kernel(spec: ConvSpec, product: AmxProduct, blocking: _Blocking) -> tvm.tirx.PrimFunc:
    """The PrimFunc: a parallel loop over (32 output channels, pair of pixel tiles), one LLVM call each."""
    batch, height, width, channels = spec.data_shape
    _, out_h, _, out_c = spec.out_shape
    (kernel_h, kernel_w), (stride_h, stride_w) = spec.kernel_size, spec.strides
    group = 4 // product.element_bytes
    rows, x_blocks, positions = blocking.tile_rows, blocking.x_blocks, blocking.positions
    pairs, size = (positions + 1) // 2, product.element_bytes
    per_image = out_h * x_blocks

    @T.prim_func(s_tir=True)
    def kernel(data: T.Buffer((batch, height, width, channels), spec.data_dtype),
               packed: T.Buffer((out_c // LANES, kernel_h, kernel_w, channels // group, LANES, group),
                                spec.data_dtype if size == 2 else "int8"),
               out: T.Buffer(spec.out_shape, product.acc_dtype)):
        T.func_attr({"tirx.noalias": True})
        for item in T.parallel(out_c // (PANELS * LANES) * pairs):
            with T.sblock("amx_block"):
                T.reads(data[0:batch, 0:height, 0:width, 0:channels],
                        packed[0:out_c // LANES, 0:kernel_h, 0:kernel_w, 0:channels // group, 0:LANES, 0:group])
                T.writes(out[0:batch, 0:out_h, 0:spec.out_shape[2], 0:out_c])
                panel = item // pairs * PANELS
                first = item % pairs * 2
                second = T.min(first + 1, positions - 1)
                T.evaluate(T.call_extern(
                    "int32", product.symbol,
                    T.address_of(out[first // per_image, first // x_blocks % out_h, first % x_blocks * rows,
                                     panel * LANES]),
                    T.address_of(out[second // per_image, second // x_blocks % out_h, second % x_blocks * rows,
                                     panel * LANES]),
                    T.address_of(data[first // per_image, first // x_blocks % out_h * stride_h,
                                      first % x_blocks * rows * stride_w, 0]),
                    T.address_of(data[second // per_image, second // x_blocks % out_h * stride_h,
                                      second % x_blocks * rows * stride_w, 0]),
                    T.address_of(packed[panel, 0, 0, 0, 0, 0]),
                    T.int64(rows), T.int64(blocking.step_bytes), T.int64(stride_w * channels * size),
                    T.int64(width * channels * size), T.int64(kernel_h), T.int64(blocking.row_bytes),
                    T.int64(out_c * 4)))

    return kernel


def request_permission() -> bool:
    """Ask Linux for AMX tile state for this process (needed before any AMX instruction runs); True if granted."""
    import ctypes  # pylint: disable=import-outside-toplevel

    try:
        return ctypes.CDLL(None).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
