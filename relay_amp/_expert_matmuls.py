"""Matmuls of a constant weight stack gathered by runtime row indices as one matmul by every weight and a take.

A mixture-of-experts layer exported with transformers' `batched_mm` experts (the one implementation torch.export and
the ONNX exporters take: `grouped_mm` calls transformers' own grouped matmul, `eager` loops over data-dependent token
sets) gathers, for each of its S routed rows, that row's expert weight out of the (E, N, K) stack, then multiplies
each row by its own copy: S weight matrices copied and read once each, by a matmul of two runtime operands (a
Mixtral-style decoder of 4 layers, 8 experts of 512 -> 1024, top 2, over 64 tokens: 328 ms in fp32 on a 2-core
Zen 4, 444 ms in bf16). Where the rows are at least as many as the experts (a prompt), the rows are multiplied by
all E weights at once, one (S, K) x (K, E * N) matmul by a constant the kernels pack, and each row's N outputs of
its own expert are taken out of the products: each weight read once, for E times the products (the CPU backend
computes only the taken rows' products, grouped by expert: relay_amp.backend.cpu.experts). Rows that repeat each
token once per routed expert (the up projection's) are multiplied once per token. Fewer rows than experts (a decode
step) keep the gather, which reads fewer weights.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from ._bodies import with_function
from ._dead_code import remove_all_unused
from ._ir import calls_any_op, get_function, is_static_shape, read_counts, rewrite_op_calls, tensor_shape
from .ops import call_op_name

GATHER_ND = "relax.gather_nd"
TAKE = "relax.take"
GATHERS = (GATHER_ND, TAKE)
BROADCAST = "relax.broadcast_to"
RESHAPE, CAST, MATMUL = "relax.reshape", "relax.astype", "relax.matmul"
RESHAPING = ("relax.reshape", "relax.expand_dims", "relax.squeeze", BROADCAST)  # ops a row's values pass unchanged


def expert_matmuls_dense(mod: tvm.IRModule, func: str = "main", fewer_rows: bool = False) -> tvm.IRModule:
    """`mod` with each matmul of one row (or column) per gathered expert weight, where the rows are at least as many
    as the experts (or, `fewer_rows`, any), as a matmul by all the experts' weights and a gather of each row's
    expert."""
    get_function(mod, func)  # a ModuleError naming the functions the module has, where it has no `func`
    if not calls_any_op(mod, GATHERS):
        return mod
    dense = []

    def counted(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
        rewritten = _dense(call, builder, fewer_rows)
        if rewritten is not None:
            dense.append(call)
        return rewritten

    rewritten = rewrite_op_calls(mod, func, {"relax.matmul": counted})
    return with_function(rewritten, func, remove_all_unused(get_function(rewritten, func))) if dense else mod


def _dense(call: relax.Call, builder: relax.BlockBuilder, fewer_rows: bool) -> "relax.Expr | None":
    gathered = gathered_experts(call, builder)
    if gathered is None or (gathered.rows < gathered.stack.shape[0] and not fewer_rows):
        return None
    return _all_experts(builder, gathered)


@dataclass(frozen=True)
class GatheredExperts:
    """A matmul of expert weights gathered per row: the constant (E, A, B) stack, the (rows, 1) or (rows,) expert
    index, the rows, the (rows, A, 1) column or (rows, 1, B) row each weight multiplies, and whether the weight is
    the matmul's first operand (columns) or its second (rows)."""
    stack: np.ndarray
    index: relax.Expr
    rows: int
    vector: relax.Expr
    weight_first: bool

    @property
    def depth(self) -> int:
        """The products' reduction length (K)."""
        return self.stack.shape[2] if self.weight_first else self.stack.shape[1]

    @property
    def width(self) -> int:
        """Each row's outputs (N)."""
        return self.stack.shape[1] if self.weight_first else self.stack.shape[2]

    def every_weight(self) -> np.ndarray:
        """Every expert's weight side by side, (K, E * N): expert e's output n in column e * N + n."""
        columns = self.stack.transpose(2, 0, 1) if self.weight_first else self.stack.transpose(1, 0, 2)
        return np.ascontiguousarray(columns.reshape(self.depth, self.stack.shape[0] * self.width))

    def flat_index(self) -> relax.Expr:
        """Each row's expert as an int64 vector of the rows."""
        return relax.op.astype(relax.op.reshape(self.index, [self.rows]), "int64")


def gathered_experts(call: relax.Call, builder) -> "GatheredExperts | None":
    """The matmul `call` as a product of gathered expert weights (one row or column per weight; `builder` a block
    builder or mutator that looks up bindings), or None."""
    left, right = call.args
    for gathered, vector, weight_first in ((left, right, True), (right, left, False)):
        picked = _gathered_stack(gathered, builder)
        if picked is not None and _one_per_row(vector, *picked, weight_first):
            return GatheredExperts(*picked, vector, weight_first)
    return None


def expert_products(func: relax.Function) -> "set[relax.Var]":
    """The vars of `func`'s matmuls whose rows only a take reads, in the dense form (`taken_product`)."""
    values = {binding.var: binding.value for block in func.body.blocks for binding in block.bindings}
    uses = read_counts(func)
    found = [taken_product(value, values.get, uses) for value in values.values() if call_op_name(value) == TAKE]
    return {var for var in found if var is not None}


def taken_product(take: relax.Call, lookup: Callable, uses: Mapping) -> "relax.Var | None":
    """The var of the matmul whose rows `take` reads as the dense form writes them (the (T, K) tokens times a
    constant (K, E * N) weight, cast or not, reshaped to (T * E, N), rows taken along axis 0 by a vector of
    indices), nothing but the take reading the product; else None. `lookup` gives a var's bound value (or None),
    `uses` how often each var is read."""
    table, _ = take.args
    if not takes_rows(take):
        return None
    product = _only_read(table, RESHAPE, lookup, uses)
    uncast = _only_read(product, CAST, lookup, uses)
    source = product if uncast is None else uncast
    matmul = lookup(source) if _only_read(source, MATMUL, lookup, uses) is not None else None
    if matmul is None or not isinstance(matmul.args[1], tvm.ir.expr.Constant):
        return None
    data, weight, table_shape = tensor_shape(matmul.args[0]), tensor_shape(matmul.args[1]), tensor_shape(table)
    if not all(is_static_shape(shape) and len(shape) == 2 for shape in (data, weight, table_shape)):
        return None
    (tokens, depth), (rows, columns) = data, table_shape
    return source if tokens and rows % tokens == 0 and weight == (depth, rows // tokens * columns) else None


def takes_rows(take: relax.Call) -> bool:
    """Whether `take` reads whole rows (axis 0) by a vector of indices."""
    return take.attrs.axis is not None and int(take.attrs.axis) == 0 and len(tensor_shape(take.args[1]) or ()) == 1


def bound_once(expr: "relax.Expr | None", lookup: Callable, uses: Mapping) -> "relax.Call | None":
    """The call the var `expr` is bound to (`lookup` gives a var's bound value), where `uses` counts it read once;
    else None."""
    if not isinstance(expr, relax.Var) or uses.get(expr, 0) != 1:
        return None
    bound = lookup(expr)
    return bound if isinstance(bound, relax.Call) else None


def _only_read(expr: "relax.Expr | None", op_name: str, lookup: Callable, uses: Mapping) -> "relax.Expr | None":
    """The first argument of the call of `op_name` the var `expr` is bound to, where `expr` is read once; else
    None."""
    bound = bound_once(expr, lookup, uses)
    return bound.args[0] if call_op_name(bound) == op_name else None


def _gathered_stack(expr: relax.Expr, builder) -> "tuple[np.ndarray, relax.Expr, int] | None":
    """(the constant (E, A, B) weight stack, the expert index of each row, the rows) of a gather of whole weights."""
    bound = builder.lookup_binding(expr) if isinstance(expr, relax.Var) else None
    if call_op_name(bound) not in GATHERS:
        return None
    stack, index = bound.args[0], bound.args[1]
    if not isinstance(stack, tvm.ir.expr.Constant) or len(tensor_shape(stack) or ()) != 3:
        return None
    rows = tensor_shape(index) or ()
    if bound.op.name == GATHER_ND and int(bound.attrs.batch_dims) == 0 and len(rows) == 2 and rows[1] == 1:
        return stack.value.numpy(), index, int(rows[0])
    if bound.op.name == TAKE and bound.attrs.axis is not None and int(bound.attrs.axis) == 0 and len(rows) == 1:
        return stack.value.numpy(), index, int(rows[0])
    return None


def _one_per_row(vector: relax.Expr, stack: np.ndarray, index: relax.Expr, rows: int, weight_first: bool) -> bool:
    """Whether `vector` is one column (S, A, 1) for weights (E, B, A) first, or one row (S, 1, B) for weights
    (E, B, A) second."""
    wanted = (rows, stack.shape[2], 1) if weight_first else (rows, 1, stack.shape[1])
    return tuple(tensor_shape(vector) or ()) == wanted


def _all_experts(builder: relax.BlockBuilder, gathered: GatheredExperts) -> relax.Expr:
    """Each distinct row times every expert's weight in one matmul, then each row's own expert's outputs."""
    experts, rows, width = gathered.stack.shape[0], gathered.rows, gathered.width
    distinct, repeats = _distinct_rows(gathered.vector, rows, gathered.depth, builder)
    every = builder.emit(relax.op.matmul(distinct, relax.const(gathered.every_weight())))
    first_output = relax.const(np.arange(rows) // repeats * experts, "int64")  # row s's outputs for expert 0
    own = relax.op.add(first_output, gathered.flat_index())
    picked = builder.emit(relax.op.take(relax.op.reshape(every, [rows // repeats * experts, width]), own, axis=0))
    return relax.op.reshape(picked, [rows, width, 1] if gathered.weight_first else [rows, 1, width])


def _distinct_rows(vector: relax.Expr, rows: int, depth: int, builder: relax.BlockBuilder) -> tuple:
    """(the T distinct rows (T, depth), K) where `vector`'s S rows are each of them repeated K times in turn (a token
    routed to K experts: expand_dims, broadcast_to, reshape); else (the rows as (S, depth), 1)."""
    source = vector
    while isinstance(source, relax.Var):
        bound = builder.lookup_binding(source)
        if call_op_name(bound) not in RESHAPING:
            break
        source = bound.args[0]
        if bound.op.name == BROADCAST:
            repeated, shape = tensor_shape(source), tensor_shape(bound)
            if len(shape) == 3 and tuple(repeated) == (shape[0], 1, depth) and shape[0] * shape[1] == rows:
                return relax.op.reshape(source, [shape[0], depth]), int(shape[1])
            break
    return relax.op.reshape(vector, [rows, depth]), 1
