"""HoistOverMoves: narrowing casts and ops by a scalar constant move before the reshapes and transposes they follow.

Attention splits a projection's output into heads (reshape, permute_dims), and only then does AMP's cast to
bf16 come, with the query's or key's scale: the projection stores fp32, the transposes move fp32, and the cast
is a function of its own. Both commute exactly with moves of data, so `HoistOverMoves` puts them first: the
kernel before them takes the cast and the scale into its epilogue (relay_amp.backend.cpu.epilogue), and the moves
carry half the bytes. Only narrowing casts and scalar ops move (a widening cast would make the moves carry
more), and only over a move that nothing else reads.
"""

import tvm
from tvm import relax

from .._ir import get_function, read_counts, rewrite_function, tensor_dtype, tensor_shape
from ..dtypes import MODEL_FLOAT_DTYPES, numpy_dtype
from ..ops import call_op_name

MOVES = ("relax.reshape", "relax.permute_dims")
SCALAR_OPS = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide")


def _narrowing_cast(call: relax.Call) -> bool:
    source, target = tensor_dtype(call.args[0]), tensor_dtype(call)
    return (source in MODEL_FLOAT_DTYPES and target in MODEL_FLOAT_DTYPES
            and numpy_dtype(target).itemsize < numpy_dtype(source).itemsize)


def _scalar_constant(expr: relax.Expr) -> bool:
    return isinstance(expr, tvm.ir.expr.Constant) and not tensor_shape(expr)


def _movable_operand(call: relax.Call) -> "int | None":
    """The index of the tensor operand `call` could take before a move, None where it cannot move."""
    name = call_op_name(call)
    if name == "relax.astype" and _narrowing_cast(call):
        return 0
    if name in SCALAR_OPS and len(call.args) == 2:
        first, second = (_scalar_constant(arg) for arg in call.args)
        if first != second:
            return 1 if first else 0
    return None


@relax.expr_functor.mutator
class _Hoister(relax.PyExprMutator):
    """Rebinds each movable op over a chain of single-use moves as the moves over the op."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        super().__init__(mod)
        self.uses = read_counts(func)
        self.value_of = {binding.var: binding.value for block in func.body.blocks for binding in block.bindings}
        self.changed = False

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        hoisted = self._hoisted(value) if isinstance(value, relax.Call) else None
        if hoisted is None:
            super().visit_var_binding_(binding)
            return
        self.changed = True
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(hoisted))

    def _hoisted(self, call: relax.Call) -> "relax.Expr | None":
        """`call` applied before the moves that produce its operand, or None where nothing moves."""
        index = _movable_operand(call)
        if index is None:
            return None
        moves, source = [], call.args[index]
        while isinstance(source, relax.Var) and self.uses.get(source, 0) == 1 and \
                call_op_name(self.value_of.get(source)) in MOVES:
            moves.append(self.value_of[source])
            source = moves[-1].args[0]
        if not moves:
            return None
        args = list(call.args)
        args[index] = self.visit_expr(source)
        result = relax.Call(call.op, args, call.attrs)
        for move in reversed(moves):
            result = relax.Call(move.op, [self.builder_.emit(result), *move.args[1:]], move.attrs)
        return result


@tvm.transform.module_pass(opt_level=0, name="relay_amp.HoistOverMoves")
class HoistOverMoves:
    """Move narrowing casts and ops by a scalar constant before the reshapes and transposes they follow."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod` (the moves left unread removed); the input module is left as it was."""
        hoisted = mod
        while True:  # an op moved over its moves can let the op after it move too
            hoister = _Hoister(hoisted, get_function(hoisted, self.func))
            rewritten = rewrite_function(hoister, hoisted, self.func)
            if not hoister.changed:
                return hoisted
            hoisted = relax.transform.DeadCodeElimination([self.func])(rewritten)


def hoist_over_moves(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """Functional form of HoistOverMoves."""
    return HoistOverMoves(func)(mod)
