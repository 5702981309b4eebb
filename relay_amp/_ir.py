"""Small Relax helpers shared by the passes: function lookup, dtypes of expressions, casts."""

import contextlib
import importlib
import inspect
import linecache
import math
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import tvm
from tvm import relax
from tvm.relax import dpl

from ._dead_code import EliminateDeadCode
from ._folding import FoldConstants
from .dtypes import can_cast_offline, cast_array
from .errors import ModuleError, OptionError
from .ops import call_op_name

OPAQUE_PATTERN = 8  # relax's kOpaque op pattern: operator fusion leaves a call of the function alone


def opaque_scheduled(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """`func` marked scheduled already and opaque to operator fusion: the default schedules and FuseOps leave it and
    its calls as they are."""
    return func.with_attrs({"tirx.is_scheduled": True, "op_pattern": OPAQUE_PATTERN})


def get_function(mod: tvm.IRModule, func: str) -> relax.Function:
    """The Relax function `func` of `mod`, or ModuleError naming what the module has."""
    if not isinstance(mod, tvm.IRModule):
        raise ModuleError(f"expected a tvm.IRModule, got {type(mod).__name__}")
    names = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
    if func not in names:
        raise ModuleError(f"the module has no Relax function {func!r} (it has: {sorted(names)})")
    return mod[func]


def rewrite_function(mutator: relax.PyExprMutator, mod: tvm.IRModule, func: str) -> tvm.IRModule:
    """`mod` with Relax function `func` replaced by `mutator`'s rewrite of it (the mutator was built on `mod`)."""
    function = get_function(mod, func)
    mutator.builder_.update_func(mod.get_global_var(func), mutator.visit_expr(function))
    return mutator.builder_.get()


def rewrite_each_function(mod: tvm.IRModule, mutator_for: Callable) -> tvm.IRModule:
    """`mod` with each Relax function rewritten by `mutator_for(module so far, function)`, then dead code removed."""
    rewritten = mod
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewritten = rewrite_function(mutator_for(rewritten, func), rewritten, gv.name_hint)
    return EliminateDeadCode()(rewritten)


@relax.expr_functor.mutator
class _OpCallRewriter(relax.PyExprMutator):
    """Replaces the calls of the ops in `rewrites` by their rewrites' results, where those are not None."""

    def __init__(self, mod: tvm.IRModule, rewrites: Mapping[str, Callable]):
        super().__init__(mod)
        self.rewrites = rewrites

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        rewrite = self.rewrites.get(new_call.op.name) if isinstance(new_call.op, tvm.ir.Op) else None
        rewritten = None if rewrite is None else rewrite(new_call, self.builder_)
        return new_call if rewritten is None else rewritten


def rewrite_op_calls(mod: tvm.IRModule, func: str, rewrites: Mapping[str, Callable]) -> tvm.IRModule:
    """`mod` with each call in Relax function `func` of an op named in `rewrites` (op name -> rewrite(call,
    block builder) -> the replacement, or None to keep the call) replaced."""
    return rewrite_function(_OpCallRewriter(mod, rewrites), mod, func)


def rewrite_te_calls(mod: tvm.IRModule, func: str, rewrite: Callable) -> tvm.IRModule:
    """`mod` with each call in Relax function `func` of a PrimFunc through call_tir (a TE function TVM's importer
    emitted) replaced by rewrite(call, prim_func) where that is not None; PrimFuncs left uncalled removed."""
    rewritten = rewrite_function(_TeCallRewriter(mod, rewrite), mod, func)
    return EliminateDeadCode([func])(rewritten)


@relax.expr_functor.mutator
class _TeCallRewriter(relax.PyExprMutator):
    """Replaces the call_tirs whose PrimFunc `rewrite` recognizes by its result."""

    def __init__(self, mod: tvm.IRModule, rewrite: Callable):
        super().__init__(mod)
        self.mod = mod
        self.rewrite = rewrite

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        prim_func = called_prim_func(self.mod, new_call)
        rewritten = None if prim_func is None else self.rewrite(new_call, prim_func)
        return new_call if rewritten is None else rewritten


def read_counts(func: relax.Function) -> dict[relax.Var, int]:
    """How many times each var is read in `func` (in binding values and the returned expression)."""
    return {var: len(readers) for var, readers in binding_readers(func).items()}


def binding_readers(func: relax.Function) -> "dict[relax.Var, list[relax.Binding | None]]":
    """The bindings of `func` that read each var, once per read; None for each read by the returned expression."""
    readers: dict[relax.Var, list] = {}

    def reads(binding: "relax.Binding | None"):
        return lambda expr: readers.setdefault(expr, []).append(binding) if isinstance(expr, relax.Var) else None

    for block in func.body.blocks:
        for binding in block.bindings:
            relax.analysis.post_order_visit(binding.value, reads(binding))
    relax.analysis.post_order_visit(func.body.body, reads(None))
    return readers


def call_te_once(builder: relax.BlockBuilder, known: dict, key, te_func: Callable, *args: relax.Expr,
                 **kwargs) -> relax.Call:
    """`builder.call_te(te_func, *args, **kwargs)`, or, where `known` holds such a call made with `key` (naming what
    `te_func` computes) on arguments of the same static types, a call of the PrimFunc that one added: an unrolled
    recurrence's thousands of sigmoids of one shape each built a TE function (1.3 ms apiece) that the builder then
    found equal to the first. Arguments of symbolic shape always take call_te."""
    types = tuple((tensor_shape(arg), tensor_dtype(arg)) for arg in args)
    if not all(is_static_shape(shape) for shape, _ in types):
        return builder.call_te(te_func, *args, **kwargs)
    first = known.get((key, types))
    if first is None:
        first = known[(key, types)] = builder.call_te(te_func, *args, **kwargs)
        return first
    return relax.call_tir(first.args[0], relax.Tuple(list(args)), list(first.ty_args))


def add_func_once(builder: relax.BlockBuilder, known: dict, key, make: Callable[[], tvm.tirx.PrimFunc],
                  name: str) -> relax.GlobalVar:
    """The GlobalVar `known` holds for `key`, else `make()`'s PrimFunc added to `builder` as `name` and recorded: a
    kernel built once per spec within a pass (an unrolled recurrence's thousand recurrent matmuls of one shape each
    built it, and the builder then found it equal to the first)."""
    gvar = known.get(key)
    if gvar is None:
        gvar = known[key] = builder.add_func(make(), name)
    return gvar


def tensor_dtype(expr: relax.Expr) -> str | None:
    """The dtype of a tensor-typed expression, None for anything else."""
    ty = expr.ty
    if isinstance(ty, relax.TensorType) and ty.dtype:
        return str(ty.dtype)
    return None


def tensor_shape(expr: relax.Expr) -> tuple | None:
    """The static shape of a tensor expression (symbolic dims as strings), None if unknown."""
    return type_shape(expr.ty)


def is_static_shape(shape: "tuple | None") -> bool:
    """Whether `shape` (as tensor_shape gives it) is known and every extent is an int."""
    return shape is not None and all(isinstance(extent, int) for extent in shape)


def is_scalar_constant(expr: relax.Expr) -> bool:
    """Whether `expr` is a constant of rank 0."""
    return isinstance(expr, tvm.ir.expr.Constant) and not tensor_shape(expr)


def type_shape(ty) -> tuple | None:
    """The static shape of a tensor type (symbolic dims as strings), None if unknown or not a tensor type."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = getattr(ty.shape, "values", None)
    if dims is None:
        return None
    return tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in dims)


def channel_values(values: np.ndarray, target: Sequence[int]) -> "np.ndarray | None":
    """A constant's `values` as one per index of `target`'s channel axis (its one axis past 1), where they broadcast
    to `target` (a per-channel constant, or one value for all channels); None where they do not."""
    if values.ndim > len(target) or any(extent not in (1, want) for extent, want in zip(values.shape[::-1],
                                                                                      target[::-1])):
        return None
    return np.broadcast_to(values.reshape((1,) * (len(target) - values.ndim) + values.shape), target).reshape(-1)


def depthwise_weight(call: relax.Call) -> "np.ndarray | None":
    """The constant weight (in its `kernel_layout`) of `call` where it is an NHWC conv2d with one output channel per
    input channel (a depthwise conv, no channel multiplier), else None."""
    if not isinstance(call, relax.Call) or getattr(call.op, "name", None) != "relax.nn.conv2d":
        return None
    attrs, weight, shape = call.attrs, call.args[1], tensor_shape(call.args[0])
    if (attrs.data_layout != "NHWC" or attrs.out_layout != "NHWC" or not isinstance(weight, tvm.ir.expr.Constant)
            or not shape or int(attrs.groups) != shape[3]):
        return None
    layout, values = str(attrs.kernel_layout), weight.value.numpy()
    return values if values.shape[layout.index("O")] == shape[3] and values.shape[layout.index("I")] == 1 else None


def slice_window(call: relax.Call) -> "tuple[list, list] | None":
    """A strided_slice's begin and end on every axis of its static input, where it takes unit steps within the
    bounds (as exporters' Split and Slice do), else None."""
    shape = tensor_shape(call.args[0])
    steps = call.args[4].fields if len(call.args) > 4 else []
    if not shape or not all(isinstance(extent, int) for extent in shape) or any(int(step) != 1 for step in steps):
        return None
    begin, end = [0] * len(shape), list(shape)
    for axis, start, stop in zip(*(arg.fields for arg in call.args[1:4])):
        axis, start, stop = int(axis) % len(shape), int(start), int(stop)
        if not 0 <= start < stop <= shape[axis]:
            return None
        begin[axis], end[axis] = start, stop
    return begin, end


def split_part_bounds(split: relax.Call) -> "list[tuple[int, int]] | None":
    """(begin, end) of each part of a split along its axis, from its parts' static extents (as many sections as
    parts, or indices: the parts' types say where TVM cuts); None where one is symbolic."""
    rank = len(tensor_shape(split.args[0]) or ())
    if not rank:
        return None
    axis = int(split.attrs.axis) % rank
    extents = [(type_shape(field) or [None] * rank)[axis] for field in split.ty.fields]
    if not all(isinstance(extent, int) for extent in extents):
        return None
    ends = [sum(extents[:i + 1]) for i in range(len(extents))]
    return [(end - extent, end) for end, extent in zip(ends, extents)]


def with_attr(attrs: tvm.ir.Attrs, **changes) -> tvm.ir.Attrs:
    """A copy of an attrs node with some fields replaced."""
    fields = type(attrs).__tvm_ffi_type_info__.fields
    values = {field.name: getattr(attrs, field.name) for field in fields}
    values.update(changes)
    return tvm.ir.make_node(attrs.__tvm_ffi_type_info__.type_key, **values)


def has_attr_field(attrs: tvm.ir.Attrs | None, name: str) -> bool:
    """Whether an attrs node has a field called `name`."""
    if attrs is None:
        return False
    return any(field.name == name for field in type(attrs).__tvm_ffi_type_info__.fields)


def cast_constant(const: tvm.ir.expr.Constant, dtype: str) -> tvm.ir.expr.Constant:
    """A new constant holding `const`'s values cast to `dtype` on the host."""
    return relax.const(cast_array(const.value.numpy(), dtype), dtype)


def vars_in(expr) -> list:
    """The variables a TIR expression reads."""
    return list(tvm.tirx.analysis.undefined_vars(expr))


def reads_var(expr, var) -> bool:
    """Whether the TIR expression `expr` reads `var`."""
    return any(used.same_as(var) for used in vars_in(expr))


def conjuncts(condition) -> list:
    """A TIR condition split at its ands."""
    if isinstance(condition, tvm.tirx.And):
        return [*conjuncts(condition.a), *conjuncts(condition.b)]
    return [condition]


def index_vars(access) -> list:
    """The variables in every index of a TIR block's buffer access (a read or write region)."""
    return [var for index in access.region for var in vars_in(index.min)]


def try_primitive(primitive, block) -> bool:
    """Apply a schedule primitive such as sch.compute_inline to `block`; False where TIR refuses it."""
    try:
        primitive(block)
    except tvm.s_tir.ScheduleError:
        return False
    return True


def emit_cast(builder: relax.BlockBuilder, expr: relax.Expr, dtype: str) -> relax.Expr:
    """`expr` cast to `dtype`: unchanged when it already is, folded when it is a constant."""
    if tensor_dtype(expr) == dtype:
        return expr
    if isinstance(expr, tvm.ir.expr.Constant) and can_cast_offline(dtype):
        return cast_constant(expr, dtype)
    return builder.emit(relax.op.astype(expr, dtype))



def cast_result(builder: relax.BlockBuilder, call: relax.Call, dtype: str) -> relax.Expr:
    """`call` itself when it yields `dtype`, else a cast of it, left unbound for the caller's binding."""
    call = builder.normalize(call)
    if tensor_dtype(call) == dtype:
        return call
    return relax.op.astype(builder.emit(call), dtype)


def fold_weights(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with every value computed from constants alone folded to a constant, through tuples, and inference
    batch norms folded into the weights of the convs and matmuls before them (fold_batch_norm). So a weight an
    exporter standardizes in the graph (BiT's and timm's StdConv: a training-mode batch norm of the weight, whose
    first output a TupleGetItem takes) reaches its conv as a constant, which AMP casts once and dispatch packs.
    A QDQ model is left as it is: its weights' dequantizes of int8 codes are what realize_qdq reads."""
    if calls_any_op(mod, ["relax.dequantize"]):
        return mod
    # fold_batch_norm folds constants again first: what the TupleGetItems held is folded there
    through_tuples = tvm.transform.Sequential([FoldConstants, relax.transform.CanonicalizeBindings()])
    return EliminateDeadCode()(fold_batch_norm(through_tuples(mod)))


def calls_any_op(mod: tvm.IRModule, op_names: Iterable[str]) -> bool:
    """Whether a Relax function of `mod` calls an op named in `op_names`."""
    return bool(op_calls(mod, op_names))


def op_calls(mod: tvm.IRModule, op_names: Iterable[str]) -> list[relax.Call]:
    """The calls of ops named in `op_names` in the Relax functions of `mod`."""
    wanted, found = set(op_names), []
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: found.append(e) if call_op_name(e) in wanted else None)
    return found


def fold_batch_norm(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with every conv2d [-> bias add] -> inference batch_norm (constant weights and statistics) folded into
    the conv's weights and a bias add (TVM's FoldBatchnormToConv2D), and every matmul by a constant [-> reshape
    keeping its columns] -> inference batch_norm over those columns into the matmul's weight and a bias add, the
    new weights computed once. A batch norm of a concat of convs (MixNet's mixed convs) folds into each conv."""
    fold = FoldConstants  # biases arrive as reshapes of constants; shifted means, scaled weights
    return tvm.transform.Sequential([fold, _batch_norms_through_concats, _shared_conv_batch_norms_as_affine,
                                     _bias_into_statistics, fold,
                                     relax.transform.FoldBatchnormToConv2D(), _batch_norm_into_matmul, fold,
                                     relax.transform.CanonicalizeBindings()])(mod)


def batch_norm_scale_shift(attrs: tvm.ir.Attrs, gamma, beta, mean, var) -> tuple[np.ndarray, np.ndarray]:
    """An inference batch norm (`attrs`, its statistics as arrays) as the per-channel float64 (scale, shift) with
    which it computes x * scale + shift: scale = gamma / sqrt(var + eps), shift = beta - mean * scale."""
    gamma, beta, mean, var = (np.asarray(v, "float64") for v in (gamma, beta, mean, var))
    scale = (gamma if attrs.scale else 1.0) / np.sqrt(var + float(attrs.epsilon))
    return scale, (beta if attrs.center else 0.0) - mean * scale


@relax.transform.function_pass(opt_level=0, name="relay_amp.SharedConvBatchNormsAsAffine")
def _shared_conv_batch_norms_as_affine(func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
    """batch_norm(v) over axis 1 of a conv's output v (bias added or not) that other ops read too, as v * scale +
    shift (batch_norm_scale_shift): FoldBatchnormToConv2D would fold it into a second conv of the
    conv's input (RepGhost's fusion batch norms: 16 extra convs), where a scale and shift costs one pass."""
    reads, values = read_counts(func), relax.analysis.get_var2val(func)
    gamma, beta, mean, var = dpl.is_const(), dpl.is_const(), dpl.is_const(), dpl.is_const()
    norm = dpl.is_op("relax.nn.batch_norm")(dpl.wildcard(), gamma, beta, mean, var)

    def rewrite(call: relax.Call, matches: dict) -> relax.Expr:
        data, attrs = call.args[0], call.attrs
        shape = tensor_shape(data)
        if (attrs.training or shape is None or len(shape) != 4 or int(attrs.axis) % 4 != 1
                or reads.get(data, 0) < 2 or not _is_conv_output(data, values)):
            return call
        return batch_norm_as_affine(call)

    return dpl.rewrite_call(norm, rewrite, func)


def batch_norm_as_affine(norm: relax.Call) -> relax.Tuple:
    """An inference batch_norm of constant statistics as the (result, mean, var) tuple it returns, the result
    x * scale + shift (batch_norm_scale_shift) by per-channel constants of x's dtype along the norm's axis."""
    data, *stats = norm.args
    rank = len(tensor_shape(data))
    scale, shift = batch_norm_scale_shift(norm.attrs, *(stat.value.numpy() for stat in stats))
    along = [-1 if axis == int(norm.attrs.axis) % rank else 1 for axis in range(rank)]
    scale, shift = (relax.const(v.astype(tensor_dtype(data)).reshape(along)) for v in (scale, shift))
    return relax.Tuple([relax.op.add(relax.op.multiply(data, scale), shift), *stats[2:]])


@relax.transform.function_pass(opt_level=0, name="relay_amp.BatchNormsThroughConcats")
def _batch_norms_through_concats(func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
    """batch_norm(concat([v1, ..., vn])) over the concat's axis, where each vi is a conv's output only the concat
    reads (MixNet's mixed depthwise convs: one conv per group of kernel sizes), as the concat of batch norms of each
    vi with its channels' statistics: each then folds into its conv."""
    reads, values = read_counts(func), relax.analysis.get_var2val(func)
    gamma, beta, mean, var = dpl.is_const(), dpl.is_const(), dpl.is_const(), dpl.is_const()
    joined = dpl.is_op("relax.concat")(dpl.wildcard())
    norm = dpl.is_op("relax.nn.batch_norm")(joined, gamma, beta, mean, var)

    def rewrite(call: relax.Call, matches: dict) -> relax.Expr:
        concat, attrs = matches[joined], call.attrs
        parts = _tuple_fields(concat.args[0], values)
        shape = tensor_shape(concat)
        if attrs.training or parts is None or shape is None:
            return call
        axis = int(attrs.axis) % len(shape)
        if axis != int(concat.attrs.axis) % len(shape) or not all(
                _is_conv_output(part, values) and reads.get(part, 0) == 1 for part in parts):
            return call
        stats = [matches[name].value.numpy() for name in (gamma, beta, mean, var)]
        ends = np.cumsum([tensor_shape(part)[axis] for part in parts])
        normed = [relax.TupleGetItem(relax.op.nn.batch_norm(part, *(relax.const(v[end - size:end]) for v in stats),
                                                            axis=int(attrs.axis), epsilon=float(attrs.epsilon),
                                                            center=bool(attrs.center), scale=bool(attrs.scale),
                                                            training=False), 0)
                  for part, end, size in zip(parts, ends, np.diff(ends, prepend=0))]
        return relax.Tuple([relax.op.concat(normed, axis=int(concat.attrs.axis)), matches[mean], matches[var]])

    return dpl.rewrite_call(norm, rewrite, func)


def _tuple_fields(expr: relax.Expr, values: Mapping) -> "list[relax.Expr] | None":
    """The fields of the tuple `expr` is or is bound to, or None."""
    tup = values.get(expr, expr) if isinstance(expr, relax.Var) else expr
    return list(tup.fields) if isinstance(tup, relax.Tuple) else None


def _is_conv_output(data: relax.Expr, values: Mapping) -> bool:
    """Whether `data` is bound to a conv2d, or to a conv2d's output plus a constant (its bias)."""
    value = values.get(data)
    if call_op_name(value) == "relax.add" and isinstance(value.args[1], tvm.ir.expr.Constant):
        value = values.get(value.args[0])
    return call_op_name(value) == "relax.nn.conv2d"


@relax.transform.function_pass(opt_level=0, name="relay_amp.BatchNormIntoMatmul")
def _batch_norm_into_matmul(func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
    """batch_norm(matmul(x, W) [reshaped], gamma, beta, mean, var) over W's columns (a BatchNorm1d after a linear
    layer, as LeViT's; exporters fold only a conv's) as matmul(x, W * s) + beta - mean * s [reshaped], with
    s = gamma / sqrt(var + eps); the tuple batch_norm returns keeps its statistics."""
    weight = dpl.is_const()
    product = dpl.is_op("relax.matmul")(dpl.wildcard(), weight)
    shaped = dpl.is_op("relax.reshape")(product, dpl.wildcard())
    gamma, beta, mean, var = dpl.is_const(), dpl.is_const(), dpl.is_const(), dpl.is_const()
    norm = dpl.is_op("relax.nn.batch_norm")(shaped | product, gamma, beta, mean, var)

    def rewrite(call: relax.Call, matches: dict) -> relax.Expr:
        normalized, attrs = call.args[0], call.attrs
        columns = matches[weight].value.numpy()
        out_shape = tensor_shape(normalized)
        if (attrs.training or columns.ndim != 2 or str(columns.dtype) != "float32" or out_shape is None
                or int(attrs.axis) % len(out_shape) != len(out_shape) - 1 or out_shape[-1] != columns.shape[1]):
            return call
        stats = (matches[name].value.numpy() for name in (gamma, beta, mean, var))
        scale, shift = batch_norm_scale_shift(attrs, *stats)
        scaled = relax.const((columns * scale).astype("float32"))
        value = relax.op.add(relax.op.matmul(matches[product].args[0], scaled), relax.const(shift.astype("float32")))
        if shaped in matches:
            value = relax.op.reshape(value, matches[shaped].args[1])
        return relax.Tuple([value, matches[mean], matches[var]])

    return dpl.rewrite_call(norm, rewrite, func)


@relax.transform.function_pass(opt_level=0, name="relay_amp.BiasIntoBatchNormStatistics")
def _bias_into_statistics(func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
    """batch_norm(conv2d(x, W) + b, ..., mean, var) as batch_norm(conv2d(x, W), ..., mean - b, var): the same
    values, in the form FoldBatchnormToConv2D matches (a conv with its own bias exports as conv, add)."""
    conv, bias = dpl.is_op("relax.nn.conv2d")(dpl.wildcard(), dpl.is_const()), dpl.is_const()
    gamma, beta, mean, var = dpl.is_const(), dpl.is_const(), dpl.is_const(), dpl.is_const()
    norm = dpl.is_op("relax.nn.batch_norm")(dpl.is_op("relax.add")(conv, bias), gamma, beta, mean, var)

    def rewrite(call: relax.Call, matches: dict) -> relax.Expr:
        channels = tensor_shape(matches[mean])
        if channels is None or math.prod(tensor_shape(matches[bias]) or (0,)) != channels[0]:
            return call  # not one value per channel
        shifted = relax.op.subtract(matches[mean], relax.op.reshape(matches[bias], channels))
        return relax.Call(call.op, [matches[conv], matches[gamma], matches[beta], shifted, matches[var]],
                          call.attrs, call.ty_args)

    return dpl.rewrite_call(norm, rewrite, func)


def _frames_without_source_scan(context: int = 1) -> list:
    """`inspect.stack` without its per-frame module scan: a frame from a file that does not exist (Python's frozen
    import machinery) makes `inspect` walk every loaded module, for every frame of every TVMScript function."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        line = linecache.getline(filename, lineno) if context else ""
        frames.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, [line] if line else None,
                                        0 if line else None))
        frame = frame.f_back
    return frames


@contextlib.contextmanager
def fast_script_parsing() -> Iterator[None]:
    """Within it, TVMScript decorators (`@T.prim_func`) parse without `inspect.stack`'s scan of every loaded module,
    which costs about 0.2 s per function once torch is imported."""
    original, inspect.stack = inspect.stack, _frames_without_source_scan
    try:
        yield
    finally:
        inspect.stack = original


def import_tensor_intrinsics(module: str = "tvm.s_tir.tensor_intrin") -> types.ModuleType:
    """Import TVM's tensor intrinsics `module`, parsing their TVMScript in seconds rather than about a minute."""
    if module in sys.modules:
        return sys.modules[module]
    with fast_script_parsing():
        return importlib.import_module(module)


def pad_after(expr: relax.Expr, ndim: int, axis: int, extra: int, value: float = 0.0) -> relax.Expr:
    """`expr` (of `ndim` axes) with `extra` values `value` after its `axis` (negative: from the end)."""
    pad_width = [0] * (2 * ndim)
    pad_width[2 * (axis % ndim) + 1] = extra
    return relax.op.nn.pad(expr, pad_width, pad_value=value)


CLAMP_OPS = {tvm.tirx.Max: relax.op.maximum, tvm.tirx.Min: relax.op.minimum}


def clamps_as_max_min(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` with every clip, and every call of a TE function clamping a tensor by a scalar (ONNX Clip as TVM's
    importer writes it), as Relax maximum and minimum by constants: those carry a layout through ConvertLayout,
    where clip and a TE call leave transposes around themselves (MobileNetV2's ReLU6: 34 pairs in NHWC)."""
    lifter = _ClampLifter(mod)
    lifted = rewrite_function(lifter, mod, func)
    if not lifter.te_calls:
        return lifted
    # a TE clamp's bound comes through the importer's NaN check; its PrimFunc is left without a caller
    return tvm.transform.Sequential([FoldConstants, EliminateDeadCode([func])])(
        lifted)


@relax.expr_functor.mutator
class _ClampLifter(relax.PyExprMutator):
    """Rewrites clip and scalar-clamp call_tirs into maximum/minimum."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        self.te_calls = 0  # TE clamp calls rewritten

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if new_call.op.same_as(tvm.ir.Op.get("relax.clip")):
            return self._clip(new_call)
        op = _scalar_clamp(called_prim_func(self.mod, new_call))
        if op is not None:
            self.te_calls += 1
            return op(*new_call.args[1].fields)
        return new_call

    def _clip(self, call: relax.Call) -> relax.Expr:
        bounds = [_constant_float(bound) for bound in call.args[1:]]
        if None in bounds:
            return call  # a symbolic bound
        return clamped(self.builder_, call.args[0], *bounds)


def clamped(builder: relax.BlockBuilder, data: relax.Expr, low: float, high: float) -> relax.Expr:
    """`data` clamped to [low, high] as maximum then minimum by constants (an infinite bound left out), the first
    emitted with `builder`, the last returned unbound."""
    dtype = tensor_dtype(data)
    clamps = [(op, bound) for op, bound in zip((relax.op.maximum, relax.op.minimum), (low, high))
              if math.isfinite(bound)]
    if not clamps:
        return data
    for op, bound in clamps[:-1]:
        data = builder.emit(op(data, relax.const(bound, dtype)))
    last_op, last_bound = clamps[-1]
    return last_op(data, relax.const(last_bound, dtype))


def _constant_float(bound: relax.Expr) -> float | None:
    """The number a PrimValue holds, None when it is symbolic."""
    value = getattr(bound, "value", None)
    value = getattr(value, "value", value)
    return float(value) if isinstance(value, (int, float)) else None


def called_prim_func(mod: tvm.IRModule, call: relax.Call) -> "tvm.tirx.PrimFunc | None":
    """The PrimFunc of `mod` that `call` calls through call_tir (a TE function TVM's importer emitted), else None."""
    if not call.op.same_as(tvm.ir.Op.get("relax.call_tir")) or not isinstance(call.args[0], relax.GlobalVar):
        return None
    func = mod[call.args[0]]
    return func if isinstance(func, tvm.tirx.PrimFunc) else None


def only_store(func: "tvm.tirx.PrimFunc | None") -> "tvm.tirx.BufferStore | None":
    """The store of a PrimFunc whose body is one loop nest around one block storing one value (a TE function of
    one op), else None."""
    if func is None:
        return None
    node = func.body
    while hasattr(node, "block") or hasattr(node, "body"):
        node = node.block if hasattr(node, "block") else node.body
    return node if isinstance(node, tvm.tirx.BufferStore) else None


def _scalar_clamp(func) -> "Callable | None":
    """relax.op.maximum or minimum for a PrimFunc whose one store is out[i] = max or min(x[i], bound[()]), else
    None."""
    node = only_store(func)
    if node is None or len(func.params) != 3 or type(node.value) not in CLAMP_OPS:
        return None
    data, bound = node.value.a, node.value.b
    if not (isinstance(data, tvm.ir.expr.TensorLoad) and isinstance(bound, tvm.ir.expr.TensorLoad)):
        return None
    if not (data.source.same_as(func.params[0]) and bound.source.same_as(func.params[1]) and not bound.indices):
        return None
    return CLAMP_OPS[type(node.value)]


def reduces_exactly(reduction: relax.Call, axes: list[int]) -> bool:
    """Whether the mean, sum or other reduction `reduction` reduces exactly over `axes` (ascending, counted from 0
    for its input's rank; negative attribute axes count from the end) and keeps them."""
    rank = len(tensor_shape(reduction.args[0]))
    reduced = sorted(int(axis) % rank for axis in reduction.attrs.axis or ())
    return bool(reduction.attrs.keepdims) and reduced == axes


def checked_dims(dims: Mapping[str, int], known: list[str]) -> dict[str, int]:
    """`dims` as {name: size}, after checking that each name is one of the `known` symbolic input dims and each
    size a non-negative int (0: an empty key/value cache; else OptionError naming it)."""
    for name, size in dims.items():
        if name not in known:
            raise OptionError(f"the model has no symbolic input dim {name!r}; its symbolic dims: "
                              f"{', '.join(known) or 'none (its input shapes are static)'}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise OptionError(f"symbolic dim {name!r} must be bound to a non-negative int, got {size!r}")
    return dict(dims)
