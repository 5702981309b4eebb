"""Packed int4 weights: the layout, the reference PrimFuncs, and weights held packed in a module.

TVM 0.27 cannot hold a sub-byte tensor, so no int4 tensor ever appears: a [K, N] weight is a `uint32` constant of
packed 4-bit codes (nibbles 0..15) with an fp32 scale per group of `group_size` rows and column, and optionally an
fp32 zero point per group and column; the weight is (nibble - zero point) x scale, the zero point 8 when there
are none (symmetric codes). This is ONNX Runtime's MatMulNBits convention, so its files' codes are used as they are.

Packed layout, `[N / 16, K / 8, 16]` uint32: 16 consecutive columns, then 8 consecutive rows per 32-bit word;
nibble j of the low half holds row 2j, nibble j of the high half row 2j + 1. This is the order the CPU kernel
(relay_amp.backend.cpu.int4) unpacks with two vector operations per four rows.

Two reference PrimFuncs, plain TIR any backend can run: the int4 matmul (marked with `SPEC_ATTR`, so a backend can
swap in its own kernel for the same spec), and the weight's dequantization (marked with `WEIGHT_ATTR`): an imported
file's int4 weights are held as a call of it on their packed constants (`PackedWeight.call`), which constant
folding leaves alone, so a module holds the file's bytes rather than fp32 weights until a backend (or
`quantize_weights`, which takes the codes as they are) needs them.
"""

import json
from dataclasses import asdict, dataclass

import numpy as np
import tvm
from tvm import relax, te

from . import _ir  # a module: relay_amp._ir imports the folding that imports this
from .dtypes import cast_array

SPEC_ATTR = "relay_amp.int4_matmul"  # on the matmul's reference PrimFunc: its PackedSpec as JSON
WEIGHT_ATTR = "relay_amp.int4_weight"  # on a dequantization PrimFunc: its WeightSpec as JSON
COLUMNS = 16  # columns per packed block
ROWS_PER_WORD = 8  # rows of one column in a uint32
ZERO_POINT = 8  # the zero point of symmetric codes: q is stored as q + 8
CODE_MAX = 7
DENSE_CHUNK_BLOCKS = 64  # 16-column blocks dequantized at once on the host (an LLM's output projection is large)


@dataclass(frozen=True)
class WeightSpec:
    """A packed [depth, columns] int4 weight with one scale (and zero point, if `zero_points`) per `group_size`
    rows and column."""

    depth: int
    columns: int
    group_size: int
    zero_points: bool = False

    @property
    def packed_shape(self) -> tuple[int, int, int]:
        """The shape of the packed uint32 weight."""
        return self.columns // COLUMNS, self.depth // ROWS_PER_WORD, COLUMNS

    @property
    def scales_shape(self) -> tuple[int, int]:
        """The shape of the fp32 scales (and zero points): one per group of rows and column."""
        return self.depth // self.group_size, self.columns


@dataclass(frozen=True)
class PackedSpec:
    """One weight-only int4 matmul: [rows, depth] activations of `data_dtype` times a packed [depth, columns]
    weight of symmetric codes with one scale per `group_size` rows and column, stored as `out_dtype`."""

    rows: int
    depth: int
    columns: int
    group_size: int
    data_dtype: str
    out_dtype: str

    @property
    def weight(self) -> WeightSpec:
        """The spec of the packed weight."""
        return WeightSpec(self.depth, self.columns, self.group_size)

    @property
    def packed_shape(self) -> tuple[int, int, int]:
        """The shape of the packed uint32 weight."""
        return self.weight.packed_shape

    @property
    def scales_shape(self) -> tuple[int, int]:
        """The shape of the fp32 scales."""
        return self.weight.scales_shape


def spec_of(func) -> PackedSpec | None:
    """The PackedSpec a matmul's reference PrimFunc carries under SPEC_ATTR, None for any other function."""
    found = _attr_json(func, SPEC_ATTR)
    return None if found is None else PackedSpec(**found)


def weight_spec_of(func) -> WeightSpec | None:
    """The WeightSpec a dequantization PrimFunc carries under WEIGHT_ATTR, None for any other function."""
    found = _attr_json(func, WEIGHT_ATTR)
    return None if found is None else WeightSpec(**found)


def _attr_json(func, attr: str) -> dict | None:
    if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None or attr not in func.attrs:
        return None
    return json.loads(str(func.attrs[attr]))


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """[K, N] int4 codes in [-8, 7] packed into the [N / 16, K / 8, 16] uint32 layout (module docstring)."""
    return pack_nibbles((codes.astype("int16") + ZERO_POINT).astype("uint8"))


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """[K, N] nibbles in [0, 15] (any unsigned dtype) packed into the [N / 16, K / 8, 16] uint32 layout."""
    depth, columns = nibbles.shape
    by_word = nibbles.reshape(depth // ROWS_PER_WORD, 4, 2, columns)
    words = np.zeros((depth // ROWS_PER_WORD, columns), "uint32")
    for pair in range(4):
        for half in range(2):
            words |= by_word[:, pair, half, :].astype("uint32") << np.uint32(16 * half + 4 * pair)
    return np.ascontiguousarray(words.reshape(depth // ROWS_PER_WORD, columns // COLUMNS, COLUMNS).transpose(1, 0, 2))


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """The [K, N] nibbles (uint8, 0..15) `pack_nibbles` packed."""
    blocks, words, lanes = packed.shape
    by_row = packed.transpose(1, 0, 2).reshape(words, blocks * lanes)
    nibbles = np.empty((words, 4, 2, blocks * lanes), "uint8")
    for pair in range(4):
        for half in range(2):
            nibbles[:, pair, half] = (by_row >> np.uint32(16 * half + 4 * pair)) & np.uint32(15)
    return nibbles.reshape(words * ROWS_PER_WORD, blocks * lanes)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """The [K, N] int4 codes (int8) `pack_int4` packed."""
    return (unpack_nibbles(packed).astype("int8") - ZERO_POINT).astype("int8")


def nibble_shift(row):
    """The bit offset of row `row`'s nibble inside its uint32 word (a TIR or Python integer)."""
    return row % 2 * 16 + row % ROWS_PER_WORD // 2 * 4


def _weight_compute(spec: WeightSpec, packed, scales, zeros=None):
    """A TE function (row, col) -> the fp32 weight the packed operands hold."""

    def weight(row, col):
        word = packed[col // COLUMNS, row // ROWS_PER_WORD, col % COLUMNS]
        code = (word >> nibble_shift(row).astype("uint32")) & tvm.tirx.const(15, "uint32")
        point = zeros[row // spec.group_size, col] if zeros is not None else float(ZERO_POINT)
        return (code.astype("float32") - point) * scales[row // spec.group_size, col]

    return weight


def _weight_operands(spec: WeightSpec) -> list[te.Tensor]:
    operands = [te.placeholder(spec.packed_shape, "uint32", "packed"),
                te.placeholder(spec.scales_shape, "float32", "scales")]
    return operands + ([te.placeholder(spec.scales_shape, "float32", "zeros")] if spec.zero_points else [])


def reference_kernel(spec: PackedSpec) -> tvm.tirx.PrimFunc:
    """The unscheduled PrimFunc (data, packed, scales) -> out computing `spec` in fp32, marked with SPEC_ATTR."""
    data = te.placeholder((spec.rows, spec.depth), spec.data_dtype, "data")
    operands = _weight_operands(spec.weight)
    weight = _weight_compute(spec.weight, *operands)
    k = te.reduce_axis((0, spec.depth), "k")
    acc = te.compute((spec.rows, spec.columns),
                     lambda i, j: te.sum(data[i, k].astype("float32") * weight(k, j), axis=k), name="acc")
    out = te.compute(acc.shape, lambda i, j: acc[i, j].astype(spec.out_dtype), name="out")
    func = te.create_prim_func([data, *operands, out]).without_attr("global_symbol")
    return func.with_attrs({SPEC_ATTR: json.dumps(asdict(spec)), "op_pattern": _ir.OPAQUE_PATTERN})


def dequantize_kernel(spec: WeightSpec) -> tvm.tirx.PrimFunc:
    """The PrimFunc (packed, scales[, zeros]) -> the [depth, columns] fp32 weight, marked with WEIGHT_ATTR."""
    operands = _weight_operands(spec)
    weight = _weight_compute(spec, *operands)
    out = te.compute((spec.depth, spec.columns), weight, name="weight")
    func = te.create_prim_func([*operands, out]).without_attr("global_symbol")
    return func.with_attrs({WEIGHT_ATTR: json.dumps(asdict(spec)), "op_pattern": _ir.OPAQUE_PATTERN})


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A [depth, columns] weight as packed nibbles, fp32 scales and (None for symmetric codes) fp32 zero points."""

    packed: np.ndarray
    scales: np.ndarray
    zeros: "np.ndarray | None" = None

    @property
    def spec(self) -> WeightSpec:
        """The weight's WeightSpec."""
        blocks, words, _ = self.packed.shape
        depth = words * ROWS_PER_WORD
        return WeightSpec(depth, blocks * COLUMNS, depth // self.scales.shape[0], self.zeros is not None)

    def operands(self) -> list[np.ndarray]:
        """The arrays a kernel takes after the activations: packed, scales[, zeros]."""
        return [self.packed, self.scales] + ([self.zeros] if self.zeros is not None else [])

    def dense(self, dtype: str = "float32") -> np.ndarray:
        """The [depth, columns] weight in fp32 (as the dequantization PrimFunc computes it), cast to `dtype`."""
        spec = self.spec
        out = np.empty((spec.depth, spec.columns), "float32")
        for first in range(0, self.packed.shape[0], DENSE_CHUNK_BLOCKS):
            columns = slice(first * COLUMNS, (first + DENSE_CHUNK_BLOCKS) * COLUMNS)
            codes = unpack_nibbles(self.packed[first:first + DENSE_CHUNK_BLOCKS]).astype("float32")
            groups = codes.reshape(spec.scales_shape[0], spec.group_size, -1)
            groups -= self.zeros[:, None, columns] if self.zeros is not None else np.float32(ZERO_POINT)
            groups *= self.scales[:, None, columns]
            out[:, columns] = codes
        return out if dtype == "float32" else cast_array(out, dtype)

    def zero_point_shift(self) -> np.ndarray:
        """(8 - zero point) x scale per group and column: what each activation of a group adds to a column beyond
        the weight's symmetric reading (nibble - 8) x scale."""
        return ((np.float32(ZERO_POINT) - self.zeros) * self.scales).astype("float32")

    def call(self, kernel: relax.GlobalVar) -> relax.Expr:
        """A normalized call of `kernel` (the module's dequantize_kernel(self.spec)) on the weight's constants."""
        spec = self.spec
        call = relax.call_tir(kernel, [relax.const(array) for array in self.operands()],
                              relax.TensorType((spec.depth, spec.columns), "float32"))
        return relax.BlockBuilder().normalize(call)


def with_dequantize_kernel(mod: tvm.IRModule, spec: WeightSpec) -> tuple[tvm.IRModule, relax.GlobalVar]:
    """`mod` with the dequantization PrimFunc of `spec` (added once per spec), and its GlobalVar."""
    builder = relax.BlockBuilder(mod)
    gvar = builder.add_func(dequantize_kernel(spec), "relay_amp_int4_weight")
    return builder.get(), gvar


def packed_weight(mod: tvm.IRModule, value: relax.Expr) -> "PackedWeight | None":
    """The PackedWeight `value` dequantizes, where it is a call of a dequantization PrimFunc on constants."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return None
    if weight_spec_of(_ir.called_prim_func(mod, value)) is None:
        return None
    args = value.args[1].fields
    if not all(isinstance(arg, tvm.ir.expr.Constant) for arg in args):
        return None
    return PackedWeight(*[arg.value.numpy() for arg in args])
