"""winograd: 3x3 stride-1 fp32 convolutions as Winograd's F(2x2, 3x3) where fp32 FMAs are 256 bits wide.

Each 2x2 block ("tile") of a 3x3 convolution's outputs is A^T [(G g G^T) . (B^T d B)] A, d the tile's 4x4
window of the padded input and g a 3x3 filter (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks",
2015). The products become 16 matmuls, one per element of the transformed 4x4 window: every tile's transformed
window by the transformed weights (G g G^T, computed once, a constant), on the same fp32 dot-product kernels,
with 2.25x fewer multiplies than the convolution's, in one kernel call (a weight per batch element). Each
transformed window element is a signed sum of 4 window values (B^T's rows have two nonzeros, all +-1), computed in
one scheduled function that loads each tile's window once for its 16 elements (16 functions of one element each
loaded it 4 times over and cost a launch each: ResNet-18 fp32 0.944-0.960x the time on Zen 4, ResNet-50
0.966-0.980x); each output is a sum of 9 of the 16 products (A^T's), computed in a TE function that the ops after
the convolution (bias, ReLU, a residual add) fuse into.

On a 2-core AVX2 Zen 3, against the direct kernels (ReLU after; one process, medians): 56x56x64 -> 64
1.67 -> 1.25 ms, 28x28x128 -> 128 1.34 -> 0.83 ms, 14x14x256 -> 256 1.77 -> 0.95 ms, 7x7x512 -> 512 1.81 ->
1.52 ms. The results differ from the direct convolution's by rounding (about 1e-6 of the output's largest value
in fp32). Zen 4 computes each AVX-512 FMA in two 256-bit halves, as many products a cycle as AVX2's cores, and its
direct kernels run near that peak (ResNet-50 fp32 at about 105 GMAC/s on two cores), so it takes them too (2-core
Zen 4, the direct kernels' time against these, ReLU after: 56x56x64 0.63x, 28x28x128 0.54x, 14x14x256 0.59x,
7x7x512 0.77-0.91x; the bounds below measured the same way there: 14x14x64 1.27x and 56x56x32 0.92x with them
lowered). On a 2-core Sapphire Rapids-class AMX host, whose cores compute a whole AVX-512 FMA a cycle, the direct
kernels run near their peak too, and Winograd's still saves time from 14x14 outputs up (14x14x256 0.76x the
direct conv's time; 56x56x64 1.0x; 7x7x512 1.28x, so there `min_extent` is 14): ResNet-50 fp32 23.16 -> 21.57 ms,
ResNet-18 10.49 -> 8.10 ms (ONNX Runtime 22.56 and 9.76; one process). Other cores with whole AVX-512 FMAs (Zen 5,
Intel's without AMX) keep the direct kernels (not measured there), and int8 convolutions keep theirs (the
transforms would add in their precision); AVX2's bf16 convolutions, widened to fp32 first, take it.

bf16 convolutions take it on Zen 4 with fast math (`bf16_suits`; `build(..., fast_math=False)` keeps them direct):
its fp32 convs run as Winograd's and its bf16 ones ran directly on `vdpbf16ps` near that instruction's peak, so bf16
gained little over fp32 on 3x3 CNNs (torchvision's ResNet-18 1.41x, timm's RepVGG-A0 1.33x). Each transformed window
element is summed in fp32 from the bf16 window and rounded to bf16 once, the transformed weights are rounded from
G g G^T of the bf16 weights, their products accumulate in fp32 on the bf16 kernels, and the output transform runs in
fp32. 2-core Zen 4, one process, bf16 Winograd against bf16 direct (error: largest difference from relay_amp fp32
over the largest output, median of 32 random inputs; PyTorch's own bf16, channels-last autocast, beside it):
torchvision's ResNet-18 0.76-0.78x the time (bf16 / fp32 1.41x -> 1.80-1.85x), error 0.00338 -> 0.00446 (PyTorch
0.00389), top-1 32/32; RepVGG-A0 0.70x, error 0.00267 -> 0.00264 (PyTorch 0.00304); ResNet-50 0.885x, error 0.00403
-> 0.00397 (PyTorch 0.00417); the zoo's (transformers') ResNet-18 error 0.00457 -> 0.00522 (PyTorch 0.00519),
ResNet-50 0.00447 -> 0.00535 (PyTorch 0.00477), BiT-R50 0.1070 -> 0.1085 (PyTorch 0.1057). Single layers (bias and
ReLU after), Winograd / direct: 28x28x128 0.56x, 14x14x256 0.50x, 14x14x96 0.98x, 56x56x64 0.65x and 35x35x64 -> 96
0.68x (1.28x and 1.30x in an earlier run of the same pairs: this VM drifts). Outputs below 14x14 keep their direct
convs (`BF16_MIN_EXTENT`).
"""

import math

import numpy as np
import tvm
from tvm import relax, s_tir, te

from ...dtypes import cast_array
from ..._ir import calls_any_op, is_static_shape, opaque_scheduled, rewrite_op_calls, tensor_dtype, tensor_shape
from .cores import splits_avx512

CONV = "relax.nn.conv2d"
BF16 = "bfloat16"
INPUT_TRANSFORM = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]])  # B^T
WEIGHT_TRANSFORM = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])  # G
OUTPUT_TRANSFORM = np.array([[1, 1, 1, 0], [0, 1, -1, -1]])  # A^T
MIN_CHANNELS = 64  # fewer channels in or out: faster where the host is quiet, slower where another tenant loads its
# memory (Zen 4: 56x56x32 -> 32 0.68x the direct conv's time; DenseNet-121 with its 128 -> 32 convs taking it where
# their transforms fit in 4 MB: 0.94x the time in a quiet stretch, 1.12x in a contended one, when ResNet-18's wide
# Winograd convs read 0.73x and 0.91x): their transforms move as many bytes for fewer multiplies saved
MIN_EXTENT = 7  # an output height or width below this: not measured
WIDE_MIN_EXTENT = 14  # the same where each AVX-512 FMA computes 16 products (AMX hosts): 7x7x512 -> 512 there ran
# 1.28x the direct conv's time (its transforms as costly, its multiplies saved half as long), 14x14x256 0.76x
BF16_MIN_EXTENT = 14  # a bf16 conv's least output height and width: torchvision's ResNet-18 in bf16 with its 7x7x512
# convs as Winograd's too ran 1.026-1.027x the time of the build without them, ResNet-50 1.007-1.008x (one process, two
# runs each), though a 7x7x512 -> 512 conv alone read 0.929x
MIN_PRODUCTS = 1 << 17  # tiles x channels in x out of each of the 16 matmuls: below this the transforms cost more
# than the multiplies saved (7x7x64 -> 64: 1.18-1.28x the direct conv's time; 14x14x64, over it: 0.74-0.82x)


def suits(target: tvm.target.Target) -> bool:
    """Whether `target` takes Winograd convolutions: an LLVM CPU without AVX-512, one whose core computes an
    AVX-512 FMA in two halves (Zen 4), where fp32 FMAs compute 16 products a cycle, or an AMX host (Sapphire
    Rapids' cores compute 32 a cycle, and its wider convs still ran faster as Winograd's; see `min_extent`)."""
    has = tvm.target.codegen.target_has_features
    return target.kind.name == "llvm" and (not has("avx512f", target) or splits_avx512(target)
                                           or has("amx-tile", target))


def bf16_suits(target: tvm.target.Target) -> bool:
    """Whether bf16 3x3 convolutions take Winograd's form on `target`: a Zen 4 (each AVX-512 FMA in two halves, as
    `vdpbf16ps` too) with avx512_bf16 and no AMX tiles (where AMX computes bf16 convs far faster)."""
    has = tvm.target.codegen.target_has_features
    return (target.kind.name == "llvm" and splits_avx512(target) and has("avx512bf16", target)
            and not has("amx-tile", target))


def min_extent(target: tvm.target.Target) -> int:
    """The least output height and width of a conv that takes Winograd's form on `target` (a `suits` one):
    WIDE_MIN_EXTENT where AVX-512 FMAs are whole, else MIN_EXTENT."""
    has = tvm.target.codegen.target_has_features
    return WIDE_MIN_EXTENT if has("avx512f", target) and not splits_avx512(target) else MIN_EXTENT


@tvm.transform.module_pass(opt_level=0, name="relay_amp.WinogradConvs")
class WinogradConvs:
    """Rewrite each fp32 NHWC 3x3 stride-1 undilated ungrouped convolution with a constant HWIO weight, at least
    MIN_CHANNELS channels in and out, an output at least `least_extent` high and wide (`min_extent` of the target)
    and MIN_PRODUCTS products in each transformed element's matmul, as Winograd's F(2x2, 3x3): a pad, an input
    transform, one batched matmul of the 16 transformed elements by their transformed weights and an output
    transform. With `bf16`, bf16 convolutions too, where their output is at least BF16_MIN_EXTENT high and wide
    (`bf16_suits` targets): their transformed windows and weights in bf16, the products and the output transform in
    fp32."""

    def __init__(self, func: str = "main", least_extent: int = MIN_EXTENT, bf16: bool = False):
        self.func = func
        self.least_extent = least_extent
        self.bf16 = bf16

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        if not calls_any_op(mod, [CONV]):
            return mod
        least_extents = {"float32": self.least_extent, **({BF16: max(self.least_extent, BF16_MIN_EXTENT)}
                                                          if self.bf16 else {})}
        return rewrite_op_calls(mod, self.func, {CONV: lambda call, builder: _winograd(call, builder,
                                                                                       least_extents)})


def _winograd(call: relax.Call, builder: relax.BlockBuilder, least_extents: dict) -> "relax.Expr | None":
    """`call` as Winograd's pad, transforms and matmuls, or None where it does not take them (`least_extents`: the
    least output height and width per dtype taken)."""
    if not _takes_winograd(call, least_extents):
        return None
    data, weight = call.args
    (batch, height, width, _), (_, out_height, out_width, _) = tensor_shape(data), tensor_shape(call)
    rows, cols = _tile_grid(out_height, out_width)
    top, left = (int(pad) for pad in call.attrs.padding[:2])
    padded = builder.emit(relax.op.nn.pad(data, [0, 0, top, 2 * rows + 2 - height - top,
                                                 left, 2 * cols + 2 - width - left, 0, 0]))
    dtype = tensor_dtype(data)
    weights = transformed_weights(weight.value.numpy())
    products = builder.emit(relax.op.matmul(builder.emit(_windows_call(builder, padded, rows, cols)),
                                            relax.const(tvm.runtime.tensor(cast_array(weights, dtype))),
                                            out_dtype=None if dtype == "float32" else "float32"))  # bf16's in fp32
    outputs = builder.call_te(output_tiles, products, (batch, out_height, out_width, weights.shape[2]), rows, cols,
                              primfunc_name_hint="winograd_output")
    return outputs if tensor_dtype(call) == "float32" else relax.op.astype(builder.emit(outputs), tensor_dtype(call))


def _windows_call(builder: relax.BlockBuilder, padded: relax.Expr, rows: int, cols: int) -> relax.Call:
    """The call of `transformed_windows`, scheduled here and opaque to operator fusion: fused with the ops before it
    (the last conv's output transform), it would compute each window value as often as windows read it."""
    dtype = tensor_dtype(padded)
    data = te.placeholder(tensor_shape(padded), dtype, "padded")
    windows = transformed_windows(data, rows, cols)
    func = windows_schedule(te.create_prim_func([data, windows]))
    name = builder.add_func(opaque_scheduled(func.without_attr("global_symbol")), "winograd_input")
    return relax.call_tir(name, [padded], relax.TensorType([int(d) for d in windows.shape], dtype))


def windows_schedule(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """`transformed_windows` with each tile's 16 elements unrolled inside its loop over channel vectors, so that a
    vector of its window is loaded once for all of them (16 loads where separate elements take 64), tiles in
    parallel."""
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("winograd_input")
    element, tile, channel = sch.get_loops(block)
    channels = int(sch.get(channel).extent)
    lanes = next(lanes for lanes in (16, 8, 1) if channels % lanes == 0)
    outer, inner = sch.split(channel, [None, lanes])
    sch.reorder(tile, outer, element, inner)
    sch.parallel(tile)
    sch.unroll(element)
    if lanes > 1:
        sch.vectorize(inner)
    return sch.mod["main"]


def _takes_winograd(call: relax.Call, least_extents: dict) -> bool:
    """Whether the conv2d `call` is one WinogradConvs rewrites: its inputs of a dtype in `least_extents`, its output
    that dtype or fp32 and at least as high and wide as `least_extents` gives for the dtype."""
    attrs, (data, weight) = call.attrs, call.args
    shape, out_shape = tensor_shape(data), tensor_shape(call)
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NHWC", "HWIO", "NHWC") or int(attrs.groups) != 1:
        return False
    if any(int(v) != 1 for v in [*attrs.strides, *attrs.dilation]) or not isinstance(weight, tvm.ir.expr.Constant):
        return False
    dtype = tensor_dtype(data)
    if dtype not in least_extents or tensor_dtype(weight) != dtype or tensor_dtype(call) not in {dtype, "float32"}:
        return False
    kernel = tensor_shape(weight)
    if kernel[:2] != (3, 3) or not is_static_shape(shape) or not is_static_shape(out_shape):
        return False
    tiles = out_shape[0] * math.prod(_tile_grid(*out_shape[1:3]))
    return (min(kernel[2:]) >= MIN_CHANNELS and min(out_shape[1:3]) >= least_extents[dtype]
            and tiles * kernel[2] * kernel[3] >= MIN_PRODUCTS)


def _tile_grid(height: int, width: int) -> tuple[int, int]:
    """The 2x2 output tiles down and across an output of `height` x `width`."""
    return -(-height // 2), -(-width // 2)


def transformed_weights(weight: np.ndarray) -> np.ndarray:
    """G g G^T of each input and output channel's 3x3 filter g of an HWIO `weight` (fp32 or bf16), as [16, in, out]
    fp32."""
    transformed = np.einsum("ai,ijck,bj->abck", WEIGHT_TRANSFORM, weight.astype("float64"), WEIGHT_TRANSFORM)
    return transformed.reshape(16, *weight.shape[2:]).astype("float32")


def transformed_windows(padded: te.Tensor, rows: int, cols: int) -> te.Tensor:
    """B^T d B for each tile's window d of `padded` (NHWC), element by element (row-major in 4x4): [16, tiles, C],
    the tiles rounded up to an odd count (the last repeated), so that the 16 planes do not lie a multiple of 4 KB
    apart, in one L1 set. Row r of B^T adds window row `_FIRST[r]` and `_SIGN[r]` times row `_SECOND[r]` (so do its
    columns). A bf16 window is summed in fp32 and rounded to bf16 once."""

    tiles = padded.shape[0] * rows * cols

    def value(element, tile, channel):
        tile = te.min(tile, tiles - 1)  # the extra tile repeats the last
        image, place = tile // (rows * cols), tile % (rows * cols)
        top, left = place // cols * 2, place % cols * 2
        row, col = element // 4, element % 4

        def read(i, j):
            return padded[image, top + i, left + j, channel].astype("float32")

        def window_row(i):  # window row i's two columns for `col`, the second signed
            return read(i, _pick(_FIRST, col)) + _pick(_SIGN, col, "float32") * read(i, _pick(_SECOND, col))

        total = window_row(_pick(_FIRST, row)) + _pick(_SIGN, row, "float32") * window_row(_pick(_SECOND, row))
        return total.astype(padded.dtype)

    return te.compute((16, tiles + 1 - tiles % 2, padded.shape[3]), value, name="winograd_input")


_FIRST = tuple(int(np.flatnonzero(row == 1)[0]) for row in INPUT_TRANSFORM)  # the window row each row of B^T adds
_SECOND = tuple(int(next(i for i in np.flatnonzero(row) if i != first)) for row, first in zip(INPUT_TRANSFORM, _FIRST))
_SIGN = tuple(int(row[second]) for row, second in zip(INPUT_TRANSFORM, _SECOND))  # ... and its other row, signed


def _pick(values: tuple, index, dtype: str = "int64") -> tvm.ir.expr.Expr:
    """values[index] for a TIR `index` in [0, 4), as a chain of selects."""
    picked = tvm.tirx.const(values[-1], dtype)
    for i in reversed(range(len(values) - 1)):
        picked = tvm.tirx.Select(index == i, tvm.tirx.const(values[i], dtype), picked)
    return picked


def output_tiles(products: te.Tensor, shape: tuple, rows: int, cols: int) -> te.Tensor:
    """The NHWC convolution output `shape` from the 16 products ([16, tiles, K]): A^T M A for each tile."""

    def value(image, y, x, channel):
        tile = image * rows * cols + y // 2 * cols + x // 2
        across = [_output_row((x % 2).astype("float32"), [products[4 * a + b, tile, channel] for b in range(4)])
                  for a in range(4)]
        return _output_row((y % 2).astype("float32"), across)

    return te.compute(shape, value, name="winograd_output")


def _output_row(parity: tvm.ir.expr.Expr, values: list) -> tvm.ir.expr.Expr:
    """Row `parity` (0 or 1, as fp32) of A^T times four values, as multiply-adds by coefficients linear in the
    parity (one per row of outputs, the same across a vector of channels), so that an output computes its own
    corner only, not all four."""
    total = None
    for value, first, last in zip(values, *OUTPUT_TRANSFORM.tolist()):
        coefficient = first if first == last else first + (last - first) * parity
        term = value if coefficient == 1 else coefficient * value
        total = term if total is None else total + term
    return total
