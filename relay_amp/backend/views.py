"""views: reshapes made views of the tensors they reshape, the function's own output's too; takes of one
index that select a contiguous block made views of it.

TVM's RewriteDataflowReshape makes reshapes of dataflow values views (`vm.builtin.reshape`) and leaves the ones
bound to a dataflow block's outputs as copies. A model whose output comes straight from a kernel (a classifier's
or a language model's logits: the kernel computes them as pixels of a 1x1 conv, its result reshaped back) then
copies them once more (a 128-token prefill's logits over a 32000-word vocabulary: 8.14 -> 7.59 ms in bf16).
The view is safe where the reshaped tensor is computed in the block and read by nothing else: TVM's memory
planner gives a returned tensor storage of its own, and it follows a reshape to the tensor it views.

Both run before any schedule: TVM tells a reshape by its PrimFunc's unscheduled pattern, and relay_amp's
schedules (a row of 50257 channels split into whole vectors and a serial rest) hide it.

A take of one index along a tensor's outermost axis past extent 1 selects a contiguous block of it: an
unrolled recurrence's step reads its row of the input projection computed for all steps at once (a take each
step), and TVM copied each row out in a function of its own before the step's kernel read it.
ContiguousTakesAsViews makes such a block a view (`relax.memory.view` at the block's byte offset, moved into the
data pointer by `ensure_zero_offset`, since TVM's functions take tensors at offset 0). TVM's memory planner keeps
the viewed tensor's storage while the view is read. A block that starts off a VIEW_ALIGNMENT boundary stays a
copy: TVM allocates tensors on it, and its functions may load them assuming so.
"""

import numpy as np
import tvm
from tvm import relax

from .._ir import calls_any_op, is_scalar_constant, is_static_shape, rewrite_function, rewrite_op_calls, tensor_shape

TAKE = "relax.take"
VIEW_ALIGNMENT = 64  # bytes: TVM's allocation alignment (kAllocAlignment)


@relax.expr_functor.mutator
class _OutputViewer(relax.PyExprMutator):
    """Rebinds each dataflow block output that is a reshape PrimFunc's call on a tensor computed in the block and
    read by nothing else as `relax.reshape` of it."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        self.computed: set[relax.Var] = set()  # the block's call_tir results
        self.readers: dict[relax.Var, list] = {}

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        self.readers = {var: list(users) for var, users in relax.analysis.udchain(block).items()}
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if _calls_tir(binding.value):
            self.computed.add(binding.var)
        viewed = self._viewed(binding)
        if viewed is None:
            super().visit_var_binding_(binding)
            return
        view = relax.op.reshape(self.visit_expr(viewed), binding.var.ty.shape)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(view)))

    def _viewed(self, binding: relax.VarBinding) -> "relax.Var | None":
        """The tensor `binding` (a block output) copies by a reshape, where a view of it may stand for the copy."""
        value = binding.value
        if isinstance(binding.var, relax.DataflowVar) or not _calls_tir(value):
            return None
        callee, inputs = self.mod[value.args[0]], value.args[1].fields
        if not isinstance(callee, tvm.tirx.PrimFunc) or len(inputs) != 1:
            return None
        source = inputs[0]
        if not relax.analysis.has_reshape_pattern(callee) or not _same_values(source.ty, binding.var.ty):
            return None  # a strided slice of leading values has a reshape's pattern too
        readers = self.readers.get(source, [])
        if source not in self.computed or len(readers) != 1 or not readers[0].same_as(binding.var):
            return None
        return source


def _calls_tir(value: relax.Expr) -> bool:
    """Whether `value` is a call_tir of a function of the module."""
    return (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.call_tir")
            and isinstance(value.args[0], relax.GlobalVar))


def _same_values(source: relax.TensorType, result: relax.TensorType) -> bool:
    """Whether `result` holds as many values of the same dtype as `source`."""
    if source.dtype != result.dtype or source.shape is None or result.shape is None:
        return False
    count = [tvm.tirx.const(1, "int64")] * 2
    for index, shape in enumerate((source.shape, result.shape)):
        for extent in shape.values:
            count[index] = count[index] * extent
    return tvm.sym.Analyzer().can_prove_equal(*count)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.OutputReshapesAsViews")
class OutputReshapesAsViews:
    """Make each reshape bound to a dataflow block's output a view (`relax.reshape`) of the tensor it reshapes,
    where that tensor is computed in the block and read by nothing else; run before RewriteDataflowReshape."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod` (a module after fusion); the input module is left as it was."""
        if not any(gv.name_hint == self.func for gv in mod.get_global_vars()):
            return mod  # a module of PrimFuncs alone
        return rewrite_function(_OutputViewer(mod), mod, self.func)


def view_passes() -> list[tvm.transform.Pass]:
    """Reshapes made views, dataflow values' (TVM's RewriteDataflowReshape) and outputs' (OutputReshapesAsViews),
    before any schedule: TVM recognizes a reshape by its PrimFunc's unscheduled pattern, which a partitioned or
    vectorized loop nest no longer shows (a reshape of 50257 channels stayed a 1.1 ms copy)."""
    return [relax.transform.RewriteDataflowReshape(), OutputReshapesAsViews()]


@tvm.transform.module_pass(opt_level=0, name="relay_amp.ContiguousTakesAsViews")
class ContiguousTakesAsViews:
    """Rewrite each take of a constant index from a tensor var (not a constant, which folds) that selects a
    contiguous block of it, starting on a VIEW_ALIGNMENT boundary, as a view of it."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        if not calls_any_op(mod, [TAKE]):
            return mod
        return rewrite_op_calls(mod, self.func, {TAKE: _take_view})


def _take_view(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    data, index = call.args[0], call.args[1]
    shape = tensor_shape(data)
    if call.attrs.axis is None or not is_scalar_constant(index) or not _viewable(data, shape):
        return None
    axis = int(call.attrs.axis) % len(shape)
    position = int(index.value.numpy())
    if any(extent != 1 for extent in shape[:axis]) or not 0 <= position < shape[axis]:
        return None  # not contiguous; or out of range, where TVM's take clips or wraps (its mode)
    row_bytes = int(np.prod(shape[axis + 1:], dtype=np.int64)) * tvm.DataType(data.ty.dtype).bits // 8
    if position * row_bytes % VIEW_ALIGNMENT:
        return None
    kept = [*shape[:axis], *shape[axis + 1:]]  # the take's shape: the unit axes before `axis` stay
    view = builder.emit(relax.op.memory.view(data, kept, str(data.ty.dtype), position * row_bytes))
    return relax.op.memory.ensure_zero_offset(view)


def _viewable(data: relax.Expr, shape: "tuple | None") -> bool:
    """Whether `data` is a tensor var of a static shape and a whole-byte dtype."""
    return (isinstance(data, relax.Var) and bool(shape) and is_static_shape(shape)
            and tvm.DataType(data.ty.dtype).bits % 8 == 0)
