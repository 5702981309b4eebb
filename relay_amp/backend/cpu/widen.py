"""widen: bfloat16 elementwise chains computed in fp32 and rounded once, where they are stored.

x86 has no bf16 arithmetic: TVM computes each bf16 op in fp32 and rounds its result back to bf16, op by op,
so a fused chain of bf16 ops (an exporter's GELU: add, divide, erf, add, multiply, multiply; a softmax; a
residual add after a kernel's fp32 accumulator) rounded after every step. `WidenArithmetic` rewrites such
chains to compute in fp32 from their bf16 inputs, with one cast back to bf16 where a value leaves the chain (an
operand of a kernel, a bf16 graph output; a cast to an integer dtype, a quantize's codes, and a cast back to fp32,
AMP's of an fp32 graph output, take the fp32 value: YOLOv8's decoded boxes and class scores, which the bf16 function
had gathered as bf16 for their transposed concatenation lane by lane, 2x slower than fp32, then widened apart):
after fusion the function loads bf16, computes in fp32 registers and stores bf16, as PyTorch's fused CPU kernels
do, and values are at least as accurate as before. Layout ops join a chain only when their input is already
widened, so a reshape of a bf16 tensor stays a free view, and a concatenation only when none of its inputs is a
stored bf16 tensor (it would widen them only to move them, then round them back). A value read
twice may end a fused function and be stored: it reaches its readers rounded to bf16, so no tensor is stored
in fp32 that was bf16 before. That holds for a kernel's fp32 result cast to bf16 too: its cast's readers take the
fp32 value only where something else reads it in fp32 (EfficientViT-B0 stored 8 projections in fp32 for a
residual add, each rounded by a cast function of its own for the next kernel: bf16 1.12 -> 0.94 ms on Zen 5).

A grouped (depthwise) convolution of bf16 operands gets an fp32 weight: TVM would widen the constant weight at every
tap of every tile, on the ports the FMAs need. Its data stays bf16, read as it is stored. So does quantize's
depthwise conv of uint8 or int8 codes (relay_amp.passes.quantize.realize), whose weight codes AMP's fallback made
bf16. (A grouped conv whose groups tile the kernels' 16 lanes is dispatched to a bf16 kernel after all, which reads
the exact fp32 weight back as bf16: relay_amp.backend.cpu.dispatch.)

`WidenContractions` computes the convolutions and matmuls of a 16-bit float dtype the target has no dot-product
instruction for (bf16 on an AVX2 host, fp16 on every CPU) in fp32 on the fp32 FMA kernels, their result cast back:
on the generic schedules, bf16 ResNet-50 and BERT ran 0.78x and 0.72x of fp32 on a Zen 3.

`NormsReadNarrow` then gives a layer or RMS norm (or a softmax) of a kernel's bf16 output one function that reads
the bf16 tensor and widens it as it loads: fusion would leave the widening cast a function of its own (nothing fuses
after a kernel or into a norm), which stores an fp32 copy of the tensor for the norm to read back. A norm of a
slice of a kernel's output (gMLP's gate normalizes half the channels) reads the slice's window of the whole
output the same way, in either dtype, instead of a sliced copy. A mean of a widened bf16 tensor (an SE block's
squeeze) reads it the same way: FuseOps joins no cast to a mean, so the cast was stored as an fp32 copy, or, fused
into the function producing its input, made that function store fp32 (EfficientNet-B0's depthwise convs).
"""

import functools
import math
from collections.abc import Callable

import tvm
from tvm import relax, te, topi

from ..._dead_code import EliminateDeadCode
from ..._ir import (cast_constant, get_function, read_counts, rewrite_function, slice_window, tensor_dtype,
                     tensor_shape, with_attr)
from ...dtypes import LOW_FLOAT_DTYPES, MODEL_FLOAT_DTYPES
from ...ops import bound_call, call_op_name
from . import formula, kernels
from .fastmath import rounded_values

NARROW = "bfloat16"
WIDE = "float32"
ARITHMETIC = frozenset(f"relax.{name}" for name in (
    "add", "subtract", "multiply", "divide", "power", "maximum", "minimum", "negative", "abs", "sqrt", "rsqrt",
    "exp", "log", "erf", "tanh", "sigmoid", "clip", "where", "square", "nn.relu", "nn.gelu", "nn.gelu_tanh",
    "nn.silu", "nn.softmax", "nn.log_softmax", "nn.layer_norm", "nn.rms_norm", "mean", "sum", "variance", "max",
    "min", "floor"))  # floor: a quantize's rounding, floor(x / step + 0.5), in AMP's fallback
GROUPED_CONVS = ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d")
LAYOUT = frozenset(f"relax.{name}" for name in (
    "reshape", "permute_dims", "expand_dims", "squeeze", "strided_slice", "concat", "broadcast_to", "flatten", "nn.pad"))


def _is_narrow_grouped_conv(call: relax.Expr) -> bool:
    """Whether `call` is a grouped convolution of a bf16 weight that accumulates in fp32, over bf16 data or int8
    codes (quantize's depthwise convs)."""
    if call_op_name(call) not in GROUPED_CONVS or int(call.attrs.groups) == 1:
        return False
    data, weight = call.args
    return (str(call.attrs.out_dtype) == WIDE and tensor_dtype(weight) == NARROW
            and tensor_dtype(data) in (NARROW, *kernels.QUANTIZED_DTYPES))


def _takes_unrounded_value(call: relax.Expr, flows: set) -> bool:
    """Whether `call` casts a chain's bf16 value that needs no storage to fp32 (a graph output AMP widens back) or to
    an integer dtype (a quantize's codes, whole numbers already): it casts the fp32 value instead, without the bf16
    rounding in between."""
    return (call_op_name(call) == "relax.astype" and call.args[0] in flows
            and (tensor_dtype(call) == WIDE or tensor_dtype(call) not in MODEL_FLOAT_DTYPES))


def _moves_only_the_chain(args: list, flows: set) -> bool:
    """Whether a layout op of `args` joins the chain: an input is widened (in `flows`), and no input is a stored
    bf16 tensor it would widen only to move it (a stack of an LSTM's stored step outputs and its last step's stays
    in bf16, the last step rounded where it leaves its chain: the same values, without a cast of every other step)."""
    tensors = [field for arg in args for field in (arg.fields if isinstance(arg, relax.Tuple) else [arg])]
    stored = [tensor for tensor in tensors if tensor_dtype(tensor) == NARROW and tensor not in flows
              and not isinstance(tensor, tvm.ir.expr.Constant)]
    return not stored and any(tensor in flows for tensor in tensors)


@relax.expr_functor.mutator
class _Widener(relax.PyExprMutator):
    """Rebinds each bf16 arithmetic result as a cast of its fp32 computation, and feeds fp32 values to the next
    op of the chain directly."""

    def __init__(self, mod: tvm.IRModule, uses: dict[relax.Var, int]):
        super().__init__(mod)
        self.uses = uses  # how often the input function reads each var
        self.wide_of: dict[relax.Var, relax.Expr] = {}  # a bf16 var -> its fp32 value
        self.flows: set[relax.Var] = set()  # bf16 vars whose readers take the fp32 value: it needs no storage
        self.widening: dict[relax.Expr, relax.Var] = {}  # a stored bf16 value -> its cast to fp32

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        call = binding.value
        wide = self._widened(call) if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op) else None
        if wide is None:
            super().visit_var_binding_(binding)
            return
        wide_var = wide if isinstance(wide, relax.Var) else self.builder_.emit(wide)
        narrow = relax.op.astype(wide_var, NARROW)
        leaves_block = self.builder_.current_block_is_dataflow() and not isinstance(binding.var, relax.DataflowVar)
        new_var = self.builder_.emit_output(narrow) if leaves_block else self.builder_.emit(narrow)
        self.set_var_remap(binding.var, new_var)
        self.wide_of[new_var] = wide_var
        if self.uses.get(binding.var, 0) == 1 or self._stored_wide(wide):
            self.flows.add(new_var)

    def _stored_wide(self, wide: relax.Expr) -> bool:
        """Whether `wide` is an fp32 tensor that other ops read as well as the cast to bf16 being rewritten: it is
        stored in fp32 anyway, so the cast's readers may take it. One that only the cast reads (a conv's output
        that a kernel and a residual add both read as bf16) stays the cast's: read as fp32 too, it would be
        stored in fp32 and rounded by a pass of its own (EfficientViT's projections)."""
        return isinstance(wide, relax.Var) and self.uses.get(wide, 0) > 1

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        """A grouped convolution of bf16 operands into fp32 (no dot-product kernel takes one: TVM widens each
        operand as it loads it) reads an fp32 weight: a constant one is widened once, when constants fold. Its
        data stays bf16, so the op before it stores bf16."""
        new_call = super().visit_call_(call)
        if _takes_unrounded_value(new_call, self.flows):
            wide = self.wide_of[new_call.args[0]]
            return wide if tensor_dtype(new_call) == WIDE else relax.op.astype(wide, tensor_dtype(new_call))
        if not _is_narrow_grouped_conv(new_call):
            return new_call
        data, weight = new_call.args
        return relax.Call(new_call.op, [data, self._cast(weight)], new_call.attrs)

    def _widened(self, call: relax.Call) -> relax.Expr | None:
        """The fp32 computation of `call` where it is a bf16 op that joins a chain, else None."""
        name, args = call.op.name, [self.visit_expr(arg) for arg in call.args]
        if tensor_dtype(call) != NARROW:
            return None
        if name == "relax.astype":  # a chain starts unrounded from an fp32 value, and goes on through a bf16 cast
            source = args[0]
            if tensor_dtype(source) == WIDE and isinstance(source, relax.Var):
                return source
            return self.wide_of[source] if source in self.flows else None
        joins = name in ARITHMETIC or (name in LAYOUT and _moves_only_the_chain(args, self.flows))
        if not joins:
            return None
        return relax.Call(call.op, [self._wide(arg) for arg in args], call.attrs)

    def _wide(self, expr: relax.Expr) -> relax.Expr:
        """`expr` as fp32: its widened value where that needs no storage (see `flows`), an fp32 constant, or a
        cast of a bf16 value."""
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self._wide(field) for field in expr.fields])
        if tensor_dtype(expr) != NARROW:
            return expr
        if expr in self.flows:
            return self.wide_of[expr]
        return self._cast(expr)

    def _cast(self, expr: relax.Expr) -> relax.Expr:
        """bf16 `expr` cast to fp32: a constant on the host, a value by one cast however many ops read it."""
        if isinstance(expr, tvm.ir.expr.Constant):
            return cast_constant(expr, WIDE)
        if expr not in self.widening:  # one cast per value, however many ops of the chain read it
            self.widening[expr] = self.builder_.emit(relax.op.astype(expr, WIDE))
        return self.widening[expr]


@tvm.transform.module_pass(opt_level=0, name="relay_amp.WidenArithmetic")
class WidenArithmetic:
    """Compute bf16 elementwise, normalization and reduction chains in fp32, rounding once where a value leaves
    the chain; give bf16 grouped convolutions an fp32 weight."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod` (casts no one reads removed, a widening cast's fp32 value bound once); the input
        module is left as it was."""
        uses = read_counts(get_function(mod, self.func))
        widened = rewrite_function(_Widener(mod, uses), mod, self.func)
        return EliminateDeadCode([self.func])(relax.transform.CanonicalizeBindings()(widened))


NORMS = ("relax.nn.layer_norm", "relax.nn.rms_norm")
MEAN = "relax.mean"
SOFTMAX = "relax.nn.softmax"


CONTRACTIONS = ("relax.nn.conv2d", "relax.matmul")


@relax.expr_functor.mutator
class _ContractionWidener(relax.PyExprMutator):
    """Convs and matmuls of a 16-bit float dtype outside `dtypes` computed in fp32, their result cast back."""

    def __init__(self, mod: tvm.IRModule, dtypes: frozenset[str]):
        super().__init__(mod)
        self.dtypes = dtypes

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        dtype = tensor_dtype(new_call.args[0]) if call_op_name(new_call) in CONTRACTIONS else None
        if dtype not in LOW_FLOAT_DTYPES or dtype in self.dtypes:
            return new_call
        operands = [cast_constant(arg, WIDE) if isinstance(arg, tvm.ir.expr.Constant)
                    else self.builder_.emit(relax.op.astype(arg, WIDE)) for arg in new_call.args]
        wide = self.builder_.emit(relax.Call(new_call.op, operands, with_attr(new_call.attrs, out_dtype=WIDE)))
        return relax.op.astype(wide, tensor_dtype(new_call))


@tvm.transform.module_pass(opt_level=0, name="relay_amp.WidenContractions")
class WidenContractions:
    """Convs and matmuls of bf16 or fp16 data computed in fp32 (operands widened, constant weights at compile time,
    the result cast back) where the target's kernels take fp32 but not that dtype (`dtypes`: the target's kernel
    data dtypes)."""

    def __init__(self, dtypes: "frozenset[str] | set[str]", func: str = "main"):
        self.dtypes = frozenset(dtypes)
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if WIDE not in self.dtypes:
            return mod
        return rewrite_function(_ContractionWidener(mod, self.dtypes), mod, self.func)


def _window_widened(stored: te.Tensor, window: "tuple[list, list] | None") -> te.Tensor:
    """`stored` sliced to `window` (begin and end on every axis) where one is given, widened to fp32 as it is read."""
    if window is not None:
        stored = topi.strided_slice(stored, *window)
    return topi.cast(stored, WIDE) if stored.dtype != WIDE else stored


def _norm_of_stored(op_name: str, attrs, window: "tuple[list, list] | None") -> Callable[..., te.Tensor]:
    """A TE function: the norm `op_name` (with `attrs`) of its input widened to fp32 as it is read (a bf16 one),
    and sliced first to `window` (begin and end on every axis) where one is given."""
    def compute(stored: te.Tensor, *params: te.Tensor) -> te.Tensor:
        wide = _window_widened(stored, window)
        if op_name == "relax.nn.layer_norm":
            return topi.nn.layer_norm(wide, *params, axis=attrs.axes, epsilon=attrs.epsilon)
        return topi.nn.rms_norm(wide, *params, axis=attrs.axes, epsilon=attrs.epsilon)
    return compute


def _softmax_of_stored(axis: int, window: "tuple[list, list] | None",
                       softmax: Callable) -> Callable[[te.Tensor], te.Tensor]:
    """A TE function: `softmax` (a TE softmax of a tensor and an axis) over `axis` of its input sliced first to
    `window` where one is given, widened to fp32 as it is read."""
    def compute(stored: te.Tensor) -> te.Tensor:
        return softmax(_window_widened(stored, window), axis)
    return compute


def _mean_of_stored(axes: list[int], keepdims: bool, count: int) -> Callable[[te.Tensor], te.Tensor]:
    """A TE function: the mean over `axes` (`count` values) of its input widened to fp32 as it is read."""
    def compute(stored: te.Tensor) -> te.Tensor:
        return topi.divide(topi.sum(topi.cast(stored, WIDE), axis=axes, keepdims=keepdims), float(count))
    return compute


@relax.expr_functor.mutator
class _NarrowNormInputs(relax.PyExprMutator):
    """Replaces each norm or softmax of a widened bf16 tensor, or of a slice of a tensor, by one TE function that
    reads the tensor itself (a softmax by formula.fast_softmax where `fast_softmax`, with narrow exps where its result
    is rounded to a narrow float)."""

    def __init__(self, mod: tvm.IRModule, func: str, fast_softmax: bool):
        super().__init__(mod)
        self.fast_softmax = fast_softmax
        self.function = get_function(mod, func)
        self.reads = read_counts(self.function)
        self.rounded: "set[relax.Var] | None" = None  # fastmath.rounded_values, found at the first softmax rewritten
        self.bound: relax.Var | None = None

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.bound = binding.var
        super().visit_var_binding_(binding)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        name = call_op_name(new_call)
        if name == MEAN:
            return self._mean_read_narrow(new_call)
        source = self._stored_source(new_call.args[0]) if name in (*NORMS, SOFTMAX) else None
        if source is None:
            return new_call
        if name == SOFTMAX:
            compute = _softmax_of_stored(int(new_call.attrs.axis), source[1], self._softmax())
            hint = "fast_softmax" if self.fast_softmax else "softmax"  # as TVM's: profiles match fp32's calls
            return self.builder_.call_te(compute, source[0], primfunc_name_hint=hint)
        compute = _norm_of_stored(name, new_call.attrs, source[1])
        return self.builder_.call_te(compute, source[0], *new_call.args[1:],
                                     primfunc_name_hint=name.rpartition(".")[2])

    def _softmax(self) -> Callable:
        """The TE softmax for the softmax bound now."""
        if not self.fast_softmax:
            return topi.nn.softmax
        if self.rounded is None:
            self.rounded = rounded_values(self.function)
        return functools.partial(formula.fast_softmax, narrow=self.bound in self.rounded)

    def _mean_read_narrow(self, call: relax.Call) -> relax.Expr:
        """A mean of a widened bf16 tensor as one TE function that reads the bf16 tensor (the call itself for
        any other mean)."""
        cast = bound_call(self, call.args[0], "relax.astype")
        if cast is None or tensor_dtype(cast.args[0]) != NARROW or tensor_dtype(call) != WIDE:
            return call
        shape = tensor_shape(call.args[0])
        if shape is None:
            return call
        given = range(len(shape)) if call.attrs.axis is None else call.attrs.axis
        axes = [int(axis) % len(shape) for axis in given]
        extents = [shape[axis] for axis in axes]
        if not all(isinstance(extent, int) for extent in extents):
            return call  # a mean over a symbolic axis keeps TVM's
        return self.builder_.call_te(_mean_of_stored(axes, bool(call.attrs.keepdims), math.prod(extents)),
                                     cast.args[0], primfunc_name_hint="mean")

    def _stored_source(self, data: relax.Expr) -> "tuple[relax.Expr, tuple[list, list] | None] | None":
        """The tensor the norm's input `data` reads and the window it slices of it, where fusion would compute
        `data` in a function of its own that stores it: an fp32 cast of a bf16 tensor, a slice (gMLP's gate: half
        a kernel's channels), or a cast of a slice, of a kernel's output, a parameter or a tensor other ops read too
        (Swin's residual stream, stored in bf16 for the next residual add), seen through reshapes. None where
        `data` is none of those, or the cast fuses into the op producing its input."""
        cast = bound_call(self, data, "relax.astype")
        if cast is not None and (tensor_dtype(cast.args[0]) != NARROW or tensor_dtype(data) != WIDE):
            return None
        read = data if cast is None else cast.args[0]
        sliced = bound_call(self, read, "relax.strided_slice")
        window = None if sliced is None else slice_window(sliced)
        if window is not None:
            read = sliced.args[0]
        elif cast is None:
            return None  # an fp32 input read as it is: nothing to save
        chain = [read]
        while (reshape := bound_call(self, chain[-1], "relax.reshape")) is not None:
            chain.append(reshape.args[0])
        producer = self.lookup_binding(chain[-1]) if isinstance(chain[-1], relax.Var) else None
        stored = producer is None or call_op_name(producer) == "relax.call_tir"  # a kernel fuses nothing after it
        read_elsewhere = any(self.reads.get(var, 0) > 1 for var in chain)  # stored for its other readers
        return (read, window) if stored or read_elsewhere else None


@tvm.transform.module_pass(opt_level=0, name="relay_amp.NormsReadNarrow")
class NormsReadNarrow:
    """Layer and RMS norms and softmaxes of a kernel's bf16 output (or a parameter, or a tensor other ops read too)
    cast to fp32 read the bf16 tensor and widen it as they load it: fusion puts a cast neither after a kernel nor
    into a norm or softmax, nor after an op whose result others read, so the cast would be a function of its own
    that stores an fp32 copy (Swin-T's 8 residual streams that a norm and the next residual add read: bf16 B/A
    0.994, bit-identical). A cast that fuses into the op producing its input is left there. Norms and softmaxes of a
    slice of such a tensor (cast or not) read the slice's window of it, for the same reason: attention scores
    computed over whole pairs of 16-lane columns (224 for ViT's 197 tokens in bf16) and sliced to the softmax's 208
    were copied by a function of their own (ViT-S/16 bf16 12.53 -> 12.28 ms without). A softmax so rewritten is
    formula.fast_softmax where `fast_softmax` (the CPU pipeline's fast math), with fastmath's narrow exps where its
    result is rounded to bf16 (fastmath.rounded_values). Means of any widened bf16 tensor read it in bf16 too."""

    def __init__(self, func: str = "main", fast_softmax: bool = True):
        self.func = func
        self.fast_softmax = fast_softmax

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod` (casts no one reads removed); the input module is left as it was."""
        rewritten = rewrite_function(_NarrowNormInputs(mod, self.func, self.fast_softmax), mod, self.func)
        return EliminateDeadCode([self.func])(rewritten)
