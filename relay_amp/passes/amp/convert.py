"""ToMixedPrecision: per-call AMP for float16 and bfloat16 with op lists, exclusions and a precision plan."""

from collections.abc import Iterable

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..._ir import (
    cast_constant,
    get_function,
    has_attr_field,
    tensor_dtype,
    with_attr,
)
from ...dtypes import FLOAT_DTYPES, LOW_FLOAT_DTYPES, can_cast_offline, check_choice, is_float
from ...errors import LayerIndexError
from ...ops import call_op_name
from ..casts import EliminateRedundantCasts
from ..layers import (
    DEFAULT_LAYER_OPS,
    layer_bindings,
    list_layers,
    op_bindings,
    resolve_layers,
)
from ..ranges import DEFAULT_MARGIN, FINITE_MAX, RangeStats, range_excluded
from .plan import PlanEntry, PrecisionPlan, attach_plan
from .positions import routing_scores, sampling_positions
from .policy import (
    build_conditions,
    build_lists,
    check_missing_op_mode,
    unlisted_op_error,
)

_ASTYPE = "relax.astype"
# ops that only move a tensor's values: one applied to a constant is a constant to AMP (exporters reshape a
# convolution's bias to broadcast over NCHW; a non-constant fp32 operand would keep the bias add in fp32)
_DATA_MOVES = ("relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze", "relax.broadcast_to")


# calls into a PrimFunc or a packed function (an importer's TE fallback, a hand-written kernel): the callee's
# signature fixes every dtype, so their arguments keep theirs
FIXED_SIGNATURE_OPS = frozenset({"relax.call_tir", "relax.call_tir_inplace", "relax.call_tir_with_grad",
                                 "relax.call_dps_packed", "relax.call_pure_packed", "relax.call_inplace_packed"})
FIXED_SIGNATURE_REASON = "calls a PrimFunc or packed function: its signature fixes the dtypes"


def _float_leaves(args: Iterable[relax.Expr]) -> list[relax.Expr]:
    leaves = []
    for arg in args:
        leaves.extend(_float_leaves(arg.fields) if isinstance(arg, relax.Tuple) else [arg])
    return [leaf for leaf in leaves if is_float(tensor_dtype(leaf) or "")]


def _moved_constants(func: relax.Function) -> dict:
    """The vars of `func` bound to a data move of a constant (through any number of moves), and that constant."""
    found: dict[relax.Var, relax.Constant] = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            if call_op_name(binding.value) in _DATA_MOVES:
                source = binding.value.args[0]
                source = found.get(source, source) if isinstance(source, relax.Var) else source
                if isinstance(source, tvm.ir.expr.Constant):
                    found[binding.var] = source
    return found


@relax.expr_functor.mutator
class _AmpMutator(relax.PyExprMutator):
    """Decides a dtype for every op call, in program order, and places the casts it needs."""

    def __init__(self, mod: tvm.IRModule, config: "ToMixedPrecision", names: dict, forced: dict, excluded: set):
        super().__init__(mod)
        self.config = config
        self.low = config.target_dtype
        self.names = names  # original call -> (op-call index, binding name)
        self.forced = forced  # original call -> (dtype, reason) from a plan or the range guard
        self.excluded = excluded
        self.moved = _moved_constants(get_function(mod, config.func))  # var -> the constant it holds, moved
        self.casts: dict[tuple[relax.Expr, str], relax.Expr] = {}
        self.entries: list[PlanEntry] = []
        self.accepts: dict[tuple, bool] = {}  # (op, attributes, operand types) -> whether TVM types it low

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        args = [self.visit_expr(arg) for arg in call.args]
        if isinstance(call.op, tvm.ir.Op) and call.op.name == _ASTYPE:  # a cast accepts any input dtype
            return relax.Call(call.op, args, call.attrs, call.ty_args)
        decision = self._decide(call, args) if isinstance(call.op, tvm.ir.Op) else None
        if decision is not None:
            self._record(call, *decision)
        if decision is None or decision[0] != self.low:  # function calls too keep their original signature
            restored = [self._restore(new, old) for new, old in zip(args, call.args)]
            return relax.Call(call.op, restored, call.attrs, call.ty_args)
        return self._lowered(call, [self._lower(arg) for arg in args])

    def _lowered(self, call: relax.Call, args: list[relax.Expr]) -> relax.Expr:
        attrs = call.attrs
        if has_attr_field(attrs, "out_dtype"):  # a sum accumulates wide; a follow op (a resize) yields the low dtype
            accumulates = self.config.lists.category(call.op.name) == "target"
            attrs = with_attr(attrs, out_dtype=self.config.accumulation_dtype if accumulates else self.low)
        new_call = self.builder_.normalize(relax.Call(call.op, args, attrs, call.ty_args))
        if tensor_dtype(new_call) in (None, self.low) or not is_float(tensor_dtype(new_call)):
            return new_call
        return self._cast(self.builder_.emit(new_call), self.low)

    def _decide(self, call: relax.Call, args: list[relax.Expr]) -> tuple[str, str] | None:
        original = tensor_dtype(call) or ""
        if not _float_leaves(args) and not is_float(original):
            return None
        fp32 = self._compute_dtype(call)
        if call.op.name in FIXED_SIGNATURE_OPS:
            return fp32, FIXED_SIGNATURE_REASON
        if call in self.forced:
            return self.forced[call]
        if call in self.excluded:
            return fp32, "excluded"
        for condition in self.config.conditions:
            if condition.matches(call):
                return fp32, f"conditional: {condition.attr} in {list(condition.values)}"
        return self._by_category(call, args, fp32)

    def _by_category(self, call: relax.Call, args: list[relax.Expr], fp32: str) -> tuple[str, str]:
        op = call.op.name
        category = self.config.lists.category(op)
        if category is None:
            if self.config.missing_op_mode == "error":
                raise unlisted_op_error(op)
            category = self.config.missing_op_mode
            reason = f"unlisted: {category}"
        else:
            reason = f"{category} list"
        if category == "fp32":
            return fp32, reason
        if category != "target":
            inputs = [self._is_low(leaf) for leaf in _float_leaves(args) if not self._is_flexible(leaf)]
            if not inputs or not (all(inputs) if category == "widest" else any(inputs)):
                return fp32, reason
        if not self._accepts_low(call):
            return fp32, f"TVM's type inference refuses {self.low} for it"
        return self.low, reason

    def _accepts_low(self, call: relax.Call) -> bool:
        """Whether TVM infers a type for `call` with its float operands in the target dtype (its prelu takes only
        float16 and float32), asked once per op, attributes and operand types (a transformer's layers repeat)."""
        key = (call.op.name, tvm_ffi.structural_hash(call.attrs), tuple(str(arg.ty) for arg in call.args))
        if key not in self.accepts:
            operands = [self._low_placeholder(arg) for arg in call.args]
            try:
                relax.BlockBuilder().normalize(relax.Call(call.op, operands, call.attrs, call.ty_args))
                self.accepts[key] = True
            except (TypeError, ValueError, tvm.error.DiagnosticError):  # how TVM reports a refused dtype
                self.accepts[key] = False
        return self.accepts[key]

    def _low_placeholder(self, arg: relax.Expr) -> relax.Expr:
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([self._low_placeholder(field) for field in arg.fields])
        if not is_float(tensor_dtype(arg) or ""):
            return arg
        return relax.Var("operand", relax.TensorType(arg.ty.shape, self.low))

    def _compute_dtype(self, call: relax.Call) -> str:
        dtypes = [tensor_dtype(leaf) for leaf in _float_leaves(call.args)] + [tensor_dtype(call)]
        return max((d for d in dtypes if d in FLOAT_DTYPES), key=FLOAT_DTYPES.index, default="float32")

    def _is_low(self, expr: relax.Expr) -> bool:
        return tensor_dtype(expr) == self.low

    def _is_flexible(self, expr: relax.Expr) -> bool:
        """A constant (or a data move of one) that fits the target dtype's range never forces fp32."""
        expr = self.moved.get(expr, expr) if isinstance(expr, relax.Var) else expr
        if not isinstance(expr, tvm.ir.expr.Constant):
            return False
        values = expr.value.numpy().astype("float64")
        return values.size == 0 or float(np.abs(values).max()) <= FINITE_MAX[self.low]

    def _record(self, call: relax.Call, dtype: str, reason: str) -> None:
        if call in self.names:
            index, name = self.names[call]
            self.entries.append(PlanEntry(index, call.op.name, name, dtype, reason))

    def _lower(self, arg: relax.Expr) -> relax.Expr:
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([self._lower(field) for field in arg.fields])
        dtype = tensor_dtype(arg)
        return self._cast(arg, self.low) if dtype and is_float(dtype) else arg

    def _restore(self, new: relax.Expr, old: relax.Expr) -> relax.Expr:
        if isinstance(new, relax.Tuple):
            return relax.Tuple([self._restore(n, o) for n, o in zip(new.fields, old.fields)])
        dtype = tensor_dtype(old)
        return self._cast(new, dtype) if dtype and tensor_dtype(new) != dtype else new

    def _cast(self, expr: relax.Expr, dtype: str) -> relax.Expr:
        key = (expr, dtype)
        if key not in self.casts:
            self.casts[key] = self._new_cast(expr, dtype)
            if isinstance(self.casts[key], relax.Var):
                self.casts[(self.casts[key], tensor_dtype(expr))] = expr
        return self.casts[key]

    def _new_cast(self, expr: relax.Expr, dtype: str) -> relax.Expr:
        if isinstance(expr, tvm.ir.expr.Constant) and self.config.cast_params_offline and can_cast_offline(dtype):
            return cast_constant(expr, dtype)
        return self.builder_.emit(relax.op.astype(expr, dtype))


def _tuple_items(result: relax.Var) -> list[relax.Var]:
    """A var for each field of the tuple `result` holds (a function returning a var bound to a tuple: an LLM's logits
    and present keys and values)."""
    return [relax.Var(f"item{index}", field) for index, field in enumerate(result.ty.fields)]


def _output_casts(result: relax.Expr, dtype_of) -> tuple[list[relax.VarBinding], relax.Expr]:
    """Bindings that cast each float tensor of `result` (a tuple's, or a tuple var's, fields included) to
    dtype_of(its dtype), and the new result."""
    if isinstance(result, relax.Tuple) or isinstance(result.ty, relax.TupleType):
        items = result.fields if isinstance(result, relax.Tuple) else _tuple_items(result)
        bindings = [] if isinstance(result, relax.Tuple) else [relax.VarBinding(item, relax.TupleGetItem(result, index))
                                                              for index, item in enumerate(items)]
        fields = []
        for item in items:
            more, field = _output_casts(item, dtype_of)
            bindings += more
            fields.append(field)
        return bindings, relax.Tuple(fields)
    dtype = tensor_dtype(result)
    if not dtype or not is_float(dtype):
        return [], result
    out = relax.Var("out", relax.TensorType(result.ty.shape, dtype_of(dtype)))
    return [relax.VarBinding(out, relax.op.astype(result, dtype_of(dtype)))], out


def _pin_io(func: relax.Function, low: str, keep_io_types: bool) -> relax.Function:
    """Add casts at the function's boundary so that AMP keeps (or lowers) its input and output dtypes, in the
    dataflow block (a backend's fusion then joins an output's cast to the function computing the output)."""
    params, prologue = [], []
    for param in func.params:
        dtype = tensor_dtype(param)
        if keep_io_types or dtype != "float32":
            params.append(param)
            continue
        lowered = relax.Var(param.name, relax.TensorType(param.ty.shape, low))
        params.append(lowered)
        prologue.append(relax.VarBinding(param, relax.op.astype(lowered, dtype)))
    target = (lambda d: d) if keep_io_types else (lambda d: low if d == "float32" else d)
    epilogue, result = _output_casts(func.body.body, target)
    blocks = ([relax.BindingBlock(prologue)] if prologue else []) + list(func.body.blocks)
    body = relax.BlockBuilder().normalize(relax.SeqExpr(blocks + [relax.BindingBlock(epilogue)], result))
    pinned = relax.Function(params, body, None, func.is_pure, func.attrs)
    return relax.transform.ConvertToDataflow(min_size=1)(tvm.IRModule({"pinned": pinned}))["pinned"]


@tvm.transform.module_pass(opt_level=0, name="relay_amp.ToMixedPrecision")
class ToMixedPrecision:
    """Pass form of `to_mixed_precision`; the plan is stored on the output module."""

    def __init__(self, target_dtype: str = "bfloat16", *, target_dtype_ops=None, fp32_ops=None,
                 widest_dtype_ops=None, follow_ops=None, conditional_fp32_ops=None, excluded_layers=None,
                 keep_io_types: bool = True, cast_params_offline: bool = True,
                 accumulation_dtype: str = "float32", missing_op_mode: str = "follow",
                 layer_ops: Iterable[str] = DEFAULT_LAYER_OPS, plan: PrecisionPlan | None = None,
                 ranges: RangeStats | None = None, range_margin: float = DEFAULT_MARGIN, func: str = "main"):
        self.target_dtype = check_choice(target_dtype, LOW_FLOAT_DTYPES, "target_dtype")
        overrides = {"target": target_dtype_ops, "fp32": fp32_ops, "widest": widest_dtype_ops, "follow": follow_ops}
        self.lists = build_lists(self.target_dtype, overrides)
        self.conditions = build_conditions(conditional_fp32_ops)
        self.excluded_layers = list(excluded_layers or ())
        self.keep_io_types = bool(keep_io_types)
        self.cast_params_offline = bool(cast_params_offline)
        self.accumulation_dtype = check_choice(
            accumulation_dtype, ("float32", self.target_dtype), "accumulation_dtype")
        self.missing_op_mode = check_missing_op_mode(missing_op_mode)
        self.layer_ops = tuple(layer_ops)
        self.plan = plan
        self.ranges = ranges
        self.range_margin = float(range_margin)
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        func = get_function(mod, self.func)
        bindings = op_bindings(mod, self.func)
        calls = [b.value for b in bindings]
        names = {b.value: (i, b.var.name) for i, b in enumerate(bindings)}
        chosen = resolve_layers(list_layers(mod, self.layer_ops, self.func), self.excluded_layers)
        layer_calls = layer_bindings(mod, self.layer_ops, self.func)
        forced = (sampling_positions(func, self.lists) | routing_scores(func, self.lists) | self._range_guard(mod)
                  | self._forced(calls))
        mutator = _AmpMutator(mod, self, names, forced, {layer_calls[i].value for i in chosen})
        gvar = mod.get_global_var(self.func)
        mutator.builder_.update_func(gvar, mutator.visit_expr(_pin_io(func, self.target_dtype, self.keep_io_types)))
        converted = EliminateRedundantCasts(self.cast_params_offline)(mutator.builder_.get())
        plan = PrecisionPlan(self.target_dtype, self.func, mutator.entries,
                             _count_casts(converted, self.func) - _count_casts(mod, self.func))
        return attach_plan(converted, plan)

    def _range_guard(self, mod: tvm.IRModule) -> dict[relax.Call, tuple[str, str]]:
        if self.ranges is None:
            return {}
        kept = range_excluded(mod, self.ranges, self.target_dtype, self.range_margin, self.func)
        return {call: ("float32", reason) for call, reason in kept.items()}

    def _forced(self, calls: list[relax.Call]) -> dict[relax.Call, tuple[str, str]]:
        if self.plan is None:
            return {}
        forced = {}
        for entry in self.plan.entries:
            if not 0 <= entry.index < len(calls) or calls[entry.index].op.name != entry.op:
                raise LayerIndexError(
                    f"plan entry {entry.index} ({entry.op} {entry.name!r}) does not match this module's op calls")
            dtype = self.target_dtype if entry.dtype in LOW_FLOAT_DTYPES else entry.dtype
            forced[calls[entry.index]] = (dtype, "plan")
        return forced


def _count_casts(mod: tvm.IRModule, func: str) -> int:
    return sum(b.value.op.name == _ASTYPE for b in op_bindings(mod, func))


def to_mixed_precision(mod: tvm.IRModule, target_dtype: str = "bfloat16", **options) -> tvm.IRModule:
    """Convert `mod` to mixed precision in `target_dtype`; options as ToMixedPrecision's."""
    return ToMixedPrecision(target_dtype, **options)(mod)


def apply_plan(mod: tvm.IRModule, plan: PrecisionPlan, **options) -> tvm.IRModule:
    """Re-apply a saved (possibly hand-edited) plan to the same model or a new export of it."""
    return ToMixedPrecision(plan.target_dtype, plan=plan, func=plan.func, **options)(mod)
