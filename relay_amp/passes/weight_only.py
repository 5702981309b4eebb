"""Weight-only int4: matmuls against constant weights keep their activations and read int4 weights, packed.

Each weight becomes packed 4-bit codes with fp32 scales per group of `group_size` rows and output column
(relay_amp.packed_int4's layout), and the matmul a `call_tir` of the reference PrimFunc that unpacks the codes as
it multiplies. Codes are symmetric, `q = clip(round(w / s), -8, 7)` with `s = -w_max / 8` over the group (w_max:
its value of largest magnitude), stored as `q + 8` (a nibble). A weight a file held packed (an imported
MatMulNBits: a call of a dequantization PrimFunc on constants, perhaps cast by AMP) keeps its own codes, scales
and zero points. `dense_weights` turns such calls that no int4 matmul took into constants.
"""

from collections.abc import Callable, Iterable

import numpy as np
import tvm
from tvm import relax

from .._dead_code import EliminateDeadCode
from .._expert_matmuls import expert_matmuls_dense
from .._ir import rewrite_function, tensor_dtype, tensor_shape
from ..dtypes import MODEL_FLOAT_DTYPES, is_float
from ..errors import DTypeError, OptionError
from ..ops import bound_value, call_op_name, canonical_ops
from ..packed_int4 import (CODE_MAX, COLUMNS, ROWS_PER_WORD, ZERO_POINT, PackedSpec, PackedWeight, pack_int4,
                           packed_weight, reference_kernel, weight_spec_of)
from .amp.lists import default_lists
from .amp.positions import routing_scores
from .layers import layer_bindings, list_layers, resolve_layers

WEIGHT_DTYPES = ("int4",)
WEIGHT_OPS = ("relax.matmul",)
DEFAULT_GROUP_SIZE = 128
HELD_GROUP_MIN = 16  # the smallest group size held_codes tries
HELD_STEP_FRACTION = 16  # a weight its codes hold is within this fraction of a step (bf16 rounding: a 32nd)


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


def held_weight(mod: tvm.IRModule, lookup: Callable, weight: relax.Expr) -> "PackedWeight | None":
    """The PackedWeight a matmul's weight dequantizes where a file held it packed: a call of a dequantization
    PrimFunc on constants, or a float cast of one (AMP's); `lookup` maps a var to the value bound to it."""
    value = lookup(weight)
    if call_op_name(value) == "relax.astype" and is_float(value.attrs.dtype):
        value = lookup(value.args[0])
    return packed_weight(mod, value)


def unpackable(call: relax.Call, group_size: int, held: "PackedWeight | None" = None) -> str | None:
    """Why a matmul cannot take packed int4 weights, or None when it can (`held`: the weight a file held packed)."""
    data, weight = call.args[:2]
    shape = tensor_shape(weight)
    if held is None and (not isinstance(weight, tvm.ir.expr.Constant)
                         or tensor_dtype(weight) not in MODEL_FLOAT_DTYPES or len(shape) != 2):
        return "its second operand is not a 2-D floating-point constant"
    if tensor_dtype(data) not in MODEL_FLOAT_DTYPES or tensor_shape(data) is None:
        return "its input is not a floating-point tensor of known rank"
    if not all(isinstance(d, int) for d in tensor_shape(data)):
        return "its input has a dynamic shape"
    depth, columns = shape
    if held is None and (depth % group_size or columns % COLUMNS):
        return f"its weight {depth}x{columns} is not in groups of {group_size} rows and blocks of {COLUMNS} columns"
    return None


def router_matmuls(func: relax.Function) -> "set[relax.Call]":
    """The router GEMMs of `func`'s mixture-of-experts layers, whose scores a top-k chooses from, which weight-only
    int4 leaves in floats: int4's rounding of near scores sends tokens to other experts (as bf16's did before AMP
    kept routers in fp32), and the GEMM is too small for its weight's bytes to matter."""
    routers = routing_scores(func, default_lists("bfloat16"))
    return {call for call in routers if call_op_name(call) == "relax.matmul"}


def _binding_lookup(func: relax.Function) -> Callable:
    """A lookup from each var `func` binds to its value (anything else to itself)."""
    values = {binding.var: binding.value for block in func.body.blocks for binding in block.bindings}
    return lambda expr: values.get(expr, expr)


@relax.expr_functor.mutator
class _PackWeights(relax.PyExprMutator):
    """Replaces the chosen matmuls with reference-kernel calls on packed constants: a weight's own codes where a file
    held it packed, else its codes quantized here."""

    def __init__(self, mod: tvm.IRModule, chosen: "dict[relax.Call, PackedWeight | None]", group_size: int):
        super().__init__(mod)
        self.chosen = chosen  # each chosen matmul and the weight a file held packed for it (None: quantize here)
        self.group_size = group_size

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if call not in self.chosen:
            return new_call
        data, weight = new_call.args[:2]
        *batch, depth = tensor_shape(data)
        held = self.chosen[call]
        if held is None:
            codes, scales, group_size = held_codes(weight.value.numpy(), self.group_size)
            held = PackedWeight(pack_int4(codes), scales)
        shifted = held.zeros is not None
        spec = PackedSpec(int(np.prod(batch, dtype="int64")), depth, held.spec.columns, held.spec.group_size,
                          tensor_dtype(data), "float32" if shifted else tensor_dtype(call))
        gvar = self.builder_.add_func(reference_kernel(spec), "relay_amp_int4_matmul")
        rows = self.builder_.emit(relax.op.reshape(data, (spec.rows, depth)))
        product = self.builder_.emit(relax.call_tir(
            gvar, [rows, relax.const(held.packed), relax.const(held.scales)],
            relax.TensorType((spec.rows, spec.columns), spec.out_dtype)))
        if shifted:
            product = self.builder_.emit(relax.op.astype(relax.op.add(
                product, self._zero_point_shift(rows, held)), tensor_dtype(call)))
        return relax.op.reshape(product, (*batch, spec.columns))

    def _zero_point_shift(self, rows: relax.Expr, held: PackedWeight) -> relax.Expr:
        """What the weight's zero points add to a symmetric reading of its codes: each row's activation sums per
        group times zero_point_shift, in fp32."""
        count, depth = tensor_shape(rows)
        size = held.spec.group_size
        wide = self.builder_.emit(relax.op.astype(rows, "float32"))
        groups = self.builder_.emit(relax.op.reshape(wide, (count, depth // size, size)))
        sums = self.builder_.emit(relax.op.sum(groups, axis=[2]))
        return self.builder_.emit(relax.op.matmul(sums, relax.const(held.zero_point_shift())))


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
        mod = expert_matmuls_dense(mod, self.func, fewer_rows=True)  # a decode step's experts: packed as a prompt's
        excluded = resolve_layers(list_layers(mod, self.ops, self.func), self.excluded)
        lookup = _binding_lookup(mod[self.func])
        routers = router_matmuls(mod[self.func])
        candidates = {b.value: held_weight(mod, lookup, b.value.args[1])
                      for i, b in enumerate(layer_bindings(mod, self.ops, self.func))
                      if i not in excluded and b.value not in routers}
        chosen = {call: held for call, held in candidates.items()
                  if unpackable(call, self.group_size, held) is None}
        return _unread_dropped(rewrite_function(_PackWeights(mod, chosen, self.group_size), mod, self.func))


def quantize_weights(mod: tvm.IRModule, dtype: str = "int4", *, group_size: int = DEFAULT_GROUP_SIZE,
                     ops: Iterable[str] = WEIGHT_OPS, excluded_layers: Iterable[int | str] | None = None,
                     func: str = "main") -> tvm.IRModule:
    """Matmuls with constant [K, N] weights (K in groups of `group_size`, N in blocks of 16) read int4 weights,
    packed, with per-group scales (a weight quantized elsewhere in smaller groups keeps them: held_codes; one a file
    held packed keeps its codes, scales and zero points); activations and outputs keep their dtypes (run AMP first
    for bf16). A mixture-of-experts layer's product by every expert is packed too (a decode step's gathered experts
    first written so), which the CPU backend computes only for the routed rows, on the codes; router GEMMs keep
    their float weights."""
    return QuantizeWeights(dtype, group_size=group_size, ops=ops, excluded_layers=excluded_layers, func=func)(mod)


@relax.expr_functor.mutator
class _DenseWeights(relax.PyExprMutator):
    """Float casts of held packed weights (AMP's) as constants of the cast's dtype; with `all_calls`, the remaining
    dequantization calls as fp32 constants."""

    def __init__(self, mod: tvm.IRModule, all_calls: bool):
        super().__init__(mod)
        self.mod = mod
        self.all_calls = all_calls

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if self.all_calls:
            held = packed_weight(self.mod, new_call)
            return new_call if held is None else relax.const(held.dense())
        if call_op_name(new_call) != "relax.astype" or not is_float(new_call.attrs.dtype):
            return new_call
        held = packed_weight(self.mod, bound_value(self, new_call.args[0]))
        return new_call if held is None else relax.const(held.dense(new_call.attrs.dtype))


def dense_weights(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with every held packed weight (a file's int4 weights: calls of a dequantization PrimFunc on constants)
    a dense constant, computed one weight at a time in the dtype a cast of it asks for; unchanged where it holds
    none."""
    if not any(weight_spec_of(func) for func in mod.functions.values()):
        return mod
    for all_calls in (False, True):  # casts first: a weight read only in bf16 is never held in fp32
        updated = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                updated[gvar] = _DenseWeights(mod, all_calls).visit_expr(func)
        mod = _unread_dropped(updated)
    return mod


def _unread_dropped(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` without the bindings and PrimFuncs nothing reads (held weights' calls and their dequantization
    PrimFuncs, once their matmuls take them otherwise)."""
    entries = [gvar.name_hint for gvar, func in mod.functions_items() if isinstance(func, relax.Function)]
    return EliminateDeadCode(entries)(mod)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.DenseWeights")
class DenseWeights:
    """`dense_weights` as a pass (every backend runs it first)."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return dense_weights(mod)
