"""Constant folding in one build: every value a Relax function's dataflow computes from constants alone, evaluated
by one compiled module.

TVM's FoldConstant legalizes every call of a dataflow block and compiles each op of constants with LLVM apart
(about 0.05 s each): 11 of a MixNet-S build's 20 s, 22 of importing BiT-R50's 33 s (a weight standardization per
conv). `fold_constants` gathers the same computations (ops with a legalization, call_tir) into one function without
parameters, compiles it once without fusion-level folding, runs it, and puts the results in place of the values
other calls read. Constants bound to vars are inlined into their readers and bindings left unused are removed, as
FoldConstant does. Where the one build fails (a computation that does not build or run on the host), TVM's
FoldConstant folds the module op by op, skipping what fails, as it always did. A file's packed int4 weights (calls
of relay_amp.packed_int4's dequantization PrimFunc) are not folded: they stay packed until a backend needs them.
"""

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

from ._bodies import with_function
from ._dead_code import remove_all_unused
from .dtypes import can_cast_offline
from .ops import call_op_name
from .packed_int4 import weight_spec_of

CALL_TIR = "relax.call_tir"
RUNTIME_OPS = ("relax.shape_to_tensor",)  # no legalization: the VM runs it as a builtin


def fold_constants(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with every computation of constants in its Relax functions' dataflow blocks folded (one build for
    all of a function's), constants inlined into their readers, unused bindings removed."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and (func.attrs is None or "Primitive" not in func.attrs):
            mod = _fold_function(mod, gv)
    return mod


@tvm.transform.module_pass(opt_level=0, name="relay_amp.FoldConstants")
def FoldConstants(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 (a pass, named as TVM's are)
    """`fold_constants` as a pass: relax.transform.FoldConstant's result with one build per function."""
    return fold_constants(mod)


def _fold_function(mod: tvm.IRModule, gv: relax.GlobalVar) -> tvm.IRModule:
    func = mod[gv]
    bindings, known = _constant_bindings(mod, func)
    wanted = [var for var in _read_elsewhere(func, bindings) if var not in known]
    try:
        known.update(_evaluate(mod, bindings, wanted))
    except RuntimeError:  # TVM's errors: a computation that does not build or run on the host, as one function
        return relax.transform.FoldConstant()(mod)  # op by op, skipping those that fail
    if not known:
        return mod
    return with_function(mod, gv, remove_all_unused(_Inliner(known).visit_expr(func)))


def _constant_bindings(mod: tvm.IRModule, func: relax.Function) -> tuple[list, dict]:
    """The dataflow bindings whose values are constants or computed from constants alone, in order, and
    {var: value} for the vars bound to a constant or a static shape outright."""
    bindings, known, constant = [], {}, set()
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            continue
        for binding in block.bindings:
            outright = _outright_constant(binding.value)
            if outright is not None:
                known[binding.var] = outright
            elif not (_foldable(mod, binding.value, constant) and _static_tensors(binding.var.ty)):
                continue
            bindings.append(binding)
            constant.add(binding.var)
    return bindings, known


def _outright_constant(value: relax.Expr) -> "relax.Expr | None":
    """A tensor constant, or a static shape (a ShapeExpr, the shape_of a static tensor), else None."""
    if isinstance(value, tvm.ir.expr.GenericConst):  # a tensor
        return value
    if call_op_name(value) == "relax.shape_of" and _static_tensors(value.args[0].ty):
        value = relax.ShapeExpr(value.args[0].ty.shape.values)
    if isinstance(value, relax.ShapeExpr) and _static(value.values):
        return value
    return None


def _foldable(mod: tvm.IRModule, value: relax.Expr, constant: set) -> bool:
    """Whether `value` computes from constants alone with a legalized op, a PrimFunc, or a tuple access."""
    if isinstance(value, relax.TupleGetItem):
        return value.tuple_value in constant
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return False
    if value.op.name == CALL_TIR:
        callee = value.args[0]
        prim_func = isinstance(callee, relax.GlobalVar) and isinstance(mod[callee], tvm.tirx.PrimFunc)
        held = prim_func and weight_spec_of(mod[callee]) is not None  # a file's packed weight: kept packed
        return prim_func and not held and _all_constant(value.args[1], constant)
    legalized = value.op.get_attr("FLegalize") is not None or value.op.name in RUNTIME_OPS
    return legalized and all(_all_constant(arg, constant) for arg in value.args)


def _all_constant(expr: relax.Expr, constant: set) -> bool:
    if isinstance(expr, relax.Tuple):
        return all(_all_constant(field, constant) for field in expr.fields)
    if isinstance(expr, relax.ShapeExpr):
        return _static(expr.values)
    return isinstance(expr, tvm.ir.expr.Constant) or (isinstance(expr, relax.Var) and expr in constant)


def _static(dims) -> bool:
    return all(isinstance(dim, tvm.tirx.IntImm) for dim in dims)


def _static_tensors(ty) -> bool:
    """Whether a value of type `ty` is a tensor (or a tuple of them) of static shape, storable as a constant."""
    if isinstance(ty, relax.TupleType):
        return all(_static_tensors(field) for field in ty.fields)
    return (isinstance(ty, relax.TensorType) and ty.shape is not None and can_cast_offline(str(ty.dtype))
            and _static(ty.shape.values))


def _read_elsewhere(func: relax.Function, bindings: list) -> list:
    """The tensor vars `bindings` bind that another binding, or the function's result, reads."""
    inside = {binding.var for binding in bindings}
    read = {}  # the vars in order of first read (a dict: a membership test in constant time, not one per var read)

    def note(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Var) and expr in inside and expr not in read \
                and isinstance(expr.ty, relax.TensorType):
            read[expr] = None

    for block in func.body.blocks:
        for binding in block.bindings:
            if binding.var not in inside:
                relax.analysis.post_order_visit(binding.value, note)
    relax.analysis.post_order_visit(func.body.body, note)
    return list(read)


def _evaluate(mod: tvm.IRModule, bindings: list, wanted: list) -> dict:
    """{var: Constant} for each of `wanted`, computed by running `bindings` as one compiled function."""
    if not wanted:
        return {}
    result = relax.Var("folded", relax.TupleType([var.ty for var in wanted]))
    body = relax.DataflowBlock([*bindings, relax.VarBinding(result, relax.Tuple(wanted))])
    evaluate = relax.Function([], relax.SeqExpr([body], result), result.ty).with_attr("global_symbol", "main")
    called = {binding.value.args[0] for binding in bindings if call_op_name(binding.value) == CALL_TIR}
    prim_funcs = {gv: mod[gv] for gv in called}
    target = tvm.target.Target({"kind": "llvm", "opt-level": 0})  # run once: LLVM's optimizations cost more
    executable = tvm.compile(tvm.IRModule({**prim_funcs, relax.GlobalVar("main"): evaluate}), target=target,
                             relax_pipeline=_pipeline(target))
    outputs = relax.VirtualMachine(executable, tvm.cpu())["main"]()
    return {var: relax.const(outputs[i]) for i, var in enumerate(wanted)}


def _pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's CPU pipeline without its FoldConstant (which would compile each op of the function apart)."""
    return tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
        relax.transform.FuseTIR(), *cpu_generic.dataflow_lower_passes(target), *cpu_generic.finalize_passes(target),
    ])


@relax.expr_functor.mutator
class _Inliner(relax.PyExprMutator):
    """Reads of the vars in `values` replaced by their constants."""

    def __init__(self, values: dict):
        super().__init__()
        self.values = values

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        """The var's constant, if it has one."""
        return self.values.get(var, var)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        """The var's constant, if it has one."""
        return self.values.get(var, var)
