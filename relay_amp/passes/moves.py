"""HoistOverMoves: narrowing casts, ops by a scalar constant and activations move before the reshapes, transposes
and slices they follow and into each part of a concat, and narrowing casts of every output of a split before the
split.

Attention splits a projection's output into heads (reshape, permute_dims), and only then does AMP's cast to
bf16 come, with the query's or key's scale: the projection stores fp32, the transposes move fp32, and the cast
is a function of its own. Both commute exactly with moves of data, so `HoistOverMoves` puts them first: the
kernel before them takes the cast and the scale into its epilogue (relay_amp.backend.cpu.epilogue), and the moves
carry half the bytes. Only narrowing casts and scalar ops move (a widening cast would make the moves carry
more), and only over a move that nothing else reads.

A mixed conv (MixNet) splits its input into channel groups, each for a conv of its own, and AMP casts each group
to bf16: a function of its own for each cast, after the split's. Where every output of a split is cast to one
dtype, the split takes the cast source's cast instead: the cast joins the split's function (or the producer's
epilogue), and the split moves half the bytes. Its groups' convs meet again in a concat, and AMP's cast and the
activation come after it: the kernels stored fp32 and the concat moved it. Where nothing else reads the concat or
its parts, each part gets the ops instead, so each kernel's epilogue (or its depthwise conv's function) takes
them and the concat moves bf16. A kernel whose channels were padded to whole vectors is sliced back: an op moves
before such a slice where nothing else reads the sliced tensor (the padding's few extra values are computed in
the epilogue).

A concat that only narrowing casts to one dtype read (a decode step's key or value cache with bf16 inputs and
outputs: the present output and the attention's operand) becomes one concat of narrowed parts that all its readers
share, and a part that widened a value of that dtype (the past cache, widened at the input) takes the value itself:
the cache is concatenated as it came in and only the new token is cast, instead of the whole cache widened and
narrowed again each step.

A quantized conv's input codes (relay_amp.passes.quantize: a scale, a shift, a clamp as maximum and minimum, a cast
to uint8 or int8) move the same way, and also before a max pool, which commutes with every op that never
decreases, and a nearest-neighbour resize, which only copies values. An inception block concatenates its
branches' ReLU outputs, and the next block's convs read the concat and its max pool: the kernels stored fp32,
the concat and the pool moved fp32, and a function of its own quantized each. Now each branch's kernel stores
codes in its epilogue, and the concat and the pool move bytes (GoogLeNet int8q 0.89x the time, bit-identical).

A narrowing cast also passes a ReLU and a constant pad by a value its dtype holds, whose values it rounds alike
before them, on its way to a move (not where only they lie between it and the op computing its input: the ReLU
stays in that op's fp32 epilogue). EfficientViT's linear attention in int8q concatenates two quantized kernels'
fp32 outputs, splits them into heads, ReLUs the query and key, pads the value with ones and casts each to bf16:
the three casts now meet as one before the slices and enter the concat's parts, and the kernels store bf16
(EfficientViT-B0 int8q 0.90-0.93x the time on a 2-core Sapphire Rapids, bit-identical).

An op passes a slice or a max pool, and enters a concat's or a split's parts, only where every reader of the
tensor it would then read comes to read the same op of it, directly or through moves it passes too (`_takes`):
the block's 1x1 convs quantizing its input beside the pool branch; YOLOv8's C2f block, which splits a conv's
output in halves and concatenates them with a bottleneck's output; its SPPF block, which concatenates a tensor and
three max pools in a row of it. The copies of the op this leaves become one after each round. A quantized conv's
codes only agree with another's where both layers have one range (relay_amp.passes.quantize.shared).
"""

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from .._dead_code import EliminateDeadCode
from .._ir import get_function, is_scalar_constant, read_counts, rewrite_function, tensor_dtype
from ..dtypes import MODEL_FLOAT_DTYPES, numpy_dtype, widens_exactly
from ..ops import call_op_name

MOVES = ("relax.reshape", "relax.permute_dims")
SPLIT = "relax.split"
SCALAR_OPS = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum")
CONCAT = "relax.concat"
SLICE = "relax.strided_slice"
ACTIVATIONS = frozenset(f"relax.{name}" for name in (  # one tensor operand, per value
    "nn.relu", "nn.silu", "nn.gelu", "nn.gelu_tanh", "sigmoid", "tanh", "clip", "floor"))
NOT_MONOTONE = frozenset(("relax.nn.silu", "relax.nn.gelu", "relax.nn.gelu_tanh"))
# a max over each window: it commutes with an op that never decreases (a quantize's scale, shift, clamp and cast)
MAX_POOLS = frozenset(f"relax.nn.max_pool{rank}d" for rank in (1, 2, 3))
RESIZE = "relax.image.resize2d"  # nearest-neighbour: each output a copy of one input value
PAD = "relax.nn.pad"
ROUNDING_COMMUTES = ("relax.nn.relu", PAD)  # a narrowing cast before them gives the same values (a pad's where its
# value is exact in the narrow dtype)
CODE_DTYPES = ("int8", "uint8")  # a float cast to these holds quantize's codes


def _narrowing_cast(call: relax.Call) -> bool:
    """A cast from a model float dtype to a narrower one, or to 8-bit codes."""
    source, target = tensor_dtype(call.args[0]), tensor_dtype(call)
    return source in MODEL_FLOAT_DTYPES and (target in CODE_DTYPES or (
        target in MODEL_FLOAT_DTYPES and widens_exactly(target, source)))


def nearest_resize(expr: relax.Expr) -> bool:
    """Whether `expr` is a nearest-neighbour resize: each output a copy of one input value."""
    return call_op_name(expr) == RESIZE and str(expr.attrs.method) == "nearest_neighbor"


def _monotone(call: relax.Call, index: int) -> bool:
    """Whether the movable op `call` never decreases as its operand `index` grows."""
    name = call_op_name(call)
    if name in ("relax.multiply", "relax.divide"):
        return (name == "relax.multiply" or index == 0) and float(call.args[1 - index].value.numpy()) > 0
    return name != "relax.subtract" or index == 0 if name in SCALAR_OPS else name not in NOT_MONOTONE


def _rounds_alike(op: relax.Expr, cast: relax.Call) -> bool:
    """Whether `cast`, a narrowing cast (to a narrower float, or to codes), gives the same values before `op` as
    after it: a ReLU, or a constant pad whose value the narrow dtype holds (EfficientViT's linear attention in
    int8q: the quantized kernels' fp32 query, key and value concatenated, sliced, ReLU'd or padded with ones, then
    cast to bf16)."""
    name = call_op_name(op)
    if name not in ROUNDING_COMMUTES or call_op_name(cast) != "relax.astype" or not _narrowing_cast(cast):
        return False
    if name != PAD:
        return True
    value = float(op.attrs.pad_value)
    held = np.array(value).astype(numpy_dtype(tensor_dtype(cast)))
    return str(op.attrs.pad_mode) == "constant" and float(held) == value


def _movable_operand(call: relax.Call) -> "int | None":
    """The index of the tensor operand `call` could take before a move, None where it cannot move."""
    name = call_op_name(call)
    if (name == "relax.astype" and _narrowing_cast(call)) or name in ACTIVATIONS:
        return 0
    if name in SCALAR_OPS and len(call.args) == 2:
        first, second = (is_scalar_constant(arg) for arg in call.args)
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
        self.cast_dtypes = _narrowing_casts_reading(self.value_of)
        self.var_of = {value: var for var, value in self.value_of.items()}
        self.readers: dict[relax.Var, list[relax.Expr]] = {}  # each binding's value once per var it reads
        for value in [*self.value_of.values(), func.body.body]:  # the function's result reads too
            for var in relax.analysis.free_vars(value):
                self.readers.setdefault(var, []).append(value)
        self.items_of: dict[relax.Var, list[relax.Var]] = {}
        for var, value in self.value_of.items():
            if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
                self.items_of.setdefault(value.tuple_value, []).append(var)
        self.applied_splits: dict[relax.Var, relax.Var] = {}  # a split whose outputs all read one op -> of its input
        self.narrow_concats: dict[relax.Var, relax.Var] = {}  # a concat read only by casts -> the concat of cast parts
        self.applied_to: dict[relax.Var, list[relax.Call]] = {}  # the ops `_applied` gave each var this round
        self.in_dataflow = False  # whether the binding being visited is in a dataflow block
        self.changed = False
        self.duplicated = False  # whether an op was applied to a tensor that the same op reads already

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        self.in_dataflow = True
        visited = super().visit_dataflow_block_(block)
        self.in_dataflow = False
        return visited

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        hoisted = self._hoisted(value) if isinstance(value, relax.Call) else None
        if hoisted is None:
            super().visit_var_binding_(binding)
            return
        self.changed = True
        output = self.in_dataflow and not isinstance(binding.var, relax.DataflowVar)
        emit = self.builder_.emit_output if output else self.builder_.emit
        self.set_var_remap(binding.var, emit(hoisted))

    def _hoisted(self, call: relax.Call) -> "relax.Expr | None":
        """`call` applied before the moves that produce its operand, or None where nothing moves."""
        index = _movable_operand(call)
        if index is None:
            return None
        if (concat := self._over_concat(call, index)) is not None:
            return concat
        if call_op_name(call) == "relax.astype" and (narrow := self._narrow_concat(call)) is not None:
            return narrow
        if (split_item := self._over_split(call, index)) is not None:
            return split_item
        moves, source = [], call.args[index]
        while isinstance(source, relax.Var) and self.uses.get(source, 0) == 1 and self._is_move(source, call, index):
            moves.append(self.value_of[source])
            source = moves[-1].args[0]
        while moves and call_op_name(moves[-1]) in ROUNDING_COMMUTES:  # a cast crosses them only to reach a move
            source = self.var_of[moves.pop()]
        if not moves:
            return None
        result = self._applied(call, index, source)
        for position, move in enumerate(reversed(moves)):
            result = relax.Call(move.op, [self.builder_.emit(result) if position else result, *move.args[1:]],
                                move.attrs)
        return result

    def _applied(self, call: relax.Call, index: int, operand: relax.Expr) -> relax.Expr:
        """`call` applied to `operand` in place of its operand `index`, emitted; a narrowing cast of a value that
        was widened from its dtype (an input AMP widened) is that value, exactly."""
        value = self.value_of.get(operand)
        if (call_op_name(call) == "relax.astype" and call_op_name(value) == "relax.astype"
                and tensor_dtype(value.args[0]) == tensor_dtype(call)):
            return self.visit_expr(value.args[0])
        earlier = [*self.readers.get(operand, []), *self.applied_to.get(operand, [])]  # the round's own copies too
        self.duplicated |= any(self._same_op(reader, call, index, operand) for reader in earlier)
        args = list(call.args)
        args[index] = operand
        self.applied_to.setdefault(operand, []).append(relax.Call(call.op, list(args), call.attrs))
        args[index] = self.visit_expr(operand)
        return self.builder_.emit(relax.Call(call.op, args, call.attrs))

    def _is_move(self, var: relax.Var, call: relax.Call, index: int) -> bool:
        """Whether `var` is bound to a move `call` can go before: a reshape, a transpose or a nearest-neighbour
        resize; a slice, or a max pool where `call` never decreases, of a tensor every reader of which comes to read
        `call` of it (`_takes`: a kernel output padded to whole vectors of channels and sliced back, whose padding the
        op computes in the kernel's epilogue; a C2f block's halves; an inception block's input, read by its pool
        branch and by its convs' quantize)."""
        value = self.value_of.get(var)
        name = call_op_name(value)
        if name == SLICE or name in MAX_POOLS:
            return self._crosses(value, call, index) and self._takes(value.args[0], call, index)
        return name != CONCAT and self._crosses(value, call, index)  # a concat's parts: _over_concat

    def _crosses(self, move: relax.Expr, call: relax.Call, index: int) -> bool:
        """Whether `call` commutes with the move `move` (a concat: applied to each part); a narrowing cast with a
        ReLU and a constant pad too (`_rounds_alike`)."""
        name = call_op_name(move)
        return (name in (*MOVES, SLICE, CONCAT) or nearest_resize(move) or (name in MAX_POOLS and _monotone(call, index))
                or _rounds_alike(move, call))

    def _takes(self, var: relax.Var, call: relax.Call, index: int) -> bool:
        """Whether every reader of `var` comes to read `call` of it: the same op of it, or a move `call` commutes
        with whose every reader does (a tensor's slices, or a max pool and a concat of it, all quantized alike)."""
        return all(self._same_op(reader, call, index, var) or (
            self._crosses(reader, call, index) and self._takes(self.var_of[reader], call, index))
            for reader in self.readers.get(var, []))

    def _same_op(self, reader: relax.Expr, call: relax.Call, index: int, operand: relax.Var) -> bool:
        """Whether `reader` is `call` applied to `operand` in place of its operand `index` (one binding once
        deduplicated)."""
        if not isinstance(reader, relax.Call) or not reader.op.same_as(call.op) or len(reader.args) != len(call.args):
            return False
        args = list(call.args)
        args[index] = operand
        return tvm_ffi.structural_equal(reader.attrs, call.attrs) and all(
            tvm_ffi.structural_equal(a, b) for a, b in zip(reader.args, args))

    def _over_concat(self, call: relax.Call, index: int) -> "relax.Expr | None":
        """The concat of `call` applied to each part of the concat its operand is, where nothing else reads the
        concat and every reader of each part comes to read `call` of it (MixNet's mixed convs: each part's conv then
        takes the op into its own function; a C2f block's parts, quantized alike); else None."""
        operand = call.args[index]
        concat = self._concat(operand) if self.uses.get(operand, 0) == 1 else None
        if concat is None or not all(self._takes(part, call, index) for part in concat.args[0].fields):
            return None
        parts = [self._applied(call, index, part) for part in concat.args[0].fields]
        return relax.Call(concat.op, [relax.Tuple(parts)], concat.attrs)

    def _narrow_concat(self, cast: relax.Call) -> "relax.Expr | None":
        """The concat of narrowed parts that every reader of the concat `cast` reads shares, where each reader is a
        cast to its dtype (a decode step's key or value cache in bf16: the present output and the attention's operand
        both narrowed) and no part is read elsewhere; a part that widened a value of that dtype (the cache input)
        takes the value itself. Else None."""
        source, dtype = cast.args[0], tensor_dtype(cast)
        concat = self._lone_parts_concat(source) if self._cast_only(source, dtype) else None
        if concat is None:
            return None
        if source not in self.narrow_concats:
            parts = [self._applied(cast, 0, part) for part in concat.args[0].fields]
            shared = not isinstance(source, relax.DataflowVar) and self.in_dataflow
            emit = self.builder_.emit_output if shared else self.builder_.emit  # readers after the block, too
            self.narrow_concats[source] = emit(relax.Call(concat.op, [relax.Tuple(parts)], concat.attrs))
        return self.narrow_concats[source]

    def _concat(self, var: relax.Expr) -> "relax.Call | None":
        """The concat of a tuple of parts that `var` is bound to, else None."""
        concat = self.value_of.get(var)
        return concat if call_op_name(concat) == CONCAT and isinstance(concat.args[0], relax.Tuple) else None

    def _lone_parts_concat(self, var: relax.Expr) -> "relax.Call | None":
        """The concat of a tuple `var` is bound to, where nothing but the concat reads each part (a part other
        concats read too, DenseNet's features, would be cast once per reader); else None."""
        concat = self._concat(var)
        if concat is None:
            return None
        return None if any(self.uses.get(part, 0) != 1 for part in concat.args[0].fields) else concat

    def _over_split(self, call: relax.Call, index: int) -> "relax.Expr | None":
        """The output of a split of `call` applied to the split's input, where every output of the split comes to read
        that same op (a mixed conv's channel groups, each cast by AMP for its own conv; a CSP stage's halves, each
        quantized with one range); else None."""
        item = self.value_of.get(call.args[index])
        split_var = item.tuple_value if isinstance(item, relax.TupleGetItem) else None
        split, items = self.value_of.get(split_var), self.items_of.get(split_var, [])
        if call_op_name(split) != SPLIT or self.uses.get(split_var, 0) != len(items) or not all(
                self._takes(output, call, index) for output in items):
            return None
        if split_var not in self.applied_splits:
            applied = self._applied(call, index, split.args[0])
            self.applied_splits[split_var] = self.builder_.emit(relax.Call(split.op, [applied], split.attrs))
        return relax.TupleGetItem(self.applied_splits[split_var], item.index)

    def _cast_only(self, var: relax.Var, dtype: str) -> bool:
        """Whether every reader of `var` is a narrowing cast to `dtype`."""
        return self.cast_dtypes.get(var, []) == [dtype] * self.uses.get(var, 0)


def _narrowing_casts_reading(value_of: dict[relax.Var, relax.Expr]) -> dict[relax.Var, list[str]]:
    """For each var, the dtypes of the narrowing casts that read it, one per cast."""
    dtypes: dict[relax.Var, list[str]] = {}
    for value in value_of.values():
        if call_op_name(value) == "relax.astype" and _narrowing_cast(value) and isinstance(value.args[0], relax.Var):
            dtypes.setdefault(value.args[0], []).append(tensor_dtype(value))
    return dtypes


@tvm.transform.module_pass(opt_level=0, name="relay_amp.HoistOverMoves")
class HoistOverMoves:
    """Move narrowing casts (to 8-bit codes too), ops by a scalar constant and activations before the reshapes,
    transposes, slices and nearest-neighbour resizes they follow, before max pools where they never decrease, and
    into the parts of a concat; narrowing casts also before the ReLUs and constant pads between them and a move."""

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
            if hoister.duplicated:  # the op's copies a move made (a pool's input read by the op beside it): one
                rewritten = relax.transform.CanonicalizeBindings()(relax.transform.EliminateCommonSubexpr()(rewritten))
            hoisted = EliminateDeadCode([self.func])(rewritten)


def hoist_over_moves(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """Functional form of HoistOverMoves."""
    return HoistOverMoves(func)(mod)
