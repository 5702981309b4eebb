"""Weight-only int4: matmuls against constant weights keep their activations and read int4 weights, packed.

TVM 0.27 cannot hold a sub-byte tensor, so no int4 tensor ever appears: each weight becomes a `uint32` constant
of packed 4-bit codes plus an fp32 scale per group of `group_size` rows and per output column, and the matmul a
`call_tir` of a PrimFunc that unpacks the codes as it multiplies. Codes are symmetric, `q = clip(round(w / s),
-8, 7)` with `s = -w_max / 8` over the group (w_max: its value of largest magnitude), stored as `q + 8` (a nibble).

Packed layout, `[N / 16, K / 8, 16]` uint32 for a `[K, N]` weight: 16 consecutive columns, then 8 consecutive
rows per 32-bit word; nibble j of the low half holds row 2j, nibble j of the high half row 2j + 1. This is the
order the CPU kernel (relay_amp.backend.cpu.int4) unpacks with two vector operations per four rows.

The PrimFunc written here is the reference: plain TIR any backend can schedule, marked with `SPEC_ATTR` so a
backend can swap in its own kernel for the same spec.
"""

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import tvm
from tvm import relax, te

from .._ir import OPAQUE_PATTERN, rewrite_function, tensor_dtype, tensor_shape
from ..dtypes import MODEL_FLOAT_DTYPES
from ..errors import DTypeError, OptionError
from ..ops import canonical_ops
from .layers import layer_bindings, list_layers, resolve_layers

SPEC_ATTR = "relay_amp.int4_matmul"  # on the reference PrimFunc: its PackedSpec as JSON
WEIGHT_DTYPES = ("int4",)
WEIGHT_OPS = ("relax.matmul",)
DEFAULT_GROUP_SIZE = 128
COLUMNS = 16  # columns per packed block
ROWS_PER_WORD = 8  # rows of one column in a uint32
ZERO_POINT = 8  # codes are stored as q + 8
CODE_MAX = 7
HELD_GROUP_MIN = 16  # the smallest group size held_codes tries
HELD_STEP_FRACTION = 16  # a weight its codes hold is within this fraction of a step (bf16 rounding: a 32nd)


@dataclass(frozen=True)
class PackedSpec:
    """One weight-only int4 matmul: [rows, depth] activations of `data_dtype` times a packed [depth, columns]
    weight with one scale per `group_size` rows and column, stored as `out_dtype`."""

    rows: int
    depth: int
    columns: int
    group_size: int
    data_dtype: str
    out_dtype: str

    @property
    def packed_shape(self) -> tuple[int, int, int]:
        """The shape of the packed uint32 weight."""
        return self.columns // COLUMNS, self.depth // ROWS_PER_WORD, COLUMNS

    @property
    def scales_shape(self) -> tuple[int, int]:
        """The shape of the fp32 scales: one per group of rows and column."""
        return self.depth // self.group_size, self.columns


def spec_of(func) -> PackedSpec | None:
    """The PackedSpec a reference PrimFunc carries under SPEC_ATTR, None for any other function."""
    if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None or SPEC_ATTR not in func.attrs:
        return None
    return PackedSpec(**json.loads(str(func.attrs[SPEC_ATTR])))


def quantize_int4(weight: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 codes (int8, in [-8, 7]) of a [K, N] weight and their fp32 scales [K / group_size, N]: the
    value of largest magnitude in each group is code -8, its scale carrying the sign (ONNX Runtime's symmetric
    MatMulNBits convention, so weights it quantized come back as its codes and scales)."""
    depth, columns = weight.shape
    groups = weight.astype("float64").reshape(depth // group_size, group_size, columns)
    extremes = np.take_along_axis(groups, np.abs(groups).argmax(axis=1)[:, None], axis=1)[:, 0]
    scales = extremes / -ZERO_POINT
    scales[scales == 0] = 1.0
    codes = np.clip(np.round(groups / scales[:, None]), -ZERO_POINT, CODE_MAX).astype("int8")
    return codes.reshape(depth, columns), scales.astype("float32")


def held_codes(weight: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """quantize_int4's codes and scales of a [K, N] weight and their group size: the largest of `group_size`,
    its half, its quarter... (down to HELD_GROUP_MIN) whose codes hold the weight to within a 16th of a step
    (weights quantized elsewhere, a MatMulNBits file's blocks of 32, keep their codes); `group_size` for others."""
    size = group_size
    while size >= HELD_GROUP_MIN and size % ROWS_PER_WORD == 0 and weight.shape[0] % size == 0:
        codes, scales = quantize_int4(weight, size)
        steps = scales[:, None].astype("float64")
        groups = weight.astype("float64").reshape(-1, size, weight.shape[1])
        if (np.abs(codes.reshape(groups.shape) * steps - groups) <= np.abs(steps) / HELD_STEP_FRACTION).all():
            return codes, scales, size
        size //= 2
    return (*quantize_int4(weight, group_size), group_size)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """[K, N] int4 codes in [-8, 7] packed into the [N / 16, K / 8, 16] uint32 layout (module docstring)."""
    depth, columns = codes.shape
    nibbles = (codes.astype("int32") + ZERO_POINT).astype("uint32").reshape(depth // ROWS_PER_WORD, 4, 2, columns)
    words = np.zeros((depth // ROWS_PER_WORD, columns), "uint32")
    for pair in range(4):
        for half in range(2):
            words |= nibbles[:, pair, half, :] << np.uint32(16 * half + 4 * pair)
    return np.ascontiguousarray(words.reshape(depth // ROWS_PER_WORD, columns // COLUMNS, COLUMNS).transpose(1, 0, 2))


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """The [K, N] int4 codes (int8) `pack_int4` packed."""
    blocks, words, lanes = packed.shape
    by_row = packed.transpose(1, 0, 2).reshape(words, blocks * lanes)
    nibbles = np.stack([np.stack([(by_row >> np.uint32(16 * half + 4 * pair)) & 15 for half in range(2)], axis=1)
                        for pair in range(4)], axis=1)
    return (nibbles.reshape(words * ROWS_PER_WORD, blocks * lanes).astype("int32") - ZERO_POINT).astype("int8")


def nibble_shift(row):
    """The bit offset of row `row`'s nibble inside its uint32 word (a TIR or Python integer)."""
    return row % 2 * 16 + row % ROWS_PER_WORD // 2 * 4


def reference_kernel(spec: PackedSpec) -> tvm.tirx.PrimFunc:
    """The unscheduled PrimFunc (data, packed, scales) -> out computing `spec` in fp32, marked with SPEC_ATTR."""
    data = te.placeholder((spec.rows, spec.depth), spec.data_dtype, "data")
    packed = te.placeholder(spec.packed_shape, "uint32", "packed")
    scales = te.placeholder(spec.scales_shape, "float32", "scales")
    k = te.reduce_axis((0, spec.depth), "k")

    def weight(row, col):
        word = packed[col // COLUMNS, row // ROWS_PER_WORD, col % COLUMNS]
        code = (word >> nibble_shift(row).astype("uint32")) & tvm.tirx.const(15, "uint32")
        return (code.astype("float32") - float(ZERO_POINT)) * scales[row // spec.group_size, col]

    acc = te.compute((spec.rows, spec.columns),
                     lambda i, j: te.sum(data[i, k].astype("float32") * weight(k, j), axis=k), name="acc")
    out = te.compute(acc.shape, lambda i, j: acc[i, j].astype(spec.out_dtype), name="out")
    func = te.create_prim_func([data, packed, scales, out]).without_attr("global_symbol")
    return func.with_attrs({SPEC_ATTR: json.dumps(asdict(spec)), "op_pattern": OPAQUE_PATTERN})


def unpackable(call: relax.Call, group_size: int) -> str | None:
    """Why a matmul cannot take packed int4 weights, or None when it can."""
    data, weight = call.args[:2]
    shape = tensor_shape(weight)
    if not isinstance(weight, tvm.ir.expr.Constant) or tensor_dtype(weight) not in MODEL_FLOAT_DTYPES or len(shape) != 2:
        return "its second operand is not a 2-D floating-point constant"
    if tensor_dtype(data) not in MODEL_FLOAT_DTYPES or tensor_shape(data) is None:
        return "its input is not a floating-point tensor of known rank"
    if not all(isinstance(d, int) for d in tensor_shape(data)):
        return "its input has a dynamic shape"
    depth, columns = shape
    if depth % group_size or columns % COLUMNS:
        return f"its weight {depth}x{columns} is not in groups of {group_size} rows and blocks of {COLUMNS} columns"
    return None


@relax.expr_functor.mutator
class _PackWeights(relax.PyExprMutator):
    """Replaces the chosen matmuls with reference-kernel calls on packed constants."""

    def __init__(self, mod: tvm.IRModule, chosen: set[relax.Call], group_size: int):
        super().__init__(mod)
        self.chosen = chosen
        self.group_size = group_size

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if call not in self.chosen:
            return new_call
        data, weight = new_call.args[:2]
        *batch, depth = tensor_shape(data)
        columns = tensor_shape(weight)[1]
        out_dtype = tensor_dtype(call)
        codes, scales, group_size = held_codes(weight.value.numpy(), self.group_size)
        spec = PackedSpec(int(np.prod(batch, dtype="int64")), depth, columns, group_size, tensor_dtype(data),
                          out_dtype)
        gvar = self.builder_.add_func(reference_kernel(spec), "relay_amp_int4_matmul")
        rows = self.builder_.emit(relax.op.reshape(data, (spec.rows, depth)))
        product = self.builder_.emit(relax.call_tir(
            gvar, [rows, relax.const(pack_int4(codes)), relax.const(scales)],
            relax.TensorType((spec.rows, columns), out_dtype)))
        return relax.op.reshape(product, (*batch, columns))


@tvm.transform.module_pass(opt_level=0, name="relay_amp.QuantizeWeights")
class QuantizeWeights:
    """Pass form of `quantize_weights`, for use inside tvm.transform.Sequential."""

    def __init__(self, dtype: str = "int4", *, group_size: int = DEFAULT_GROUP_SIZE,
                 ops: Iterable[str] = WEIGHT_OPS, excluded_layers: Iterable[int | str] | None = None,
                 func: str = "main"):
        if dtype not in WEIGHT_DTYPES:
            raise DTypeError(f"weight-only quantization packs {list(WEIGHT_DTYPES)} weights, not {dtype!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 \
                or group_size % ROWS_PER_WORD:
            raise OptionError(f"group_size must be a positive multiple of {ROWS_PER_WORD}, got {group_size!r}")
        self.ops = canonical_ops(ops)
        for op in self.ops:
            if op not in WEIGHT_OPS:
                raise OptionError(f"weight-only int4 packs the weights of {list(WEIGHT_OPS)}, not {op}")
        self.group_size = group_size
        self.excluded = list(excluded_layers or ())
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        excluded = resolve_layers(list_layers(mod, self.ops, self.func), self.excluded)
        chosen = {b.value for i, b in enumerate(layer_bindings(mod, self.ops, self.func))
                  if i not in excluded and unpackable(b.value, self.group_size) is None}
        return rewrite_function(_PackWeights(mod, chosen, self.group_size), mod, self.func)


def quantize_weights(mod: tvm.IRModule, dtype: str = "int4", *, group_size: int = DEFAULT_GROUP_SIZE,
                     ops: Iterable[str] = WEIGHT_OPS, excluded_layers: Iterable[int | str] | None = None,
                     func: str = "main") -> tvm.IRModule:
    """Matmuls with constant [K, N] weights (K in groups of `group_size`, N in blocks of 16) read int4 weights,
    packed, with per-group scales (a weight quantized elsewhere in smaller groups keeps them: held_codes);
    activations and outputs keep their dtypes (run AMP first for bf16)."""
    return QuantizeWeights(dtype, group_size=group_size, ops=ops, excluded_layers=excluded_layers, func=func)(mod)
