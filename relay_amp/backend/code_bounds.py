"""code_bounds: the range of values a tensor can hold, read from the ops that computed it.

quantize writes activation codes as a clamp cast to uint8 (`astype(minimum(maximum(x, 0), 127), "uint8")` for
7-bit codes): the CPU backend's byte kernel (relay_amp.backend.cpu.kernels.AVX2_BYTE_DOT) takes data whose largest
code times its weights' pair sums fits vpmaddubsw's int16, and the CUDA backend packs operands whose values lie in
int4's range (relay_amp.backend.cuda.int4). `value_range` follows a value back through the ops that keep a range or
narrow it: moves, slices, splits, concatenations, max pools, ReLUs, pads (with their pad value), clips, minimums
and maximums, and casts (an integer cast of a range its dtype does not hold gives the dtype's whole range: wrapped
values are still in it). Anything else spans its dtype.
"""

import math

import numpy as np
import tvm
from tvm import relax

from .._ir import tensor_dtype
from ..dtypes import numpy_dtype
from ..ops import bound_value, call_op_name, tuple_fields
from ..passes.moves import CONCAT, MAX_POOLS, MOVES, SLICE, SPLIT

KEEPS_RANGE = frozenset((*MOVES, SLICE, *MAX_POOLS, "relax.expand_dims", "relax.squeeze"))
DEPTH = 64  # bindings followed back at most: a model's codes are a few ops from their clamp


def value_range(mutator, expr: relax.Expr, depth: int = DEPTH) -> tuple[float, float]:
    """(lowest, highest) value `expr` (a var bound in `mutator`'s builder, or a constant) can hold; an unknown
    side is its integer dtype's limit, or infinite."""
    value = bound_value(mutator, expr)
    if isinstance(value, tvm.ir.expr.Constant):
        values = value.value.numpy()
        return (float(values.min()), float(values.max())) if values.size else _dtype_range(expr)
    if depth == 0 or value is None:
        return _dtype_range(expr)
    if isinstance(value, relax.TupleGetItem):
        split = bound_value(mutator, value.tuple_value)
        return value_range(mutator, split.args[0], depth - 1) if call_op_name(split) == SPLIT else _dtype_range(expr)
    name = call_op_name(value)
    if name == CONCAT:
        fields = tuple_fields(mutator, value.args[0])
        if not fields:
            return _dtype_range(expr)
        ranges = [value_range(mutator, field, depth - 1) for field in fields]
        return min(low for low, _ in ranges), max(high for _, high in ranges)
    if name in KEEPS_RANGE:
        return value_range(mutator, value.args[0], depth - 1)
    if name in ("relax.astype", "relax.nn.relu", "relax.clip", "relax.nn.pad", "relax.minimum", "relax.maximum"):
        return _narrowed(mutator, value, name, depth)
    return _dtype_range(expr)


def _narrowed(mutator, call: relax.Call, name: str, depth: int) -> tuple[float, float]:
    """The range of a cast, ReLU, clip, pad, minimum or maximum, from its inputs'."""
    low, high = value_range(mutator, call.args[0], depth - 1)
    if name == "relax.astype":
        whole = _dtype_range(call)
        return (low, high) if whole[0] <= low and high <= whole[1] else whole
    if name == "relax.nn.relu":
        return max(low, 0.0), max(high, 0.0)
    if name == "relax.clip":
        floor, ceiling = float(call.args[1].value), float(call.args[2].value)
        return min(max(low, floor), ceiling), max(min(high, ceiling), floor)
    if name == "relax.nn.pad":
        return min(low, float(call.attrs.pad_value)), max(high, float(call.attrs.pad_value))
    other_low, other_high = value_range(mutator, call.args[1], depth - 1)
    pick = min if name == "relax.minimum" else max
    return pick(low, other_low), pick(high, other_high)


def _dtype_range(expr: relax.Expr) -> tuple[float, float]:
    """All values of `expr`'s dtype: an integer's limits, else infinite."""
    dtype = tensor_dtype(expr)
    if dtype is None or not dtype.startswith(("int", "uint")):
        return -math.inf, math.inf
    limits = np.iinfo(numpy_dtype(dtype))
    return float(limits.min), float(limits.max)
