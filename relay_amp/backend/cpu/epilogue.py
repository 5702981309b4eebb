"""epilogue: the elementwise ops after a dot-product kernel (AMX or AVX-512), fused into the kernel's write-back.

A kernel accumulates in fp32 (int32 for int8) and used to store that, so a convolution's bias, residual
add, ReLU and cast back to bf16 ran as a separate function that read the whole fp32 output again: in ResNet-50
the 56x56x256 fp32 outputs took more time to write and read back than their products took to compute.
`FuseKernelEpilogues` follows each kernel's result through the ops that read it alone, as long as they are
per-channel constant adds and multiplies, one add of a tensor of the output's shape (read as 8-bit codes
where it is codes widened, less a scalar zero point or not, and times a scalar step: a quantized residual, a
signed one in offset codes), multiplies by an fp32 tensor of one
value per output row (a dynamic int8 matmul's row scales, computed at run time), ReLU or clip, casts to float
dtypes, a last cast to int8/uint8 (a quantized model's requantize: scale, floor(x + 0.5), clamp, cast) and
reshapes that keep the channel axis (an int8 matmul's int32 sums reshaped back from the kernel's NHWC too), and
rebuilds the kernel with them as its epilogue
(`kernels.Epilogue`): each accumulator is finished in registers and stored once, in its final dtype. Ops the
graph has in bf16 after a cast are computed on the fp32 value, and rounded once, at the store. Runs of scales,
biases and clamps are folded before (`relay_amp.backend.cpu.affine`), so a requantize after a ReLU6 is one
multiply-add, floor and clamp here.

An activation that reads its input more than once (SiLU's x * sigmoid(x), GELU as exporters spell it:
x * (erf(x / 1.414) + 1) * 0.5, with AMP's casts in between) is taken whole: the elementwise ops after a value
that only it feeds become one MAP step (`relay_amp.backend.cpu.formula`), and so does any other activation with
a formula (a LeakyReLU, CSPNet's and DarkNet's activation). So the 4x-wide output of a
transformer's or ConvNeXt's first MLP matmul, or an EfficientNet expansion conv's, is stored once, activated.

A slice of the result's leading channels that is the model's output (dispatch's, dropping the zero channels a
weight was padded with to whole vectors: a vocabulary of 50257 words computed as 50272) ends the chain: the kernel
stores only those channels (`kernels.ConvSpec.stored_channels`), so no function copies them out of the padded
result (a 128-token prefill's logits over that vocabulary: 16.20 -> 15.68 ms in bf16). Inside the graph a slice
fuses into its reader's function instead.
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from ..._dead_code import EliminateDeadCode
from ..._ir import (add_func_once, get_function, read_counts, rewrite_function, slice_window, tensor_dtype,
                     tensor_shape)
from ...dtypes import MODEL_FLOAT_DTYPES
from ...ops import call_op_name
from . import amx, formula, kernels

_ALIAS = object()  # a step that only renames, reshapes or casts the value
ACTIVATION_WINDOW = 24  # bindings after a kernel's value searched for the ops of an activation


# the attribute that marks a kernel without an epilogue -> the function that builds it with one
KERNEL_MAKERS = {amx.FUSABLE_ATTR: amx.conv2d_nhwc, kernels.FUSABLE_ATTR: kernels.conv2d_nhwc_compute}


@dataclass
class _Chain:
    """A kernel call and the ops after it that its epilogue takes over."""
    kernel: relax.Call
    spec: kernels.ConvSpec
    make: Callable[[kernels.ConvSpec, kernels.Epilogue], tvm.tirx.PrimFunc]  # builds the kernel with an epilogue
    steps: list = field(default_factory=list)  # kernels.Step per op
    operands: list = field(default_factory=list)  # the steps' operand expressions
    residual_dtype: str = ""
    out_dtype: str = ""
    end: "relax.Var | None" = None  # the var whose value the fused call computes
    absorbed: list = field(default_factory=list)  # vars whose bindings the fused call replaces


def _channel_constant(expr: relax.Expr, channels: int) -> "np.ndarray | None":
    """A constant that broadcasts along the channel axis only, as a flat fp32 vector of `channels` values."""
    if not isinstance(expr, tvm.ir.expr.Constant) or tensor_dtype(expr) not in MODEL_FLOAT_DTYPES:
        return None
    values = expr.value.numpy()
    if values.size not in (1, channels) or (values.size == channels and values.shape[-1] != channels):
        return None
    return np.broadcast_to(values.astype("float32").reshape(-1), (channels,)).copy()


class _ChainFinder:
    """Walks each kernel's result through the bindings that read it alone, in binding order."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function, fast_math: bool = True):
        self.mod = mod
        self.fast_math = fast_math
        self.uses = read_counts(func)
        self.reader: dict[relax.Var, relax.VarBinding] = {}
        self.claimed: set[relax.Var] = set()  # vars a chain found so far absorbs or binds
        self.absorbed: set[relax.Var] = set()  # vars whose bindings a chain found so far removes
        self.chains: list[_Chain] = []
        self.blocks = [list(block.bindings) for block in func.body.blocks]
        self.position = {binding.var: (index, at) for index, bindings in enumerate(self.blocks)
                         for at, binding in enumerate(bindings)}  # var -> (block, binding) where it is bound
        for bindings in self.blocks:
            for binding in bindings:
                relax.analysis.post_order_visit(binding.value, lambda expr, b=binding: self._note_reader(expr, b))
        for bindings in self.blocks:
            for binding in bindings:
                kernel = self._kernel(binding.value)
                if kernel is not None:
                    self._follow(binding.var, _Chain(binding.value, *kernel))

    def _note_reader(self, expr: relax.Expr, binding: relax.VarBinding) -> None:
        if isinstance(expr, relax.Var):
            self.reader[expr] = binding

    def _kernel(self, value: relax.Expr) -> "tuple | None":
        """(spec, builder) of a call of a kernel that has no epilogue yet, else None."""
        if not (isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir"))
                and isinstance(value.args[0], relax.GlobalVar)):
            return None
        func = self.mod[value.args[0]]
        for attr, make in KERNEL_MAKERS.items():
            spec = kernels.fusable_spec(func, attr)
            if spec is not None:
                return spec, make
        return None

    def _follow(self, var: relax.Var, chain: _Chain) -> None:
        current = var
        chain.absorbed.append(var)
        while isinstance(current, relax.DataflowVar):
            following = self._next_step(current, chain)
            if following is None:
                following = self._activation(current, chain)
            if following is None:
                break
            current = following
        chain.absorbed.pop()  # the last var is the chain's result: the fused call binds it
        if current is var or not (chain.steps or chain.out_dtype or chain.spec.stored_channels):
            return
        chain.end = current
        self.absorbed.update(chain.absorbed)
        self.claimed.update(chain.absorbed, [current])
        self.chains.append(chain)

    def _next_step(self, current: relax.Var, chain: _Chain) -> "relax.Var | None":
        """The var of the one op reading `current`, recorded in `chain`; None where the epilogue cannot take it."""
        binding = self.reader.get(current)
        if self.uses.get(current, 0) != 1 or binding is None or binding.var in self.claimed:
            return None
        if self._step(binding.value, current, chain) is None:
            return None
        chain.absorbed.append(binding.var)
        return binding.var

    def _activation(self, root: relax.Var, chain: _Chain) -> "relax.Var | None":
        """The elementwise ops after `root` that only it feeds (a GELU or SiLU as exporters spell it, which reads
        its input twice) recorded in `chain` as one MAP step: the var of their result, or None."""
        if tensor_dtype(root) not in MODEL_FLOAT_DTYPES or root not in self.position:
            return None
        block, at = self.position[root]
        known, unread, taken, closed = {root: formula.X}, {root: self.uses.get(root, 0)}, [], 0
        for binding in self.blocks[block][at + 1: at + 1 + ACTIVATION_WINDOW]:
            reads = _reads(binding.value)
            if not any(var in known for var in reads):
                continue
            made = formula.of_call(binding.value, known, self.fast_math)
            if made is None or binding.var in self.claimed or tensor_shape(binding.var) != tensor_shape(root):
                break
            for var in reads:
                unread[var] -= 1
            known[binding.var], unread[binding.var] = made, self.uses.get(binding.var, 0)
            taken.append(binding.var)
            if all(count == 0 for var, count in unread.items() if not var.same_as(binding.var)):
                closed = len(taken)
            if not isinstance(binding.var, relax.DataflowVar):
                break
        if not closed or known[taken[closed - 1]] == formula.X:
            return None
        sink = taken[closed - 1]
        self._record(chain, kernels.Step(kernels.MAP, formula=known[sink]), None)
        chain.out_dtype = tensor_dtype(sink)
        chain.absorbed.extend(taken[:closed])
        return sink

    def _step(self, value: relax.Expr, current: relax.Var, chain: _Chain):
        """Record the op `value` (which reads `current`) in `chain`; None where the epilogue cannot take it."""
        if isinstance(value, relax.Var):
            return _ALIAS
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return None
        if value.op.name == "relax.reshape":  # moves nothing, whatever the dtype: int32 sums reshaped back too
            return self._reshape(value, current, chain)
        if value.op.name == "relax.strided_slice":
            return self._leading_channels(value, current, chain)
        if tensor_dtype(value) not in MODEL_FLOAT_DTYPES and not self._quantizes(value, current):
            return None
        handler = {"relax.add": self._add, "relax.multiply": self._multiply, "relax.nn.relu": self._relu,
                   "relax.clip": self._clip, "relax.maximum": self._bound, "relax.minimum": self._bound,
                   "relax.astype": self._astype}.get(value.op.name)
        return None if handler is None else handler(value, current, chain)

    @staticmethod
    def _quantizes(value: relax.Call, current: relax.Var) -> bool:
        """Whether `value` casts the fp32 `current` to an 8-bit integer: the chain's last step (the kernel stores
        the integer; nothing after it joins)."""
        return (value.op.name == "relax.astype" and tensor_dtype(value) in kernels.QUANTIZED_DTYPES
                and tensor_dtype(current) == kernels.WIDE)

    def _other_operand(self, value: relax.Call, current: relax.Var) -> "relax.Expr | None":
        first, second = value.args
        if first.same_as(current) != second.same_as(current):
            return second if first.same_as(current) else first
        return None

    def _add(self, value: relax.Call, current: relax.Var, chain: _Chain):
        other = self._other_operand(value, current)
        if other is None or tensor_dtype(current) not in MODEL_FLOAT_DTYPES:
            return None
        constant = _channel_constant(other, chain.spec.out_channels)
        if constant is not None:
            return self._record(chain, kernels.Step(kernels.BIAS), relax.const(constant))
        if (chain.residual_dtype or not isinstance(other, relax.Var) or other in self.absorbed
                or tensor_shape(other) != tensor_shape(current) or tensor_dtype(other) not in MODEL_FLOAT_DTYPES):
            return None
        codes = self._codes_source(other)
        if codes is not None:
            chain.residual_dtype = tensor_dtype(codes[0])
            step = kernels.Step(kernels.RESIDUAL, scale=codes[1], zero_point=codes[2])
            return self._record(chain, step, codes[0])
        other = self._narrow_source(other)
        chain.residual_dtype = tensor_dtype(other)
        return self._record(chain, kernels.Step(kernels.RESIDUAL), other)

    def _bound_value(self, var: relax.Var) -> "relax.Expr | None":
        """The value bound to `var` in the function's blocks, None for a parameter."""
        block, at = self.position.get(var, (None, None))
        return None if block is None else self.blocks[block][at].value

    def _codes_source(self, var: relax.Var) -> "tuple[relax.Var, float, float] | None":
        """(codes, step, zero point) where `var` is 8-bit integer codes widened, less a scalar zero point or not
        (offset codes of a signed tensor), and multiplied by a scalar step: the kernel reads the codes (a quarter of
        fp32's bytes) and scales them in registers."""
        value = self._bound_value(var)
        if call_op_name(value) != "relax.multiply" or not isinstance(value.args[0], relax.Var):
            return None
        step, widened, zero_point = formula.scalar(value.args[1]), self._bound_value(value.args[0]), 0.0
        if call_op_name(widened) == "relax.subtract" and isinstance(widened.args[0], relax.Var):
            zero_point, widened = formula.scalar(widened.args[1]), self._bound_value(widened.args[0])
        if (step is None or zero_point is None or call_op_name(widened) != "relax.astype"
                or not isinstance(widened.args[0], relax.Var)):
            return None
        codes = widened.args[0]
        if tensor_dtype(codes) not in kernels.QUANTIZED_DTYPES or codes in self.absorbed:
            return None
        return codes, step, zero_point

    def _narrow_source(self, var: relax.Var) -> relax.Var:
        """The bf16 (or fp16) var that `var` is a cast of to fp32, else `var`: the kernel reads the narrow tensor
        and widens it in registers (a residual stream kept in bf16 is read at half the bytes). Not a var an
        earlier chain absorbs: its binding is gone."""
        value = self._bound_value(var)
        if call_op_name(value) != "relax.astype" or not isinstance(value.args[0], relax.Var):
            return var
        source = value.args[0]
        narrow = tensor_dtype(source) in MODEL_FLOAT_DTYPES and tensor_dtype(source) != kernels.WIDE
        return source if narrow and tensor_dtype(var) == kernels.WIDE and source not in self.absorbed else var

    def _multiply(self, value: relax.Call, current: relax.Var, chain: _Chain):
        other = self._other_operand(value, current)
        if other is None or tensor_dtype(current) not in MODEL_FLOAT_DTYPES:
            return None
        constant = _channel_constant(other, chain.spec.out_channels)
        if constant is not None:
            return self._record(chain, kernels.Step(kernels.SCALE), relax.const(constant))
        if self._row_operand(other, current):
            return self._record(chain, kernels.Step(kernels.ROW_SCALE), other)
        return None

    def _row_operand(self, other: relax.Expr, current: relax.Var) -> bool:
        """Whether `other` is an fp32 tensor of one value per row of `current` (its shape with the channel axis 1):
        a dynamic matmul's row scales, computed at run time."""
        shape = tensor_shape(current)
        return (isinstance(other, relax.Var) and other not in self.absorbed and tensor_dtype(other) == kernels.WIDE
                and shape is not None and tensor_shape(other) == (*shape[:-1], 1))

    def _relu(self, value: relax.Call, current: relax.Var, chain: _Chain):
        if tensor_dtype(current) not in MODEL_FLOAT_DTYPES:
            return None
        return self._record(chain, kernels.Step(kernels.CLIP, low=0.0), None)

    def _clip(self, value: relax.Call, current: relax.Var, chain: _Chain):
        _, low, high = value.args
        if tensor_dtype(current) not in MODEL_FLOAT_DTYPES:
            return None
        return self._record(chain, kernels.Step(kernels.CLIP, float(low.value), float(high.value)), None)

    def _bound(self, value: relax.Call, current: relax.Var, chain: _Chain):
        """maximum or minimum by a scalar constant (a clip as relay_amp's frontends write it): one side of a CLIP."""
        bound = formula.scalar(self._other_operand(value, current))
        if tensor_dtype(current) not in MODEL_FLOAT_DTYPES or bound is None:
            return None
        low, high = (bound, math.inf) if value.op.name == "relax.maximum" else (-math.inf, bound)
        return self._record(chain, kernels.Step(kernels.CLIP, low, high), None)

    def _astype(self, value: relax.Call, current: relax.Var, chain: _Chain):
        """A cast to fp32 goes on in fp32 (from int32 accumulators, or back from a narrow cast only it reads: TVM
        dropped such a round trip inside one function too); a narrow cast is stored unless a cast back follows."""
        dtype = tensor_dtype(value)
        if tensor_dtype(current) in kernels.QUANTIZED_DTYPES or kernels.WIDE not in (dtype, tensor_dtype(current)):
            return None
        chain.out_dtype = dtype
        return _ALIAS

    def _reshape(self, value: relax.Call, current: relax.Var, chain: _Chain):
        shape = tensor_shape(value)
        return _ALIAS if shape is not None and shape[-1:] == (chain.spec.out_channels,) else None

    def _leading_channels(self, value: relax.Call, current: relax.Var, chain: _Chain):
        """A slice of the result's leading channels (dispatch's, dropping a padded weight's zero channels: a
        vocabulary of 50257 words computed as 50272) that is the function's output: the kernel stores only those
        (the chain's last step), so no function copies them out. A slice inside the graph fuses into the function
        of the op reading it, at no cost of its own, while the kernel's store of part of a vector costs: MixNet-S
        in bf16 ran 2.45 against 2.31 ms with its mixed convs' slices stored so."""
        window = slice_window(value)
        if chain.make is not kernels.conv2d_nhwc_compute or window is None:
            return None
        if isinstance(self.reader[current].var, relax.DataflowVar):
            return None
        begin, end = window
        if any(begin) or end[:-1] != list(tensor_shape(current)[:-1]):
            return None
        chain.spec = dataclasses.replace(chain.spec, stored_channels=end[-1])
        return _ALIAS

    @staticmethod
    def _record(chain: _Chain, step: "kernels.Step", operand: "relax.Expr | None"):
        chain.steps.append(step)
        if operand is not None:
            chain.operands.append(operand)
        return step


def _reads(expr: relax.Expr) -> list[relax.Var]:
    """Every var `expr` reads, once per read."""
    found: list[relax.Var] = []
    relax.analysis.post_order_visit(expr, lambda node: found.append(node) if isinstance(node, relax.Var) else None)
    return found


@relax.expr_functor.mutator
class _Fuser(relax.PyExprMutator):
    """Drops the bindings a chain absorbs and binds each chain's result to its kernel with the epilogue."""

    def __init__(self, mod: tvm.IRModule, chains: list[_Chain]):
        super().__init__(mod)
        self.absorbed = {var for chain in chains for var in chain.absorbed}
        self.chain_of = {chain.end: chain for chain in chains}
        self.kernels: dict = {}  # (maker, spec, the epilogue's repr) -> the kernel's GlobalVar

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.absorbed:
            return
        chain = self.chain_of.get(binding.var)
        if chain is None:
            super().visit_var_binding_(binding)
            return
        fused = self._fused_call(chain)
        if tensor_shape(binding.var) != chain.spec.stored_shape:
            fused = relax.op.reshape(self.builder_.emit(fused), tensor_shape(binding.var))
        leaves_block = not isinstance(binding.var, relax.DataflowVar)
        self.set_var_remap(binding.var, self.builder_.emit_output(fused) if leaves_block else self.builder_.emit(fused))

    def _fused_call(self, chain: _Chain) -> relax.Expr:
        out_dtype = chain.out_dtype or chain.spec.out_dtype
        epilogue = kernels.Epilogue(tuple(chain.steps), chain.residual_dtype, out_dtype)
        operands = [self._as_operand_shape(self.visit_expr(operand),
                                           epilogue.operand_buffer(step, chain.spec.operand_shape)[0])
                    for step, operand in zip(epilogue.operand_steps, chain.operands)]
        gvar = self._kernel(chain, epilogue)
        inputs = [self.visit_expr(arg) for arg in chain.kernel.args[1].fields]
        return relax.call_tir(gvar, [*inputs, *operands], relax.TensorType(chain.spec.stored_shape, out_dtype))

    def _kernel(self, chain: _Chain, epilogue: "kernels.Epilogue") -> relax.GlobalVar:
        """The kernel of `chain`'s spec with `epilogue`, added once (repr tells -0.0 from 0.0 in its formulas)."""
        key = (chain.make, chain.spec, repr(epilogue))
        return add_func_once(self.builder_, self.kernels, key, lambda: chain.make(chain.spec, epilogue),
                             "relay_amp_dot_kernel")

    def _as_operand_shape(self, operand: relax.Expr, shape: tuple) -> relax.Expr:
        if isinstance(operand, tvm.ir.expr.Constant) or tensor_shape(operand) == shape:
            return operand
        return self.builder_.emit(relax.op.reshape(operand, shape))


@tvm.transform.module_pass(opt_level=0, name="relay_amp.FuseKernelEpilogues")
class FuseKernelEpilogues:
    """Fuse the per-channel, residual, clamping, activation, casting and reshaping ops after each kernel into it."""

    def __init__(self, func: str = "main", fast_math: bool = True):
        self.func = func
        self.fast_math = fast_math  # activations with TVM's fast_exp/fast_erf/fast_tanh (else libm's)

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod` (kernels left without a reader removed); the input module is left as it was."""
        chains = _ChainFinder(mod, get_function(mod, self.func), self.fast_math).chains
        if not chains:
            return mod
        fused = rewrite_function(_Fuser(mod, chains), mod, self.func)
        return EliminateDeadCode([self.func])(fused)
