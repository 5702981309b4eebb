"""int4 on CUDA tensor cores: matmuls and convolutions over int4 values on `mma.sync.m8n8k32.s32.s4.s4.s32`,
their operands packed eight values to a 32-bit word.

A recast int4 model reaches the backend with its int4 values held in int8 (`passes.sub_byte`: casts of values
clamped to [-8, 7]). `PackInt4Operands` finds each matmul and convolution both of whose operands hold such
values, packs both along the reduction axis (a matmul's K, a convolution's input channels) into `uint32` words,
value i of a word in bits 4i..4i+3 as a two's-complement nibble, the axis padded with zeros to whole steps of
32 values, and calls a reference PrimFunc on the packed words (plain TIR, what the tests run on the CPU).
`UseS4TensorCores` swaps each reference for the tensor-core kernel of the same `S4Spec`. Constant weights are
packed once, by constant folding.

Both read their operands through the same addressing: an implicit GEMM whose rows are a matmul's rows or a
convolution's output pixels (images included), whose columns are output channels and whose K runs over the
kernel taps, then the words of the channels. The kernel gives each block one warp and each warp up to 4x4
fragments of 8x8 outputs; per K step of 32 values a lane loads, straight from global memory, the word PTX's
m8n8k32 layout gives it (row or column lane / 4 of the fragment, word lane % 4 of the step), and holds output
columns 2 (lane % 4) and 2 (lane % 4) + 1 of row lane / 4.
"""

import json
import math
from dataclasses import asdict, dataclass

import tvm
from tvm import relax, te
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..._ir import OPAQUE_PATTERN, is_static_shape, rewrite_function, tensor_dtype, tensor_shape
from ...serialization import dataclass_from_json
from ..code_bounds import value_range

SPEC_ATTR = "relay_amp.s4_gemm"  # on the reference PrimFunc: its S4Spec as JSON
VALUES_PER_WORD = 8
STEP_WORDS = 4  # an m8n8k32 step: 32 values of K, one word per lane of a group of four
STEP = VALUES_PER_WORD * STEP_WORDS
FRAGMENT = 8  # m8n8: rows and columns of one fragment
MAX_FRAGMENTS = 4  # fragments per warp along rows and along columns
WARP_SIZE = 32
LANES_PER_ROW = 4  # lanes sharing a fragment row (or column): PTX's "thread ID in group"
INT4_RANGE = (-8, 7)
CONV_LAYOUTS = ("HWNC", "NHWC")  # data (and output) layouts whose channels are innermost
PACKED_KERNEL_LAYOUT = "HWOI"


@dataclass(frozen=True)
class S4Spec:
    """One implicit GEMM over packed int4 words: the packed operands' and the int32 output's shapes, and for a
    convolution (`layout` HWNC or NHWC, kernel packed HWOI) its strides, top/left padding and dilation."""

    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    layout: str = "matmul"
    strides: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)

    @property
    def rows(self) -> int:
        """GEMM rows: a matmul's rows, or a convolution's output pixels over all images."""
        return math.prod(self.out_shape[:-1])

    @property
    def columns(self) -> int:
        """GEMM columns: output channels."""
        return self.out_shape[-1]

    @property
    def taps(self) -> tuple[int, int]:
        """The convolution window's height and width ((1, 1) for a matmul)."""
        return (1, 1) if self.layout == "matmul" else tuple(self.b_shape[:2])

    @property
    def words(self) -> int:
        """Packed words of K per tap: a whole number of 32-value steps."""
        return self.a_shape[-1]

    def to_json(self) -> str:
        """The spec as JSON (the reference PrimFunc's attribute)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "S4Spec":
        """The spec `to_json` wrote."""
        return dataclass_from_json(cls, text)


def spec_of(func) -> S4Spec | None:
    """The S4Spec a reference PrimFunc carries under SPEC_ATTR, None for any other function."""
    if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None or SPEC_ATTR not in func.attrs:
        return None
    return S4Spec.from_json(str(func.attrs[SPEC_ATTR]))


def packed_words(depth: int) -> int:
    """Words holding `depth` values, padded to whole 32-value steps."""
    return -(-depth // STEP) * STEP_WORDS


def pack_te(values: te.Tensor) -> te.Tensor:
    """TE: int8 values in [-8, 7] packed along their last axis, eight nibbles a uint32 (zeros past the end)."""
    *outer, depth = (int(extent) for extent in values.shape)

    def word(*index):
        *lead, w = index
        packed = tvm.tirx.const(0, "uint32")
        for i in range(VALUES_PER_WORD):
            k = w * VALUES_PER_WORD + i
            nibble = (values[(*lead, k)].astype("uint32") & tvm.tirx.const(15, "uint32")) << (4 * i)
            packed = packed | tvm.tirx.if_then_else(k < depth, nibble, tvm.tirx.const(0, "uint32"))
        return packed

    return te.compute((*outer, packed_words(depth)), word, name="packed_int4")


def unpack(word, i: int):
    """Value `i` of a packed word, sign-extended to int32."""
    nibble = ((word >> (4 * i)) & tvm.tirx.const(15, "uint32")).astype("int32")
    return (nibble ^ 8) - 8


def _pixel(spec: S4Spec, row):
    """(image, output y, output x) of a convolution's GEMM row, in the output layout's order."""
    if spec.layout == "HWNC":
        _, out_w, images, _ = spec.out_shape
        return row % images, row // (out_w * images), row // images % out_w
    _, out_h, out_w, _ = spec.out_shape
    return row // (out_h * out_w), row // out_w % out_h, row % out_w


def _a_word(spec: S4Spec, a, row, tap, word):
    """The packed word of A at GEMM row `row`, kernel tap `tap` and word `word` of K (0 past the edges)."""
    zero = tvm.tirx.const(0, "uint32")
    if spec.layout == "matmul":
        return tvm.tirx.if_then_else(row < spec.rows, a[row, word], zero)
    image, y, x = _pixel(spec, row)
    window_w = spec.taps[1]
    in_y = y * spec.strides[0] + tap // window_w * spec.dilation[0] - spec.padding[0]
    in_x = x * spec.strides[1] + tap % window_w * spec.dilation[1] - spec.padding[1]
    height, width = (spec.a_shape[:2] if spec.layout == "HWNC" else spec.a_shape[1:3])
    inside = tvm.tirx.all(row < spec.rows, 0 <= in_y, in_y < height, 0 <= in_x, in_x < width)
    index = (in_y, in_x, image, word) if spec.layout == "HWNC" else (image, in_y, in_x, word)
    return tvm.tirx.if_then_else(inside, a[index], zero)


def _b_word(spec: S4Spec, b, column, tap, word):
    """The packed word of B at output channel `column`, kernel tap `tap` and word `word` (0 past the columns)."""
    zero = tvm.tirx.const(0, "uint32")
    if spec.layout == "matmul":
        return tvm.tirx.if_then_else(column < spec.columns, b[column, word], zero)
    window_w = spec.taps[1]
    return tvm.tirx.if_then_else(column < spec.columns, b[tap // window_w, tap % window_w, column, word], zero)


def _out_index(spec: S4Spec, row, column) -> tuple:
    if spec.layout == "matmul":
        return row, column
    image, y, x = _pixel(spec, row)
    return (y, x, image, column) if spec.layout == "HWNC" else (image, y, x, column)


def _arguments(spec: S4Spec):
    a = T.arg("a", T.Buffer(spec.a_shape, "uint32"))
    b = T.arg("b", T.Buffer(spec.b_shape, "uint32"))
    out = T.arg("out", T.Buffer(spec.out_shape, "int32"))
    return a, b, out


def reference_kernel(spec: S4Spec) -> tvm.tirx.PrimFunc:
    """Plain TIR for `spec`: each output the sum over taps, words and nibbles of A's and B's values."""
    with IRBuilder() as builder:
        with T.prim_func(s_tir=True):
            T.func_name("main")
            a, b, out = _arguments(spec)
            with T.serial(0, spec.rows) as row, T.serial(0, spec.columns) as column:
                index = _out_index(spec, row, column)
                T.buffer_store(out, tvm.tirx.const(0, "int32"), index)
                with T.serial(0, math.prod(spec.taps)) as tap, T.serial(0, spec.words) as word:
                    words = (_a_word(spec, a, row, tap, word), _b_word(spec, b, column, tap, word))
                    products = [unpack(words[0], i) * unpack(words[1], i) for i in range(VALUES_PER_WORD)]
                    T.buffer_store(out, out[index] + sum(products[1:], products[0]), index)
    return _opaque(builder.get()).with_attr(SPEC_ATTR, spec.to_json())


def operand_position(lane):
    """(row of A's, or column of B's, fragment; word of the K step) whose packed word `lane` holds (m8n8k32)."""
    return lane // LANES_PER_ROW, lane % LANES_PER_ROW


def accumulator_position(lane, e: int):
    """(row, column) in the 8x8 output fragment of `lane`'s accumulator `e` (0 or 1)."""
    return lane // LANES_PER_ROW, lane % LANES_PER_ROW * 2 + e


def _fragments(extent: int) -> int:
    return min(MAX_FRAGMENTS, -(-extent // FRAGMENT))


def tensor_core_kernel(spec: S4Spec) -> tvm.tirx.PrimFunc:
    """The scheduled CUDA kernel for `spec`: one warp per block, `mma.sync.m8n8k32` on packed words."""
    tile = (_fragments(spec.rows), _fragments(spec.columns))
    blocks = [-(-extent // (fragments * FRAGMENT)) for extent, fragments in zip((spec.rows, spec.columns), tile)]
    with IRBuilder() as builder:
        with T.prim_func(s_tir=True):
            T.func_name("main")
            T.func_attr({"tirx.noalias": True})
            a, b, out = _arguments(spec)
            with T.thread_binding(0, blocks[0], thread="blockIdx.x") as block_row, \
                    T.thread_binding(0, blocks[1], thread="blockIdx.y") as block_column, \
                    T.thread_binding(0, WARP_SIZE, thread="threadIdx.x") as lane:
                base = (block_row * tile[0] * FRAGMENT, block_column * tile[1] * FRAGMENT)
                acc = T.alloc_buffer((tile[0], tile[1], 2), "int32", scope="local")
                fragments = (T.alloc_buffer((tile[0],), "uint32", scope="local"),
                             T.alloc_buffer((tile[1],), "uint32", scope="local"))
                _zero(acc, tile)
                line, slot = operand_position(lane)
                with T.serial(0, math.prod(spec.taps)) as tap, T.serial(0, spec.words // STEP_WORDS) as step:
                    word = step * STEP_WORDS + slot
                    _load(fragments[0], lambda f: _a_word(spec, a, base[0] + f * FRAGMENT + line, tap, word))
                    _load(fragments[1], lambda f: _b_word(spec, b, base[1] + f * FRAGMENT + line, tap, word))
                    _multiply(acc, fragments, tile)
                _store(spec, out, acc, base, lane)
    return _opaque(builder.get()).with_attr("tirx.is_scheduled", True)


def _zero(acc, tile) -> None:
    with T.unroll(0, tile[0]) as i, T.unroll(0, tile[1]) as j, T.unroll(0, 2) as e:
        T.buffer_store(acc, tvm.tirx.const(0, "int32"), (i, j, e))


def _load(fragment, word_of) -> None:
    with T.unroll(0, fragment.shape[0]) as f:
        T.buffer_store(fragment, word_of(f), (f,))


def _multiply(acc, fragments, tile) -> None:
    with T.unroll(0, tile[0]) as i, T.unroll(0, tile[1]) as j:
        T.evaluate(T.ptx_legacy.mma("m8n8k32", "row", "col", "int4", "int4", "int32", fragments[0].data, i,
                                    fragments[1].data, j, acc.data, (i * tile[1] + j) * 2, False, dtype="int32"))


def _store(spec: S4Spec, out, acc, base, lane) -> None:
    """The lane's accumulators to the output, for the warp's tile starting at row and column `base`."""
    with T.unroll(0, acc.shape[0]) as i, T.unroll(0, acc.shape[1]) as j, T.unroll(0, 2) as e:
        row, column = accumulator_position(lane, e)
        row, column = base[0] + i * FRAGMENT + row, base[1] + j * FRAGMENT + column
        with T.If(tvm.tirx.all(row < spec.rows, column < spec.columns)):
            with T.Then():
                T.buffer_store(out, acc[i, j, e], _out_index(spec, row, column))


def _opaque(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    return func.without_attr("global_symbol").with_attr("op_pattern", OPAQUE_PATTERN)


def _holds_int4(mutator: relax.PyExprMutator, expr: relax.Expr) -> bool:
    """Whether every value of the int8 tensor `expr` lies in int4's range by construction (a cast to int8 of values
    clamped into [-8, 7], maybe moved by reshapes and transposes: the layout conversion to HWNC adds one;
    backend.code_bounds)."""
    low, high = value_range(mutator, expr)
    return tensor_dtype(expr) == "int8" and INT4_RANGE[0] <= low and high <= INT4_RANGE[1]


def kernel_name(spec: S4Spec) -> str:
    """The name hint of a packed int4 kernel: relay_amp_s4_matmul or relay_amp_s4_conv2d."""
    return f"relay_amp_s4_{'matmul' if spec.layout == 'matmul' else 'conv2d'}"


def _static(*exprs: relax.Expr) -> bool:
    return all(is_static_shape(tensor_shape(expr)) for expr in exprs)


def _conv_spec(call: relax.Call, data_words: tuple, kernel_words: tuple) -> S4Spec:
    attrs = call.attrs
    return S4Spec(data_words, kernel_words, tuple(tensor_shape(call)), str(attrs.data_layout),
                  tuple(int(s) for s in attrs.strides), tuple(int(p) for p in attrs.padding[:2]),
                  tuple(int(d) for d in attrs.dilation))


def packable(call: relax.Call, mutator: relax.PyExprMutator) -> bool:
    """Whether `call` is a matmul (2-D weight) or an ungrouped NHWC/HWNC convolution to int32 whose operands both
    hold int4 values (bound in `mutator`'s builder), with static shapes."""
    if not isinstance(call.op, tvm.ir.Op) or tensor_dtype(call) != "int32" or len(call.args) < 2:
        return False
    data, weight = call.args[:2]
    if not (_static(data, weight, call) and _holds_int4(mutator, data) and _holds_int4(mutator, weight)):
        return False
    if call.op.name == "relax.matmul":
        return len(tensor_shape(data)) >= 2 and len(tensor_shape(weight)) == 2
    attrs = call.attrs
    return (call.op.name == "relax.nn.conv2d" and int(attrs.groups) == 1 and str(attrs.data_layout) in CONV_LAYOUTS
            and str(attrs.out_layout) == str(attrs.data_layout))


@relax.expr_functor.mutator
class _PackOperands(relax.PyExprMutator):
    """Matmuls and convolutions over int4 values become reference calls on packed words."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if not packable(new_call, self):
            return new_call
        data, weight = new_call.args[:2]
        if new_call.op.name == "relax.matmul":
            return self._matmul(new_call, data, weight)
        kernel_layout = str(new_call.attrs.kernel_layout)
        if kernel_layout != PACKED_KERNEL_LAYOUT:
            weight = relax.op.permute_dims(weight, [kernel_layout.index(axis) for axis in PACKED_KERNEL_LAYOUT])
        data_words, kernel_words = self._pack(data), self._pack(weight)
        return self._call(_conv_spec(new_call, *(tuple(tensor_shape(x)) for x in (data_words, kernel_words))),
                          data_words, kernel_words)

    def _matmul(self, call: relax.Call, data: relax.Expr, weight: relax.Expr) -> relax.Expr:
        *batch, depth = tensor_shape(data)
        rows = self._pack(data if len(batch) == 1 else relax.op.reshape(data, (math.prod(batch), depth)))
        columns = self._pack(relax.op.permute_dims(weight, [1, 0]))
        (_, words), (width, _) = tensor_shape(rows), tensor_shape(columns)
        spec = S4Spec((math.prod(batch), words), (width, words), (math.prod(batch), width))
        product = self._call(spec, rows, columns)
        return product if len(batch) == 1 else relax.op.reshape(self.builder_.emit(product), tensor_shape(call))

    def _pack(self, values: relax.Expr) -> relax.Expr:
        values = values if isinstance(values, relax.Var) else self.builder_.emit(values)
        return self.builder_.emit(self.builder_.call_te(pack_te, values,
                                                        primfunc_name_hint="relay_amp_pack_int4"))

    def _call(self, spec: S4Spec, a: relax.Expr, b: relax.Expr) -> relax.Expr:
        gvar = self.builder_.add_func(reference_kernel(spec), kernel_name(spec))
        return relax.call_tir(gvar, [a, b], relax.TensorType(spec.out_shape, "int32"))


@tvm.transform.module_pass(opt_level=0, name="relay_amp.PackInt4Operands")
class PackInt4Operands:
    """Matmuls and NHWC/HWNC convolutions over int4 values (held in int8) to reference calls on packed words."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mod = rewrite_function(_PackOperands(mod), mod, gvar.name_hint)
        return mod


@tvm.transform.module_pass(opt_level=0, name="relay_amp.UseS4TensorCores")
class UseS4TensorCores:
    """Every packed-int4 reference PrimFunc replaced by its `mma.sync ... s4` tensor-core kernel."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updated = mod.clone()
        for gvar, func in mod.functions_items():
            spec = spec_of(func)
            if spec is not None:
                updated.update_func(gvar, tensor_core_kernel(spec))
        return updated
