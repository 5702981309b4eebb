"""EliminateRedundantCasts: drop no-op casts, share duplicate casts, fold round trips (an exact one across
reshapes and transposes too) and constants (gathered ones too)."""

import tvm
from tvm import relax

from .._dead_code import EliminateDeadCode
from .._ir import cast_constant, read_counts, tensor_dtype
from ..dtypes import can_cast_offline, is_float, widens_exactly
from ..ops import call_op_name

_ASTYPE = "relax.astype"
_MOVES = ("relax.reshape", "relax.permute_dims")
_GATHERS = ("relax.take", "relax.gather_nd", "relax.gather_elements")  # ops that copy values of their first operand


@relax.expr_functor.mutator
class _CastSimplifier(relax.PyExprMutator):
    """Rewrites astype calls; the aliases it leaves are removed by CanonicalizeBindings."""

    def __init__(self, mod: tvm.IRModule, fold_constants: bool):
        super().__init__(mod)
        self.fold_constants = fold_constants
        self.seen: dict[tuple[relax.Expr, str], relax.Expr] = {}
        self.reads: dict[relax.Var, int] = {}  # of the function being rewritten

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if call_op_name(new_call) != _ASTYPE:
            return new_call
        source, dtype = new_call.args[0], str(new_call.attrs.dtype)
        simpler = self._simplify(source, dtype)
        if simpler is not None:
            return simpler
        key = (source, dtype)
        if key in self.seen:
            return self.seen[key]
        self.seen[key] = self.builder_.emit(new_call)
        return self.seen[key]

    def _simplify(self, source: relax.Expr, dtype: str) -> relax.Expr | None:
        if tensor_dtype(source) == dtype:
            return source
        if self.fold_constants and isinstance(source, tvm.ir.expr.Constant) and can_cast_offline(dtype):
            return cast_constant(source, dtype)
        gathered = self._gathered_constant(source, dtype)
        if gathered is not None:
            return gathered
        origin = self._cast_origin(source)
        if origin is not None and tensor_dtype(origin) == dtype and is_float(dtype) and is_float(tensor_dtype(source)):
            return origin
        return self._moved_origin(source, dtype)

    def _gathered_constant(self, source: relax.Expr, dtype: str) -> relax.Expr | None:
        """Where `source` is read only here and gathers values of a constant (a mixture of experts' weights gathered
        per routed row, an embedding's rows), the gather of the constant cast offline: a gather copies values, so the
        cast commutes, and the gather moves the narrower values."""
        bound = self.lookup_binding(source) if isinstance(source, relax.Var) else None
        if (not self.fold_constants or call_op_name(bound) not in _GATHERS or self.reads.get(source) != 1
                or not isinstance(bound.args[0], tvm.ir.expr.Constant) or not can_cast_offline(dtype)):
            return None
        return self.builder_.emit(relax.Call(bound.op, [cast_constant(bound.args[0], dtype), *bound.args[1:]],
                                             bound.attrs))

    def _moved_origin(self, source: relax.Expr, dtype: str) -> relax.Expr | None:
        """Where `source` is reshapes and transposes of a value widened from `dtype` (an input AMP widened, moved in
        fp32 before its cast back: Whisper's cross-attention keys), the moves applied to that value, exactly."""
        moves = []
        while isinstance(source, relax.Var) and call_op_name(bound := self.lookup_binding(source)) in _MOVES:
            moves.append(bound)
            source = bound.args[0]
        origin = self._cast_origin(source) if moves else None
        if (origin is None or tensor_dtype(origin) != dtype
                or not widens_exactly(tensor_dtype(origin), tensor_dtype(source))):
            return None
        for move in reversed(moves):
            origin = self.builder_.emit(relax.Call(move.op, [origin, *move.args[1:]], move.attrs))
        return origin

    def _cast_origin(self, expr: relax.Expr) -> relax.Expr | None:
        """The input of the astype that `expr` is bound to, if it is bound to one."""
        bound = expr
        while isinstance(bound, relax.Var):
            bound = self.lookup_binding(bound)
        return bound.args[0] if call_op_name(bound) == _ASTYPE else None


@tvm.transform.module_pass(opt_level=0, name="relay_amp.EliminateRedundantCasts")
class EliminateRedundantCasts:
    """Remove same-dtype casts, merge duplicate casts, fold float round trips and casts of constants."""

    def __init__(self, fold_constants: bool = True):
        self.fold_constants = fold_constants

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        simplifier = _CastSimplifier(mod, self.fold_constants)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                simplifier.reads = read_counts(func)
                simplifier.builder_.update_func(gvar, simplifier.visit_expr(func))
        cleanup = tvm.transform.Sequential(
            [relax.transform.CanonicalizeBindings(), EliminateDeadCode()]
        )
        return cleanup(simplifier.builder_.get())


def eliminate_redundant_casts(mod: tvm.IRModule, fold_constants: bool = True) -> tvm.IRModule:
    """Functional form of EliminateRedundantCasts."""
    return EliminateRedundantCasts(fold_constants)(mod)
