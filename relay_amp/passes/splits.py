"""SplitsAsSlices: each part of a split as a strided slice of the split's input, so the part's reader takes it in.

TVM fuses no op into the readers of a tuple, so a split is a function of its own that copies every part out of its
input before anything reads one: LeViT's and GPT-2's attention split the query, key and value projections' one
product into three tensors, which the next functions then transpose into heads (a second copy of each). A strided
slice is injective, so fusion moves it into the function that reads the part (the transpose into heads, a
gate's multiply), which reads the input in place. A part that a kernel reads is still copied, by its slice's own
function instead of the split's. A split read as a whole (not only part by part) is left as it is.
"""

import tvm
from tvm import relax

from .._ir import get_function, read_counts, rewrite_function, slice_window, split_part_bounds, tensor_shape
from .._dead_code import EliminateDeadCode
from ..ops import bound_call, call_op_name

SPLIT = "relax.split"


def _read_only_by_parts(func: relax.Function) -> set[relax.Var]:
    """The vars bound to splits with static part extents that nothing reads but TupleGetItems."""
    splits, items = set(), {}
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if call_op_name(value) == SPLIT and split_part_bounds(value) is not None:
                splits.add(binding.var)
            elif isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
                items[value.tuple_value] = items.get(value.tuple_value, 0) + 1
    reads = read_counts(func)
    return {var for var in splits if items.get(var, 0) == reads.get(var, 0)}


@relax.expr_functor.mutator
class _PartsAsSlices(relax.PyExprMutator):
    """Replaces each TupleGetItem of an eligible split by a strided slice of the split's input."""

    def __init__(self, mod: tvm.IRModule, splits: set[relax.Var]):
        super().__init__(mod)
        self.splits = splits

    def visit_tuple_getitem_(self, item: relax.TupleGetItem) -> relax.Expr:
        if item.tuple_value not in self.splits:
            return super().visit_tuple_getitem_(item)
        split = self.lookup_binding(self.visit_expr(item.tuple_value))
        begin, end = split_part_bounds(split)[item.index]
        axis = int(split.attrs.axis) % len(tensor_shape(split.args[0]))
        source, offset = self._unsliced(split.args[0], axis)
        return relax.op.strided_slice(source, axes=[axis], begin=[offset + begin], end=[offset + end])

    def _unsliced(self, data: relax.Expr, axis: int) -> tuple[relax.Expr, int]:
        """(what `data` is a slice of, where it starts on `axis`) where `data` is a unit-step slice along `axis`
        only (a kernel result's padding channels sliced off), else (`data`, 0): a part then slices the source once."""
        inner = bound_call(self, data, "relax.strided_slice")
        window = None if inner is None else slice_window(inner)
        if window is None:
            return data, 0
        source_shape = tensor_shape(inner.args[0])
        if any(window[0][i] != 0 or window[1][i] != source_shape[i] for i in range(len(source_shape)) if i != axis):
            return data, 0
        return inner.args[0], window[0][axis]


def splits_as_slices(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` with each split of `func` that is read only part by part replaced by a strided slice per part."""
    splits = _read_only_by_parts(get_function(mod, func))
    if not splits:
        return mod
    return EliminateDeadCode([func])(rewrite_function(_PartsAsSlices(mod, splits), mod, func))


@tvm.transform.module_pass(opt_level=0, name="relay_amp.SplitsAsSlices")
class SplitsAsSlices:
    """Rewrite the splits read only part by part into one strided slice per part (see `splits_as_slices`)."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return splits_as_slices(mod, self.func)
