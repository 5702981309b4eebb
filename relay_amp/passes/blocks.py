"""Long dataflow blocks cut into pieces, and adjacent ones joined again: for TVM passes whose cost grows with the
square of a block's length (ConvertLayout copies its map of every binding's layout at each call)."""

import tvm
from tvm import relax

from .._bodies import with_blocks, with_function
from .._ir import get_function

BLOCK_LIMIT = 2048  # bindings per piece: TVM's ConvertLayout takes about 0.6 s for a block this long


def blocks_cut(mod: tvm.IRModule, func: str = "main", limit: int = BLOCK_LIMIT) -> tvm.IRModule:
    """`mod` with each dataflow block of `func` longer than `limit` cut into pieces of at most `limit` bindings,
    each cut where the fewest values cross it; a dataflow value read past a cut is handed over by a binding of a
    new non-dataflow var to it at the end of its piece."""
    function = get_function(mod, func)
    if not isinstance(function.body, relax.SeqExpr) or all(len(b.bindings) <= limit for b in function.body.blocks):
        return mod
    mutator = _Remapper(mod)
    blocks = [piece for block in function.body.blocks for piece in _pieces(block, limit, mutator)]
    return with_function(mod, func, with_blocks(function, blocks))  # only dataflow vars are handed over


def blocks_joined(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` with adjacent dataflow blocks of `func` joined into one (the hand-over vars stay block outputs)."""
    function = get_function(mod, func)
    if not isinstance(function.body, relax.SeqExpr):
        return mod
    joined = []
    for block in function.body.blocks:
        if joined and isinstance(block, relax.DataflowBlock) and isinstance(joined[-1], relax.DataflowBlock):
            joined[-1] = relax.DataflowBlock(list(joined[-1].bindings) + list(block.bindings))
        else:
            joined.append(block)
    if len(joined) == len(function.body.blocks):
        return mod
    return with_function(mod, func, with_blocks(function, joined))


@relax.expr_functor.mutator
class _Remapper(relax.PyExprMutator):
    """Replaces the dataflow vars handed over at earlier cuts by their hand-over vars (the walk runs in C++)."""


def _pieces(block: relax.BindingBlock, limit: int, mutator: _Remapper) -> list[relax.BindingBlock]:
    """`block` (its reads of earlier hand-overs remapped) cut into pieces of at most `limit` bindings."""
    bindings = list(block.bindings)
    if not isinstance(block, relax.DataflowBlock) or len(bindings) <= limit:
        return [mutator.visit_binding_block(block)]
    last_reads = _last_reads(bindings)
    lasts = list(last_reads.values())  # by position, for the cuts
    pieces, start = [], 0
    while start < len(bindings):
        end = len(bindings) if len(bindings) - start <= limit else _cut(lasts, start, limit)
        pieces.append(_piece(bindings[start:end], last_reads, end, mutator))
        start = end
    return pieces


def _last_reads(bindings: list) -> dict:
    """For each var bound in `bindings` (in order), the index of the last binding that reads it if it is a dataflow
    var read after its own; else its own index (non-dataflow vars need no hand-over)."""
    last = {}
    for index, binding in enumerate(bindings):
        for var in relax.analysis.used_vars(binding.value):
            last[var] = index
    return {binding.var: last.get(binding.var, index) if isinstance(binding.var, relax.DataflowVar) else index
            for index, binding in enumerate(bindings)}


def _cut(lasts: list, start: int, limit: int) -> int:
    """The index in (start + limit / 2, start + limit] before which the fewest vars bound from `start` on are read
    (the latest of equals); `lasts` holds each binding's last read by position (_last_reads)."""
    change = [0] * (limit + 2)  # crossing(start + k) = sum(change[:k + 1])
    for position, last in enumerate(lasts[start:start + limit], start):
        if last > position:
            change[position - start + 1] += 1
            change[min(last, start + limit) - start + 1] -= 1
    crossing, best = 0, None
    for offset in range(1, limit + 1):
        crossing += change[offset]
        if offset > limit // 2 and (best is None or crossing <= best[0]):
            best = (crossing, start + offset)
    return best[1]


def _piece(bindings: list, last_reads: dict, end: int, mutator: _Remapper) -> relax.DataflowBlock:
    """A dataflow block of `bindings` (earlier hand-overs remapped), handing over its dataflow vars read from `end`
    on; later reads of them are remapped to the hand-overs."""
    piece = mutator.visit_binding_block(relax.DataflowBlock(bindings))
    handed = [binding.var for binding in bindings if last_reads[binding.var] >= end]
    handovers = [relax.VarBinding(relax.Var(var.name, var.ty), var) for var in handed]
    for handover in handovers:
        mutator.set_var_remap(handover.value, handover.var)
    return relax.DataflowBlock(list(piece.bindings) + handovers)
