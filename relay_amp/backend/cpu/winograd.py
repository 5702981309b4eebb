"""winograd: 3x3 stride-1 fp32 convolutions as Winograd's F(2x2, 3x3) where fp32 FMAs are 256 bits wide.

Each 2x2 block ("tile") of a 3x3 convolution's outputs is A^T [(G g G^T) . (B^T d B)] A, d the tile's 4x4
window of the padded input and g a 3x3 filter (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks",
2015). The products become 16 matmuls, one per element of the transformed 4x4 window: every tile's transformed
window by the transformed weights (G g G^T, computed once, a constant), on the same fp32 dot-product kernels,
with 2.25x fewer multiplies than the convolution's. Each transformed window element is a signed sum of 4 window
values (B^T's rows have two nonzeros, all +-1), each output a signed sum of 9 of the 16 products (A^T's), computed
in TE functions that the ops after the convolution (bias, ReLU, a residual add) fuse into.

On a 2-core AVX2 Zen 3, against the direct kernels (ReLU after; one process, medians): 56x56x64 -> 64
1.67 -> 1.25 ms, 28x28x128 -> 128 1.34 -> 0.83 ms, 14x14x256 -> 256 1.77 -> 0.95 ms, 7x7x512 -> 512 1.81 ->
1.52 ms. The results differ from the direct convolution's by rounding (about 1e-6 of the output's largest value
in fp32). Zen 4 computes each AVX-512 FMA in two 256-bit halves, as many products a cycle as AVX2's cores, and its
direct kernels run near that peak (ResNet-50 fp32 at about 105 GMAC/s on two cores), so it takes them too (2-core
Zen 4, the direct kernels' time against these, ReLU after: 56x56x64 0.63x, 28x28x128 0.54x, 14x14x256 0.59x,
7x7x512 0.77-0.91x; the bounds below measured the same way there: 14x14x64 1.27x and 56x56x32 0.92x with them
lowered). Cores that compute a whole AVX-512 FMA a cycle (Zen 5, Intel's server cores; AMX hosts) keep the direct
kernels (not measured there), and bf16 and int8 convolutions keep theirs (the transforms would add in their
precision); AVX2's bf16 convolutions, widened to fp32 first, take it.
"""

import math

import numpy as np
import tvm
from tvm import relax, te

from ..._ir import calls_any_op, is_static_shape, rewrite_op_calls, tensor_dtype, tensor_shape
from .cores import splits_avx512

CONV = "relax.nn.conv2d"
INPUT_TRANSFORM = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]])  # B^T
WEIGHT_TRANSFORM = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])  # G
OUTPUT_TRANSFORM = np.array([[1, 1, 1, 0], [0, 1, -1, -1]])  # A^T
MIN_CHANNELS = 64  # fewer channels in or out: no faster (56x56x32 -> 32: 1.08x the direct conv's time)
MIN_EXTENT = 7  # an output height or width below this: not measured
MIN_PRODUCTS = 1 << 18  # tiles x channels in x out of each of the 16 matmuls: below this their calls and the
# transforms cost more than the multiplies saved (7x7x64 -> 64: 1.26x the direct conv's time, 14x14x64: 1.12x;
# 8x8x128 -> 128, at this bound: 0.93x)


def suits(target: tvm.target.Target) -> bool:
    """Whether `target` takes Winograd convolutions: an LLVM CPU without AVX-512, or one whose core computes an
    AVX-512 FMA in two halves (Zen 4), where fp32 FMAs compute 16 products a cycle."""
    return target.kind.name == "llvm" and (not tvm.target.codegen.target_has_features("avx512f", target)
                                           or splits_avx512(target))


@tvm.transform.module_pass(opt_level=0, name="relay_amp.WinogradConvs")
class WinogradConvs:
    """Rewrite each fp32 NHWC 3x3 stride-1 undilated ungrouped convolution with a constant HWIO weight, at least
    MIN_CHANNELS channels in and out, an output at least MIN_EXTENT high and wide and MIN_PRODUCTS products in each
    transformed element's matmul, as Winograd's F(2x2, 3x3): a pad, 16 input transforms, 16 matmuls by the
    transformed weights and an output transform."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        if not calls_any_op(mod, [CONV]):
            return mod
        return rewrite_op_calls(mod, self.func, {CONV: _winograd})


def _winograd(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    """`call` as Winograd's pad, transforms and matmuls, or None where it does not take them."""
    if not _takes_winograd(call):
        return None
    data, weight = call.args
    (batch, height, width, _), (_, out_height, out_width, _) = tensor_shape(data), tensor_shape(call)
    rows, cols = _tile_grid(out_height, out_width)
    top, left = (int(pad) for pad in call.attrs.padding[:2])
    padded = builder.emit(relax.op.nn.pad(data, [0, 0, top, 2 * rows + 2 - height - top,
                                                 left, 2 * cols + 2 - width - left, 0, 0]))
    weights = transformed_weights(weight.value.numpy())
    products = [builder.emit(relax.op.matmul(
        builder.emit_te(window_part, padded, rows, cols, element, primfunc_name_hint="winograd_input"),
        relax.const(weights[element]))) for element in range(16)]
    return builder.call_te(output_tiles, products, (batch, out_height, out_width, weights.shape[2]), rows, cols,
                           primfunc_name_hint="winograd_output")


def _takes_winograd(call: relax.Call) -> bool:
    """Whether the conv2d `call` is one WinogradConvs rewrites."""
    attrs, (data, weight) = call.attrs, call.args
    shape, out_shape = tensor_shape(data), tensor_shape(call)
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NHWC", "HWIO", "NHWC") or int(attrs.groups) != 1:
        return False
    if any(int(v) != 1 for v in [*attrs.strides, *attrs.dilation]) or not isinstance(weight, tvm.ir.expr.Constant):
        return False
    if {tensor_dtype(data), tensor_dtype(weight), tensor_dtype(call)} != {"float32"}:
        return False
    kernel = tensor_shape(weight)
    if kernel[:2] != (3, 3) or not is_static_shape(shape) or not is_static_shape(out_shape):
        return False
    tiles = out_shape[0] * math.prod(_tile_grid(*out_shape[1:3]))
    return (min(kernel[2:]) >= MIN_CHANNELS and min(out_shape[1:3]) >= MIN_EXTENT
            and tiles * kernel[2] * kernel[3] >= MIN_PRODUCTS)


def _tile_grid(height: int, width: int) -> tuple[int, int]:
    """The 2x2 output tiles down and across an output of `height` x `width`."""
    return -(-height // 2), -(-width // 2)


def transformed_weights(weight: np.ndarray) -> np.ndarray:
    """G g G^T of each input and output channel's 3x3 filter g of an HWIO `weight`, as [16, in, out] fp32."""
    transformed = np.einsum("ai,ijck,bj->abck", WEIGHT_TRANSFORM, weight.astype("float64"), WEIGHT_TRANSFORM)
    return transformed.reshape(16, *weight.shape[2:]).astype("float32")


def window_part(padded: te.Tensor, rows: int, cols: int, element: int) -> te.Tensor:
    """Element `element` (row-major in 4x4) of B^T d B for each tile's window d of `padded` (NHWC): [tiles, C]."""
    terms = [(i, j, int(sign)) for i in range(4) for j in range(4)
             if (sign := INPUT_TRANSFORM[element // 4, i] * INPUT_TRANSFORM[element % 4, j])]

    def value(tile, channel):
        image, place = tile // (rows * cols), tile % (rows * cols)
        top, left = place // cols * 2, place % cols * 2
        return _signed_sum([(padded[image, top + i, left + j, channel], sign) for i, j, sign in terms])

    return te.compute((padded.shape[0] * rows * cols, padded.shape[3]), value, name="winograd_input")


def output_tiles(products: list, shape: tuple, rows: int, cols: int) -> te.Tensor:
    """The NHWC convolution output `shape` from the 16 products ([tiles, K] each): A^T M A for each tile."""

    def value(image, y, x, channel):
        tile = image * rows * cols + y // 2 * cols + x // 2
        corners = [_signed_sum([(products[4 * a + b][tile, channel], int(sign)) for a in range(4) for b in range(4)
                                if (sign := OUTPUT_TRANSFORM[i, a] * OUTPUT_TRANSFORM[j, b])])
                   for i in range(2) for j in range(2)]
        upper = tvm.tirx.Select(x % 2 == 0, corners[0], corners[1])
        lower = tvm.tirx.Select(x % 2 == 0, corners[2], corners[3])
        return tvm.tirx.Select(y % 2 == 0, upper, lower)

    return te.compute(shape, value, name="winograd_output")


def _signed_sum(terms: list) -> tvm.ir.expr.Expr:
    """The sum of each value times its sign (+1 or -1)."""
    total = terms[0][0] if terms[0][1] > 0 else -terms[0][0]
    for value, sign in terms[1:]:
        total = total + value if sign > 0 else total - value
    return total
