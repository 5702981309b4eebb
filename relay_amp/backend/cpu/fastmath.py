"""fastmath: vectorizable fp32 approximations of the transcendental ops, in every float dtype, for CPU builds.

LLVM compiles TVM's `erf`/`exp`/`tanh`/`sigmoid` to scalar libm calls, and in bfloat16 or float16 TVM computes
them op by op with a rounding step between each (10-30x slower than fp32 here), so a GELU, SiLU or softmax
decomposed by an exporter fell to a slow path. `FastMath` computes every such call in fp32 with polynomials
(relay_amp's `fast_exp`, TVM's `fast_erf` and `fast_tanh` with their quotients as relay_amp.backend.cpu.reciprocal's:
relay_amp.backend.cpu.formula) and casts the result back to the call's dtype: GELU (both forms), SiLU, sigmoid, erf,
tanh, exp and softmax become one fused-friendly TE function each; then TVM's own `FastMathTransform` takes what is
left of its ops. TVM has no fast log: `log` (Softplus, Mish, LogSigmoid as the importer writes them) becomes
relay_amp's polynomial (formula.fast_log, within an ulp), and `log_softmax` one TE function on the fast exp and
log. The approximations stay within about 1e-6 relative of the exact functions in fp32; an exp whose result is
rounded to bfloat16 or float16 takes a shorter polynomial (formula.narrow_exp, 7e-6).
"""

import tvm
from tvm import relax, te, topi
from tvm.relax import dpl

from ..._ir import call_te_once, get_function, read_counts, rewrite_function, tensor_dtype, tensor_shape
from ...dtypes import LOW_FLOAT_DTYPES, MODEL_FLOAT_DTYPES
from ...ops import call_op_name
from . import formula
from .formula import WIDE  # the only dtype TVM's fast_* functions are fast in

# the activations computed as one TE function each, by the formulas kernels' epilogues use (relay_amp.backend.cpu
# .formula; erf and tanh as TVM's fast_erf and fast_tanh compute them, their quotients on the reciprocal estimate)
ACTIVATIONS = ("relax.nn.gelu", "relax.nn.gelu_tanh", "relax.sigmoid", "relax.nn.silu", "relax.exp", "relax.log",
               "relax.sin", "relax.cos", "relax.erf", "relax.tanh")
# ops that compute each output element from the same element of their operands: a value read only by these, whose
# results are in turn rounded to a narrow float, is itself kept only as accurately as that float
ELEMENTWISE = (*formula.UNARY_OPS, *formula.BINARY_OPS, *ACTIVATIONS, "relax.astype", "relax.nn.relu", "relax.clip")


@relax.transform.function_pass(opt_level=0, name="relay_amp.SiluSpelledOut")
def silu_spelled_out(func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
    """x * sigmoid(x), the exporters' SiLU, as one nn.silu (computed x / (1 + e^-x): a multiply fewer than
    1 / (1 + e^-x) times x, and one rounding fewer), where the sigmoid has no other reader."""
    value = dpl.wildcard()
    gate = dpl.is_op("relax.sigmoid")(value)
    product = dpl.is_op("relax.multiply")(value, gate) | dpl.is_op("relax.multiply")(gate, value)
    bound_to = {binding.value: binding.var for block in func.body.blocks for binding in block.bindings}
    reads = read_counts(func)

    def rewrite(call: relax.Call, matched: dict) -> relax.Expr:
        gate_var = bound_to.get(matched[gate])
        return relax.op.nn.silu(matched[value]) if gate_var is not None and reads[gate_var] == 1 else call

    return dpl.rewrite_call(product, rewrite, func)


def _in_fp32(op_name: str, narrow: bool):
    """A TE function computing the activation `op_name` in fp32 with the fast polynomials, returning the input's
    dtype; its exps only as accurate as a bf16/fp16 result needs where `narrow` (formula.narrowed)."""
    made = formula.activation(op_name, formula.X, fast=True)
    return _widened(lambda wide: formula.compute(formula.narrowed(made) if narrow else made, wide))


def _softmax_in_fp32(axis: int, narrow: bool):
    """A TE function computing softmax over `axis` in fp32 (formula.fast_softmax: with the exp a narrow float result
    needs where `narrow`), returning the input's dtype."""
    return _widened(lambda wide: formula.fast_softmax(wide, axis, narrow))


def _masked_softmax_in_fp32(axis: int, narrow: bool):
    """A TE function computing formula.fast_softmax(x + mask, axis, narrow) in fp32 (the mask broadcast over x),
    returning x's dtype."""
    return _widened(lambda wide, mask: formula.fast_softmax(topi.add(wide, mask), axis, narrow))


def _log_softmax_in_fp32(axis: int):
    """A TE function computing log_softmax over `axis` in fp32 as x - max - log(sum(e^(x - max))) with the fast
    exp and log, returning the input's dtype (TVM's log_softmax calls libm's exp and log: 1.35 ms over
    64x112x112 rows of 112, against 0.2 ms for softmax)."""
    def compute(wide: te.Tensor) -> te.Tensor:
        shifted = topi.subtract(wide, topi.max(wide, axis=axis, keepdims=True))
        total = topi.sum(formula.PRIMITIVES["fast_exp"](shifted), axis=axis, keepdims=True)
        return topi.subtract(shifted, formula.PRIMITIVES["fast_log"](total))
    return _widened(compute)


def _widened(compute_wide):
    """A TE function applying `compute_wide` to its inputs cast to fp32, its result cast back to the first input's
    dtype."""
    def compute(x: te.Tensor, *others: te.Tensor) -> te.Tensor:
        wide = [tensor if tensor.dtype == WIDE else topi.cast(tensor, WIDE) for tensor in (x, *others)]
        result = compute_wide(*wide)
        return result if x.dtype == WIDE else topi.cast(result, x.dtype)
    return compute


def rounded_values(func: relax.Function) -> set[relax.Var]:
    """The vars of `func` whose value is rounded to bfloat16 or float16 before anything needs it: every reader casts
    it to one, tests it for NaN (which a rounding keeps), or is an elementwise op, a where or a slice whose result is
    in turn such a var (an exported attention's softmax, guarded against NaN, sliced back from padded rows and
    cast)."""
    read_otherwise: set[relax.Var] = set()
    rounded: set[relax.Var] = set()
    relax.analysis.post_order_visit(func.body.body, lambda expr: _collect_var(read_otherwise, expr))
    for binding in reversed([b for block in func.body.blocks for b in block.bindings]):
        operands = _op_operands(binding.value)
        keeps_rounding = _rounds(binding.value) or call_op_name(binding.value) == "relax.isnan" or (
            _passes_rounding(binding.value) and binding.var in rounded - read_otherwise)
        (rounded if keeps_rounding else read_otherwise).update(operands)
        relax.analysis.post_order_visit(
            binding.value, lambda expr: expr in operands or _collect_var(read_otherwise, expr))
    return rounded - read_otherwise


def _op_operands(value: relax.Expr) -> set[relax.Var]:
    """The vars a call of an op reads directly (none for anything else)."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return set()
    return {arg for arg in value.args if isinstance(arg, relax.Var)}


def _is_elementwise(value: relax.Expr) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in ELEMENTWISE


def _passes_rounding(value: relax.Expr) -> bool:
    """Whether `value` computes each element from its operands' elements alone: an elementwise op, a where, a
    slice."""
    return _is_elementwise(value) or call_op_name(value) in ("relax.where", "relax.strided_slice")


def _rounds(value: relax.Expr) -> bool:
    """Whether `value` is a cast to a narrow float."""
    return _is_elementwise(value) and value.op.name == "relax.astype" and tensor_dtype(value) in LOW_FLOAT_DTYPES


def _collect_var(found: set, expr: relax.Expr) -> None:
    if isinstance(expr, relax.Var):
        found.add(expr)


@relax.expr_functor.mutator
class _FastMathRewriter(relax.PyExprMutator):
    """Replaces GELU, SiLU and sigmoid by fast fp32 TE functions (their exps only as accurate as the narrow float
    their result is rounded to, where it is), widens low-precision erf/exp/tanh and turns small constant powers into
    multiplies."""

    def __init__(self, mod: tvm.IRModule, func: str):
        super().__init__(mod)
        function = get_function(mod, func)
        self.rounded = rounded_values(function)
        self.reads, self.values = read_counts(function), relax.analysis.get_var2val(function)
        self.bound: relax.Var | None = None
        self.te_calls: dict = {}  # call_te_once's calls, one per TE function and argument types

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.bound = binding.var
        super().visit_var_binding_(binding)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if not isinstance(new_call.op, tvm.ir.Op):
            return new_call
        if new_call.op.name == "relax.power":
            return self._small_power(new_call)
        if len(new_call.args) != 1:
            return new_call
        name, dtype = new_call.op.name, tensor_dtype(new_call.args[0])
        if dtype not in MODEL_FLOAT_DTYPES:
            return new_call
        narrow = dtype in LOW_FLOAT_DTYPES or self.bound in self.rounded
        masked = self._masked_softmax(call, new_call, narrow) if name == "relax.nn.softmax" else None
        if masked is not None:
            return masked
        if name == "relax.nn.softmax":
            axis = int(new_call.attrs.axis)
            return self._call_te((name, axis, narrow), _softmax_in_fp32(axis, narrow), new_call.args[0],
                                 primfunc_name_hint="fast_softmax")
        if name == "relax.nn.log_softmax":
            axis = int(new_call.attrs.axis)
            return self._call_te((name, axis), _log_softmax_in_fp32(axis), new_call.args[0],
                                 primfunc_name_hint="fast_log_softmax")
        if name in ACTIVATIONS:
            hint = "fast_" + name.rpartition(".")[2]
            return self._call_te((name, narrow), _in_fp32(name, narrow), new_call.args[0], primfunc_name_hint=hint)
        return new_call

    def _masked_softmax(self, call: relax.Call, new_call: relax.Call, narrow: bool) -> "relax.Expr | None":
        """softmax(x + mask) with a mask that broadcasts over x (attention's padding or causal mask, a position
        bias shared by the heads), added by nothing else, as one TE function: the sum was a pass of its own over the
        scores (BERT at 512 tokens: 0.33 ms a layer, 3% of a bf16 run); else None."""
        scores = call.args[0]
        if call_op_name(self.values.get(scores)) != "relax.add" or self.reads.get(scores) != 1:
            return None
        added = self.lookup_binding(new_call.args[0])
        if call_op_name(added) != "relax.add":
            return None
        first, second = added.args
        wide, mask = (first, second) if tensor_shape(first) == tensor_shape(added) else (second, first)
        if tensor_shape(wide) != tensor_shape(added) or tensor_shape(mask) == tensor_shape(added) or (
                tensor_dtype(wide) != tensor_dtype(mask)):
            return None
        axis = int(new_call.attrs.axis)
        return self._call_te(("masked_softmax", axis, narrow), _masked_softmax_in_fp32(axis, narrow), wide, mask,
                             primfunc_name_hint="fast_softmax")

    def _call_te(self, key, te_func, *args: relax.Expr, **kwargs) -> relax.Call:
        """call_te_once in this rewrite's builder: `key` names what `te_func` computes."""
        return call_te_once(self.builder_, self.te_calls, key, te_func, *args, **kwargs)

    def _small_power(self, call: relax.Call) -> relax.Expr:
        """A power by a constant multiple of 1/4 up to 4 as multiplies and square roots (formula.root_power): LLVM
        calls libm's scalar pow for every element (1.5 ms for a 64x3072 cube against 0.07 ms multiplied; a local
        response norm's 0.75 over 112x112x32: 1.1 ms)."""
        base, exponent = call.args
        if tensor_dtype(base) not in MODEL_FLOAT_DTYPES:
            return call
        power = formula.root_power(base, formula.scalar(exponent), relax.op.multiply,
                                   lambda x: self.builder_.emit(relax.op.sqrt(x)))
        return call if power is None else power


@tvm.transform.module_pass(opt_level=0, name="relay_amp.FastMath")
class FastMath:
    """Rewrite GELU, SiLU, sigmoid, erf, exp, tanh, log, softmax and log_softmax into vectorizable fp32
    approximations (relay_amp's exp and log, TVM's erf and tanh on fast quotients), and
    powers by constant multiples of 1/4 up to 4 (2, 3, 0.5, a local response norm's 0.75) into multiplies and
    square roots."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        spelled = silu_spelled_out(mod)
        return relax.transform.FastMathTransform()(rewrite_function(_FastMathRewriter(spelled, self.func), spelled,
                                                                    self.func))
