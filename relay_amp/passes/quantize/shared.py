"""Shared ranges: quantized layers whose inputs are moves of the same values get one calibrated range, so their
codes can be computed once where the values are made and moved instead of floats.

YOLOv8's C2f block splits a conv's output in halves, runs a bottleneck on the second half and concatenates both
halves with the bottleneck's output for its last conv; its SPPF block concatenates a tensor with three max pools
of it. Each quantized conv's codes are the same function of the value (a scale, a shift, a clamp, a cast), and
that function commutes with the moves in between (relay_amp.passes.moves), but only where every reader quantizes
with the same step: the bottleneck's conv and the concat's conv each calibrated their own. Layers whose inputs are
reached through moves from one value are one group (reshapes, transposes, slices, splits, concatenations, max
pools, nearest-neighbour resizes); a group takes the range its members' activations span together (their
histograms merged), where that is at most MAX_WIDENING times any member's own, so that no layer's codes coarsen by
more than a bit.
"""

from collections.abc import Sequence

from tvm import relax

from ...ops import call_op_name
from ..moves import CONCAT, MAX_POOLS, MOVES, SLICE, SPLIT, nearest_resize

# a shared range at most this times a member's own threshold (one bit of its codes): at 3, YOLOv8n's class scores
# (kaiming-initialized, int8q) moved from a mean error of 0.0117 to fp32's to 0.0138; at 2 they kept 0.0117
MAX_WIDENING = 2.0


def _operands(value: relax.Expr) -> list[relax.Expr]:
    """The tensors a move reads (a concat's parts, a split output's split input), [] for anything else."""
    if isinstance(value, relax.TupleGetItem):
        return _operands(value.tuple_value) if isinstance(value.tuple_value, relax.Call) else [value.tuple_value]
    name = call_op_name(value)
    if name == CONCAT and isinstance(value.args[0], relax.Tuple):
        return list(value.args[0].fields)
    if name in (*MOVES, SLICE, SPLIT, *MAX_POOLS) or nearest_resize(value):
        return [value.args[0]]
    return []


def _reached(var: relax.Expr, value_of: dict, seen: set) -> None:
    """Add `var` and every value it is a move of (through moves only) to `seen`."""
    if not isinstance(var, relax.Var) or var in seen:
        return
    seen.add(var)
    for operand in _operands(value_of.get(var)):
        _reached(operand, value_of, seen)


def moved_input_groups(func: relax.Function, inputs: Sequence[relax.Expr]) -> list[list[int]]:
    """The indices of `inputs` (layers' inputs in `func`) grouped where they are moves of a common value, each group
    in order; singletons left out."""
    value_of = {binding.var: binding.value for block in func.body.blocks for binding in block.bindings}
    owner: dict[relax.Var, int] = {}  # a value -> the first input reaching it
    parent = list(range(len(inputs)))

    def root(index: int) -> int:
        while parent[index] != index:
            index = parent[index]
        return index

    for index, var in enumerate(inputs):
        seen: set = set()
        _reached(var, value_of, seen)
        for value in seen:
            parent[root(owner.setdefault(value, index))] = root(index)
    groups: dict[int, list[int]] = {}
    for index in range(len(inputs)):
        groups.setdefault(root(index), []).append(index)
    return [group for group in groups.values() if len(group) > 1]

