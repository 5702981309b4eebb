"""schedules: rule-based CPU schedules for operators no tuning record covers (dlight-style, no search).

TVM 0.27 ships no default CPU schedule for matmul or convolution, so an untuned build runs them as
scalar, single-threaded loop nests. `ContractionRule` schedules every contraction (a reduction
block reading two or more tensors: matmul, batch matmul, dense, conv; and pooling windows) as a register-blocked,
vectorized, parallel loop nest; `ElementwiseRule` parallelizes and vectorizes elementwise functions within
their rows; `RowReductionRule` runs row reductions (softmax, layer norm, RMS norm) one parallel row at a time with
vector partial sums; `ColumnReductionRule` runs reductions over outer or middle axes (NHWC global pooling, a softmax
over NHWC's W) by vectors of the kept innermost axis.
"""

import bisect
import itertools
import math
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func

from ..._ir import conjuncts, index_vars, reads_var, try_primitive, vars_in
from . import cores
from .bf16_round import PAIR_LANES

MAX_WINDOW = 64  # single-tensor reductions up to this size (pooling windows) are scheduled like contractions
MAX_WINDOW_TAPS = 1024  # a reduction over a window alone (a depthwise conv's, up to 31x31) reads its input in place
MAX_WINDOW_ROW = 32  # a window's row (ConvNeXt's 7 taps, MixNet's 9 and 11, RepLKNet's 31) unrolled with the outputs
CACHE_BYTES = 512 * 1024  # operand data a cache tile keeps in reach: a share of a core's L2
MAX_ACCUMULATORS = 16  # zmm registers holding accumulators, of the 32; the rest hold operands
STACK_BYTES = 1024  # TVM allocates a CPU buffer on the stack (where LLVM can keep it in registers) only below this
ACCUMULATOR_LANES = 16  # fp32 lanes per zmm; bf16/int8 contractions accumulate in 32-bit lanes too
MIN_LANES = 8  # an output axis vectorizing by fewer lanes than this is padded to whole vectors
MAX_GROUP_LANES = 256  # a row read in contiguous groups up to this long, or a piece of a concatenated run: one vector
MAX_INLINED_NODES = 32768  # a block whose stored value has more expression nodes is not inlined further
ARITHMETIC = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div)  # not a cast, a pad's select or a concat's
BROADCAST_RATIO = 8  # a block writing this many times fewer values than its function's output is broadcast
MIN_PARALLEL_VALUES = 4096  # a spatial block writing fewer values runs serially (a pool launch costs more)
PARTIAL_VECTORS = 4  # a row reduction adds its values into this many vectors of partial results, where they divide
# (a column reduction, into this many chains of vectors a core)
DEFAULT_PARTS = 8  # runs a column reduction splits its pixels into where the target names no core count
MIN_CHAIN = 8  # the fewest positions a column reduction's chain of vector adds sums
PARALLEL_TILES = 16  # a contraction's parallel loop gets at least this many tiles where its rows allow: a cache
# tile over all of a 1-D conv's 2000 outputs left one tile, and one core computing it


@dataclass(frozen=True)
class _Contraction:
    """The loops of a contraction block, by role."""
    block: s_tir.schedule.SBlockRV
    spatial: list
    reduction: list
    vector_index: int
    register_index: int | None
    vector_var: tirx.Var  # the block iterator of the output's innermost axis


def _is_cpu(target: tvm.target.Target) -> bool:
    return target.kind.name == "llvm"


def _extent(sch: s_tir.Schedule, loop) -> int | None:
    return _const(sch.get(loop).extent) or None


def _const(extent) -> int:
    """The extent as an int, or 0 when it is symbolic."""
    if isinstance(extent, int):
        return extent
    return int(extent) if isinstance(extent, tirx.IntImm) else 0


def _vector_factor(extent: int) -> int:
    """Lanes to vectorize an output axis by: whole registers where they divide `extent`, else one partial one.

    A divisor keeps the vector loop free of tail predicates, which TVM's vectorizer would scalarize.
    """
    for lanes in (2 * ACCUMULATOR_LANES, ACCUMULATOR_LANES, ACCUMULATOR_LANES // 2):
        if extent % lanes == 0:
            return lanes
    return largest_divisor(extent, ACCUMULATOR_LANES)


def largest_divisor(extent: int, limit: int) -> int:
    """The largest divisor of `extent` that is at most `limit` (1 when `limit` is below 1)."""
    return max((d for d in range(1, min(extent, limit) + 1) if extent % d == 0), default=1)


def _register_factor(extent: int, vector_lanes: int) -> int:
    """Rows of accumulators: the most that divide `extent`, fit MAX_ACCUMULATORS registers and stay under STACK_BYTES."""
    registers_per_row = -(-vector_lanes // ACCUMULATOR_LANES)
    limit = min(MAX_ACCUMULATORS // registers_per_row, (STACK_BYTES - 1) // (4 * vector_lanes))
    return largest_divisor(extent, limit)


def _find_contraction(sch: s_tir.Schedule, infos) -> _Contraction | None:
    reductions = [info for info in infos if info.is_reduction()]
    if len(reductions) != 1:
        return None
    info = reductions[0]
    block = sch.get(info.block_rv)
    if any(it.kind not in "SR" for it in info.iters):
        return None
    spatial = [it for it in info.iters if it.kind == "S"]
    reduction = [it for it in info.iters if it.kind == "R"]
    if len(block.reads) < 2 and math.prod(_const(it.dom) for it in reduction) > MAX_WINDOW:
        return None  # a long single-tensor reduction (sum, mean): TVM's CPU reduction rule suits it better
    out_vars = [vars_in(index.min) for index in block.writes[0].region]
    if not spatial or not out_vars or not out_vars[-1]:
        return None
    vector_var = out_vars[-1][0]
    vector_index = next((i for i, it in enumerate(spatial) if it.var.same_as(vector_var)), None)
    if vector_index is None or not _const(spatial[vector_index].dom):
        return None  # no output axis to vectorize, or a symbolic one
    streamed = [index_vars(read) for read in block.reads if any(v.same_as(vector_var) for v in index_vars(read))]
    # a register row must leave one streamed operand to share: a matmul's B, a depthwise conv's weight
    candidates = [i for i, it in enumerate(spatial) if i != vector_index and _const(it.dom) > 1
                  and not all(any(v.same_as(it.var) for v in used) for used in streamed)]
    register_index = max(candidates, key=lambda i: (_const(spatial[i].dom), i)) if candidates else None
    return _Contraction(info.block_rv, [it.loop_rv for it in spatial], [it.loop_rv for it in reduction],
                        vector_index, register_index, vector_var)


class _CpuRule(dl.ScheduleRule):
    """A rule for llvm targets that works on the normalized blocks of a PrimFunc."""

    def is_target_available(self, target: tvm.target.Target) -> bool:
        """Whether the rule applies to `target` (CPU targets only)."""
        return _is_cpu(target)

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _: bool) -> s_tir.Schedule | None:
        """The scheduled function, or None where the rule does not apply."""
        if not isinstance(func, tirx.PrimFunc) or not _is_cpu(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos:
            return None
        try:
            with target:  # the rules' choices that follow the target's cores (cores.target_cores) read it so
                return self.schedule(sch, infos)
        except tvm.error.InternalError:  # a TVM primitive failed on an unusual block: the next rule takes it
            return None

    def schedule(self, sch: s_tir.Schedule, infos: list) -> s_tir.Schedule | None:
        """Schedule the normalized blocks `infos` of `sch`, or return None."""
        raise NotImplementedError


class ContractionRule(_CpuRule):
    """Register-blocked, vectorized, parallel schedule for a matmul/conv-like block and its epilogue."""

    def schedule(self, sch: s_tir.Schedule, infos: list) -> s_tir.Schedule | None:
        """Schedule a function holding exactly one contraction block, else None."""
        found = _find_contraction(sch, infos)
        if found is None:
            return None
        if _pad_to_vectors(sch, found):
            found = _find_contraction(sch, normalize_prim_func(sch))
            if found is None:
                return None
        producers = _unless_inlined_window_padding(sch, found.block)
        _inline_epilogue_operands(sch, found.block)
        _inline_epilogue(sch, found.block)
        consumer_names = {sch.get(block).name_hint for block in sch.get_consumers(found.block)}  # a pad of the output
        _tile(sch, found)  # which inlines what it can of them into its write-back
        leftover = [block for block in sch.get_child_blocks(sch.get_sblock("root"))
                    if sch.get(block).name_hint in consumer_names and _is_spatial(sch.get(block))]
        for block in [*producers, *leftover]:
            schedule_injective(sch, block)
        return sch


def _is_spatial(block: s_tir.SBlock) -> bool:
    """Whether `block` reduces over nothing."""
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars)


def _pad_to_vectors(sch: s_tir.Schedule, found: _Contraction) -> bool:
    """Pad the output axis to whole vectors where its extent has no divisor of at least MIN_LANES (197 tokens),
    the operands copied into zero-padded buffers and the result trimmed on the way out; True when it padded."""
    extent = _extent(sch, found.spatial[found.vector_index])
    if extent is None or _vector_factor(extent) >= MIN_LANES:
        return False
    factors = [ACCUMULATOR_LANES if iv.var.same_as(found.vector_var) else 1 for iv in sch.get(found.block).iter_vars]
    return try_primitive(lambda block: sch.pad_einsum(block, factors), found.block)


def _unless_inlined_window_padding(sch: s_tir.Schedule, block) -> list:
    """`block`'s producers, less the padding of a window's input (a pool's, a depthwise conv's:
    `_slides_small_window`), inlined into the window's loads: a window reads each input a few times from
    registers' reach, so a padded copy of the input costs a pass over memory and a barrier more than it saves. A
    convolution that reduces over channels keeps its padded copy: it reads it once per output-channel tile."""
    producers = sch.get_producers(block)
    outputs = [region.source for region in sch.get(block).writes]
    inputs = [region for region in sch.get(block).reads if not any(region.source.same_as(out) for out in outputs)]
    if len(inputs) != 1 and not _slides_small_window(sch.get(block)):
        return producers
    return [producer for producer in producers if not try_primitive(sch.compute_inline, producer)]


def _slides_small_window(block: s_tir.SBlock) -> bool:
    """Whether `block` reduces along a window that slides with its outputs (neighbouring outputs' windows
    overlap: `_overlapping`), over at most MAX_WINDOW_TAPS values where the window is all it reduces (a pool's, a
    depthwise conv's: MixNet's 9x9 convs stored a padded copy and looped over each tap, 65 us against 8 now), else
    MAX_WINDOW (a conv's over very few channels); not a matmul's."""
    reduced = {iv.var: _const(iv.dom.extent) for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    spatial = {iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar}
    sliding = set().union(*(_overlapping(index.min, spatial, reduced) for read in block.reads for index in read.region))
    if not sliding:
        return False
    limit = MAX_WINDOW_TAPS if sliding == set(reduced) else MAX_WINDOW
    return math.prod(reduced.values()) <= limit


def _overlapping(index, spatial: set, reduced: dict) -> set:
    """The reduction vars along which the windows of neighbouring outputs overlap in `index`: a conv's
    y * stride + ry * dilation, where the stride is below the window's span; not a flattened index (i * 16 + k
    over k < 16, a matmul's operand reshaped in its function), nor a patch embedding's (stride = kernel)."""
    used = vars_in(index)
    outputs, windows = [v for v in used if v in spatial], [v for v in used if v in reduced]
    coefficients = tvm.sym.detect_linear_equation(index, [*outputs, *windows]) if outputs and windows else []
    if not coefficients:
        return set()
    strides = [abs(_const(c)) for c in coefficients[:len(outputs)]]
    steps = [abs(_const(c)) for c in coefficients[len(outputs):-1]]
    return {var for var, step in zip(windows, steps) if any(0 < stride < step * reduced[var] for stride in strides)}


def _inline_epilogue_operands(sch: s_tir.Schedule, block) -> None:
    """Inline into their readers the spatial blocks that compute an epilogue's other operand apart from the
    contraction (a bf16 residual widened, then sliced to the channels a padded kernel result holds): computed after
    the contraction, they keep the epilogue's add out of its write-back, and run as whole passes of their own."""
    root = sch.get_sblock("root")
    own_inputs = {sch.get(producer).name_hint for producer in sch.get_producers(block)}
    reached = {region.source for region in sch.get(block).writes}  # buffers computed from the contraction's result
    for other in sch.get_child_blocks(root):
        stmt = sch.get(other)
        if stmt.same_as(sch.get(block)) or stmt.name_hint in own_inputs:
            continue
        if any(region.source in reached for region in stmt.reads):
            reached.update(region.source for region in stmt.writes)
        elif _is_spatial(stmt):
            try_primitive(sch.compute_inline, other)


def _inline_epilogue(sch: s_tir.Schedule, block) -> None:
    consumers = sch.get_consumers(block)
    while consumers:
        consumer = consumers[0]
        try:
            sch.compute_inline(consumer)
        except s_tir.ScheduleError:
            break
        consumers = sch.get_consumers(block)


def _tile(sch: s_tir.Schedule, found: _Contraction) -> None:
    """Register tile (rows x lanes), cache tile (whose operands fit in L2), then parallel tiles, outermost first.
    The register tile's write-back is unrolled over its rows: a rolled loop indexed the accumulators by its
    variable, so LLVM stored them to a stack buffer and read them back, one row's epilogue after the other
    (EfficientNet-B0's 3x3 depthwise conv and SiLU over 56x56x144 in bf16: 72 -> 60 us). Its vectors are as wide as
    the accumulating loop's (`_vector_factor`: at most two registers), or 8-lane parts of them under a slice's
    predicate (`_vectorize_predicated`); a kernel's 48-lane rows read as one vector took 24x as long (kernels)."""
    spatial = list(found.spatial)
    depth = math.prod(_extent(sch, loop) or 0 for loop in found.reduction) or None
    vector_lanes = _vector_factor(_extent(sch, spatial[found.vector_index]))
    parallel_v, cached_v, inner_v = _split_twice(sch, spatial[found.vector_index], vector_lanes, depth)
    spatial[found.vector_index] = parallel_v
    cached, inner = [cached_v], [inner_v]
    if found.register_index is not None:
        rows = _register_factor(_extent(sch, spatial[found.register_index]), vector_lanes)
        others = math.prod(_extent(sch, loop) or 1 for i, loop in enumerate(spatial) if i != found.register_index)
        parallel_r, cached_r, inner_r = _split_twice(sch, spatial[found.register_index], rows, depth, share=2,
                                                     tiles=-(-PARALLEL_TILES // others))
        spatial[found.register_index] = parallel_r
        cached.append(cached_r)
        inner.insert(0, inner_r)
    sch.reorder(*spatial, *cached, *found.reduction, *inner)
    cache = sch.cache_write(found.block, 0, "global")
    sch.reverse_compute_at(cache, cached[-1])
    for consumer in sch.get_consumers(cache):
        try_primitive(sch.reverse_compute_inline, consumer)
    sch.parallel(sch.fuse(*spatial))
    if len(inner) == 2:
        sch.unroll(inner[0])
    if _slides_small_window(sch.get(found.block)) and (_extent(sch, found.reduction[-1]) or 0) <= MAX_WINDOW_ROW:
        sch.unroll(found.reduction[-1])  # neighbouring outputs load each input of a window row once, and widen it once
    sch.vectorize(inner[-1])
    copy_loops = _own_loops(sch, cache, found.block)
    if copy_loops:  # a 1x1 register tile leaves the write-back no loop of its own
        _vectorize_predicated(sch, cache, copy_loops[-1])
        for rows in copy_loops[:-1]:
            sch.unroll(rows)
    if found.reduction:
        sch.decompose_reduction(found.block, found.reduction[0])


def _vectorize_predicated(sch: s_tir.Schedule, block, loop) -> None:
    """Vectorize `block`'s innermost `loop`, by 8 lanes where the block's predicate (the channels of a slice it
    stores: 72 of a depthwise conv's 80) tells the lanes of its vectors apart and not those of 8-lane vectors: split
    from the loop, the vectors unrolled. TVM's vectorizer ran a loop whose lanes it tells apart lane by lane:
    GhostNetV2's depthwise conv and sigmoid over 28x28 pixels, its 80 channels sliced to 72, took 0.116 ms in bf16
    (0.023 now) against 0.019 in fp32."""
    extent = _extent(sch, loop) or 0
    if (extent > MIN_LANES and not extent % MIN_LANES and not _lanes_share_predicate(sch, block, loop, extent)
            and _lanes_share_predicate(sch, block, loop, MIN_LANES)):
        vectors, loop = sch.split(loop, [None, MIN_LANES])
        sch.unroll(vectors)
    sch.vectorize(loop)


def _lanes_share_predicate(sch: s_tir.Schedule, block, loop, lanes: int) -> bool:
    """Whether the predicate of `block` (a write-back of a slice) has one value for each `lanes` consecutive
    iterations of its innermost `loop` (from 0), over the ranges of the other loops around it."""
    var = sch.get(loop).loop_var
    vector, lane = tirx.Var("vector", var.ty), tirx.Var("lane", var.ty)
    analyzer = tvm.sym.Analyzer()
    for outer in (sch.get(other) for other in sch.get_loops(block)):
        if not outer.loop_var.same_as(var):
            analyzer.bind(outer.loop_var, tvm.ir.Range.from_min_extent(outer.min, outer.extent))
    analyzer.bind(vector, tvm.ir.Range(0, (_extent(sch, loop) or lanes) // lanes))
    analyzer.bind(lane, tvm.ir.Range(0, lanes))
    analyzer.bind(var, vector * lanes + lane)
    realize = sch.get(loop).body  # the block's realize: its predicate, in the loops' vars
    predicate = analyzer.simplify(realize.predicate) if isinstance(realize, s_tir.SBlockRealize) else True
    return not reads_var(predicate, lane)


def _own_loops(sch: s_tir.Schedule, block, other) -> list:
    """The loops around `block` that do not also surround `other`."""
    shared = [sch.get(loop) for loop in sch.get_loops(other)]
    return [loop for loop in sch.get_loops(block) if not any(sch.get(loop).same_as(s) for s in shared)]


def _split_twice(sch: s_tir.Schedule, loop, inner: int, depth: int | None, share: int = 1, tiles: int = 1) -> list:
    """Split `loop` into [parallel, cached, inner]: `cached` inner tiles of operand data (depth x inner x 4 bytes
    each) fit in 1/share of CACHE_BYTES, so the cache tile's loops reuse them from L2, and the parallel loop keeps
    at least `tiles` iterations where the extent has them."""
    outer_extent = (_extent(sch, loop) or 0) // inner
    budget = CACHE_BYTES // share // (4 * inner * depth) if depth else 1
    budget = min(budget, max(1, outer_extent // tiles))
    return sch.split(loop, [None, largest_divisor(outer_extent, budget) if outer_extent else 1, inner])


def schedule_injective(sch: s_tir.Schedule, block) -> None:
    """Vectorize a spatial block's innermost axis by whole registers (or halves, see `_row_lanes`), the rest in a
    serial loop where the axis is off them (197 tokens), and run its other loops in parallel. Vectors of a flat index
    would straddle rows there, and TVM computes each lane's address apart (a gather). A block with an innermost
    axis narrower than a register, or no other loop, has its trailing axes fused and vectorized by 16 or 8 lanes
    where no vector crosses a row of the axes inside (`_aligned_suffix`), if it reads its operands in its own
    layout. One that transposes them is vectorized across its narrow axis where it loads an operand at a stride
    along the axis before it (`_vectorize_across_narrow_axis`: a run-time K packing); otherwise (NCHW to NHWC with 3
    channels padded to 4: a model's input) it runs its rows in parallel, each row's pixels in a serial loop and its
    narrow axis unrolled, since a flat vector would gather every lane."""
    loops = sch.get_loops(block)
    if not loops:
        return  # a scalar (a size computed from a symbolic shape)
    row = _extent(sch, loops[-1]) or 0
    values = math.prod(_extent(sch, loop) or MIN_PARALLEL_VALUES for loop in loops)
    if len(loops) > 1 and row >= ACCUMULATOR_LANES:
        _parallel(sch, sch.fuse(*loops[:-1]), values)
        if _vectorize_by_inputs(sch, loops[-1], _input_segments(sch, block, row)):
            return
        group = _contiguous_group(sch, block, row)
        if group:
            sch.vectorize(sch.split(loops[-1], [None, group])[1])
        else:
            _vectorize_whole_vectors(sch, loops[-1], row)
        return
    if len(loops) > 1 and not _reads_in_own_layout(sch, block):
        if not _vectorize_across_narrow_axis(sch, block, loops):
            _parallel(sch, sch.fuse(*loops[:max(1, len(loops) - 2)]), values)  # rows; LLVM vectorizes the serial
            # loop inside
            sch.unroll(loops[-1])
        return
    extents = [_extent(sch, loop) or 0 for loop in loops]
    lanes, start = next(((lanes, start) for lanes in (ACCUMULATOR_LANES, MIN_LANES)
                         if (start := _aligned_suffix(extents, lanes)) is not None), (0, None))
    if start is None:
        _parallel(sch, sch.fuse(*loops), values)
        return
    outer, inner = sch.split(sch.fuse(*loops[start:]), [None, lanes])
    _parallel(sch, sch.fuse(*loops[:start], outer), values)
    sch.vectorize(inner)


def _parallel(sch: s_tir.Schedule, loop, values: int) -> None:
    """Run `loop` on the thread pool where its block writes at least MIN_PARALLEL_VALUES values; a smaller one
    runs serially, in less time than a launch of the pool takes (an LSTM step's gates split four ways: 14.7 us
    in four parallel loops of 256 values)."""
    if values >= MIN_PARALLEL_VALUES:
        sch.parallel(loop)


def _vectorize_across_narrow_axis(sch: s_tir.Schedule, block, loops: list) -> bool:
    """Vectorize a transposing block with a narrow innermost axis along the axis before it, the narrow one unrolled
    outside: a run-time K packing for Q·Kᵀ in bf16 (pairs of channels innermost, 16 tokens before them) loads each
    vector's 16 tokens gathered, and adds, scales and rounds them as one vector. The outer iterations where a
    padding condition holds for every lane run apart from those where it does not (the padded last tokens), since
    TVM computes each lane of a vector loop apart under a condition that varies across it (the padded ones run
    serially: TVM's bf16 legalization also fails on their all-padding vectors). False (nothing done)
    where the axis is off 8-lane vectors, or a condition across the lanes does not fold on one outer axis (an
    image's spatial padding)."""
    stmt = sch.get(block)
    extent = _extent(sch, loops[-2]) or 0
    if len(loops) < 3 or len(stmt.iter_vars) != len(loops) or extent % MIN_LANES:
        return False
    gathered = _gathered_along(stmt, stmt.iter_vars[-2].var)
    if not gathered or any(buffer.dtype == "bfloat16" for buffer in gathered):
        return False  # contiguous loads: LLVM vectorizes the serial loop; TVM cannot store gathered bf16 vectors
    folding = _lane_uniform_range(sch, stmt, loops)
    if folding is None:
        return False
    axis, start, stop = folding
    order = [loops[axis], *(loop for i, loop in enumerate(loops[:-2]) if i != axis), loops[-1], loops[-2]]
    inner = math.prod(_extent(sch, loop) or 1 for loop in order[1:-2])  # iterations of the outer loops per axis value
    edges = [edge * inner for edge in (start, stop) if 0 < edge < (_extent(sch, loops[axis]) or 0)]
    sch.reorder(*order)
    outer = sch.fuse(*order[:-2])
    sch.split(loops[-2], [None, ACCUMULATOR_LANES if extent % ACCUMULATOR_LANES == 0 else MIN_LANES])
    pieces = sch.loop_partition(outer, [*edges, None]) if edges else [outer]
    holding = pieces[1 if start > 0 else 0]
    for piece in pieces:
        piece_loops = sch.get_loops(sch.get_child_blocks(piece)[0]) if edges else sch.get_loops(block)
        sch.parallel(piece_loops[0])
        sch.unroll(piece_loops[-3])
        if piece.same_as(holding):  # the padded pieces stay serial: their vectors would be computed lane by lane
            sch.vectorize(piece_loops[-1])
    return True


def _gathered_along(stmt, lane: tirx.Var) -> list:
    """The buffers the block loads at a stride other than one element along `lane` (or at a stride it cannot
    tell), not the same value or neighbouring ones."""
    return [access.source for access in stmt.reads if _strided_along([dim.min for dim in access.region], lane)]


def _strided_along(indices: list, lane: tirx.Var) -> bool:
    """Whether buffer `indices` step by other than one element as `lane` steps by one."""
    if any(reads_var(index, lane) for index in indices[:-1]):
        return True
    if not indices or not reads_var(indices[-1], lane):
        return False
    coefficients = tvm.sym.detect_linear_equation(indices[-1], [lane])
    return len(coefficients) != 2 or not isinstance(coefficients[0], tirx.IntImm) or coefficients[0].value != 1


def _lane_uniform_range(sch: s_tir.Schedule, stmt, loops: list) -> "tuple[int, int, int] | None":
    """(outer axis, first, last + 1): the values of the one outer axis for which the block's padding condition
    holds across the whole second-to-last (lane) axis, all of them where no condition involves that axis (axis
    0). None where the conditions on the lanes involve no outer axis or several, or the values are not one run."""
    lane = stmt.iter_vars[-2].var
    terms = [term for term in _condition_terms(stmt.body) if reads_var(term, lane)]
    if not terms:
        return 0, 0, _extent(sch, loops[0]) or 0
    others = [v for term in terms for v in vars_in(term) if not v.same_as(lane)]
    axes = [i for i, iv in enumerate(stmt.iter_vars[:-2]) if any(iv.var.same_as(v) for v in others)]
    if len(axes) != 1 or not all(v.same_as(stmt.iter_vars[axes[0]].var) for v in others):
        return None
    axis, condition, lanes = axes[0], tirx.all(*terms), _extent(sch, loops[-2])
    holding = [value for value in range(_extent(sch, loops[axis]) or 0)
               if _holds_across(condition, lane, lanes, stmt.iter_vars[axis].var, value)]
    if not holding or holding != list(range(holding[0], holding[-1] + 1)):
        return None
    return axis, holding[0], holding[-1] + 1


def _holds_across(condition, lane: tirx.Var, lanes: int, axis: tirx.Var, value: int) -> bool:
    """Whether `condition` holds for every `lane` below `lanes` where `axis` is `value`."""
    analyzer = tvm.sym.Analyzer()
    analyzer.bind(lane, tvm.ir.Range(0, lanes))
    analyzer.bind(axis, tirx.const(value, str(axis.ty)))
    return analyzer.can_prove(condition)


def _condition_terms(store) -> list:
    """The conjuncts of every if_then_else condition in a block's stored value (topi's padding conditions)."""
    terms = []
    for node in _subexpressions(store.value if isinstance(store, tirx.BufferStore) else None):
        if isinstance(node, tvm.ir.expr.Call) and node.op.name == "prim.if_then_else":
            terms.extend(conjuncts(node.args[0]))
    return terms


def _subexpressions(expr) -> list:
    """`expr` and every expression in it (through calls, arithmetic, casts and selects)."""
    found, pending = [], [expr] if expr is not None else []
    while pending:
        node = pending.pop()
        found.append(node)
        pending.extend(_operands(node))
    return found


def _operands(node) -> list:
    """The expressions a TIR expression node computes from: a call's arguments, an operator's, cast's or select's
    operands (not a load's indices)."""
    fields = _OPERAND_FIELDS.get(type(node))
    if fields is None:  # the first node of its type: which of its fields hold expressions
        fields = _OPERAND_FIELDS[type(node)] = ("args",) if isinstance(node, tvm.ir.expr.Call) else tuple(
            name for name in ("a", "b", "value", "condition", "true_value", "false_value")
            if isinstance(getattr(node, name, None), tvm.ir.expr.Expr))
    return list(node.args) if fields == ("args",) else [getattr(node, name) for name in fields]


_OPERAND_FIELDS: dict[type, tuple] = {}  # a TIR expression type -> the fields _operands reads (isinstance of an
# abstract class costs more than the rest of a walk over an inlined function's values)


def _input_segments(sch: s_tir.Schedule, block, row: int) -> list[int]:
    """The lengths of the runs of the innermost axis over which `block` reads one input of a concatenation along it
    (topi's if_then_else(start <= c, next input, ...) chain; c as the arithmetic simplifies it: a concat fused with a
    split into heads of 8 reads c // 8 * 8 + c % 8), or along an axis a reshape merges into it (start <= c // k: a
    bidirectional recurrence's directions, joined and flattened into the row), else [row]. Each run is a loop of
    its own, where the conditions fold away: vectorized over the whole row, every lane evaluated the chain and loaded
    its input apart (DenseNet-121's concatenations of 13-32 inputs, each fused with a batch norm and a ReLU: 13 of
    45 ms)."""
    stmt = sch.get(block)
    if not isinstance(stmt.body, tvm.tirx.BufferStore):
        return [row]
    axis, starts, analyzer = stmt.iter_vars[-1].var, set(), tvm.sym.Analyzer()
    for node in _subexpressions(stmt.body.value):
        if isinstance(node, tvm.ir.expr.Call) and node.op.name == "prim.if_then_else":
            condition = node.args[0]
            step = _run_step(analyzer.simplify(condition.b), axis) if isinstance(condition, tirx.LE) else None
            if step and isinstance(condition.a, tirx.IntImm) and 0 < condition.a.value * step < row:
                starts.add(int(condition.a.value) * step)
    edges = [0, *sorted(starts), row]
    return [end - start for start, end in zip(edges, edges[1:])]


def _run_step(bound, axis: tirx.Var) -> "int | None":
    """k where `bound` is `axis // k` (1 where it is `axis` itself): a condition `start <= bound` holds from
    `axis` = start * k on; None for any other bound."""
    if bound.same_as(axis):
        return 1
    if isinstance(bound, tirx.FloorDiv) and bound.a.same_as(axis) and isinstance(bound.b, tirx.IntImm):
        return int(bound.b.value) if bound.b.value > 0 else None
    return None


def _contiguous_group(sch: s_tir.Schedule, block, row: int) -> "int | None":
    """The length of the groups of the innermost axis that `block` reads contiguously from every operand it loads
    off its own index, where that divides `row`, 8-lane vectors cross the groups' edges, and a group is at most
    MAX_GROUP_LANES long; else None. A compaction of padded groups: MixNet's residual add reads channel c of its 40 at
    c // 20 * 32 + c % 20 of a grouped kernel's result, and the 8-lane vector straddling the two groups loaded each
    lane apart (13 us in bf16, against 2 us a group at a time)."""
    stmt = sch.get(block)
    if not isinstance(stmt.body, tirx.BufferStore):
        return None
    axis = stmt.iter_vars[-1].var
    loads = [node.indices for node in _subexpressions(stmt.body.value) if isinstance(node, tvm.ir.expr.TensorLoad)
             and any(reads_var(index, axis) for index in node.indices)]
    jumping = [indices for indices in loads if _strided_along(list(indices), axis)]
    divisors = {int(node.b.value) for indices in jumping for index in indices for node in _subexpressions(index)
                if isinstance(node, (tirx.FloorDiv, tirx.FloorMod)) and isinstance(node.b, tirx.IntImm)}
    groups = sorted((d for d in divisors if MIN_LANES <= d <= MAX_GROUP_LANES and d < row and not row % d
                     and d % MIN_LANES), reverse=True)
    return next((group for group in groups if all(_contiguous_within(indices, axis, group, row)
                                                   for indices in jumping)), None) if jumping else None


def _contiguous_within(indices: list, axis: tirx.Var, group: int, row: int) -> bool:
    """Whether `indices` address consecutive elements as `axis` steps within each group of `group` of its `row`
    values (and the same element of the outer axes)."""
    outer, inner = tirx.Var("group", axis.ty), tirx.Var("lane", axis.ty)
    analyzer = tvm.sym.Analyzer()
    analyzer.bind(outer, tvm.ir.Range(0, row // group))
    analyzer.bind(inner, tvm.ir.Range(0, group))
    analyzer.bind(axis, outer * group + inner)
    return not _strided_along([analyzer.simplify(index) for index in indices], inner)


def _vectorize_by_inputs(sch: s_tir.Schedule, loop, segments: list[int]) -> bool:
    """Vectorize a row loop whose runs of `segments` read one input each (`_input_segments`): the vectors of each
    run in a loop of their own, where the conditions fold. Runs made of 16-lane vectors (DenseNet's 32 channels)
    take a loop of them; runs off those, all at least 8 long, each take one vector of its own length, in pieces of
    at most MAX_GROUP_LANES (`_run_pieces`), which LLVM computes in 16-lane registers and one narrower rest:
    GhostNet's runs of 12, 20, 36 and 60 channels, MixNet's of 120 (in 8-lane vectors, its concatenated SiLU over
    28x28x240 took 0.062 ms in bf16 against 0.033) and 300 (the vectors crossing from one run to the next ran lane
    by lane). Runs shorter than 8 leave 8-lane vectors, those that cross runs serial. False where there is one run,
    or the row is off 8-lane vectors (the row then takes `_vectorize_whole_vectors`)."""
    if len(segments) < 2:
        return False
    off_vectors = any(n % ACCUMULATOR_LANES for n in segments)
    if off_vectors and MIN_LANES <= min(segments):
        for run in sch.loop_partition(loop, [*_run_pieces(segments)[:-1], None]):
            sch.vectorize(sch.get_loops(sch.get_child_blocks(run)[0])[-1])
        return True
    lanes = MIN_LANES if off_vectors else ACCUMULATOR_LANES
    if sum(segments) % lanes:
        return False
    pieces = _vector_pieces(segments, lanes)
    vectors = sch.split(loop, [None, lanes])[0]
    runs = sch.loop_partition(vectors, [*(count for count, _ in pieces[:-1]), None]) if len(pieces) > 1 else [vectors]
    for run, (_, within_one_input) in zip(runs, pieces):
        if within_one_input:
            sch.vectorize(sch.get_loops(sch.get_child_blocks(run)[0])[-1])
    return True


def _run_pieces(segments: list[int]) -> list[int]:
    """`segments`' runs cut into pieces of at most MAX_GROUP_LANES (a multiple of 16 lanes), in order: each piece is
    one vector, a run of 300 two (256 and 44)."""
    return [min(MAX_GROUP_LANES, n - start) for n in segments for start in range(0, n, MAX_GROUP_LANES)]


def _vector_pieces(segments: list[int], lanes: int) -> list[tuple[int, bool]]:
    """The row's vectors of `lanes` in consecutive pieces: (how many vectors, whether they read one input each), a
    piece for each run of `segments`' whole vectors and one for each stretch of vectors that cross runs."""
    edges = list(itertools.accumulate(segments))[:-1]

    def input_read(start: int) -> "int | None":  # the run a vector lies in, None where it crosses an edge
        return None if any(start < edge < start + lanes for edge in edges) else bisect.bisect_right(edges, start)

    return [(len(list(vectors)), run is not None)
            for run, vectors in itertools.groupby(map(input_read, range(0, sum(segments), lanes)))]


def _aligned_suffix(extents: list[int], lanes: int) -> "int | None":
    """The first of the trailing loops whose fused extent splits into vectors of `lanes` that no row boundary of an
    axis inside them crosses, else None. A vector across such a boundary (a 230x230x4 image's rows of 920 values, in
    vectors of 16) makes TVM compute each lane's address apart: 0.17 ms against 0.009 for a 224x224x4 image."""
    inner = 1
    for start in range(len(extents) - 1, -1, -1):
        if not extents[start]:
            return None
        crossed = inner % lanes and lanes % inner  # this axis's rows (`inner` values) straddle vectors
        inner *= extents[start]
        if crossed:
            return None
        if inner % lanes == 0:
            return start
    return None


def _vectorize_whole_vectors(sch: s_tir.Schedule, loop, row: int) -> None:
    """Vectorize a row loop of `row` elements by `_row_lanes`; a row off whole vectors (197 tokens, a depth padded
    to 198) is partitioned first, its whole vectors in one loop and the rest in a serial one: split with a partial
    last vector, the predicate it needs made TVM's vectorizer scalarize every lane of the row."""
    lanes = _row_lanes(row)
    whole = row - row % lanes
    if whole < row:
        loop = sch.loop_partition(loop, [whole, None])[0]
    sch.vectorize(sch.split(loop, [None, lanes])[1])


def _row_lanes(row: int) -> int:
    """Lanes to vectorize a row of `row` elements by: whole 16-lane registers where they divide it, else 8-lane
    halves where those do (24 or 40 channels), else 16 with a serial rest (197 tokens, `_vectorize_whole_vectors`):
    16 lanes over 24 channels would leave a third of the row serial."""
    half = ACCUMULATOR_LANES // 2
    return half if row % ACCUMULATOR_LANES and not row % half else ACCUMULATOR_LANES


def _reads_in_own_layout(sch: s_tir.Schedule, block) -> bool:
    """Whether the block indexes every operand by its own trailing axes, in order (constant indices for broadcast
    axes): a flat index over the block then walks each operand's memory in order."""
    stmt = sch.get(block)
    axes = [it.var for it in stmt.iter_vars]
    for access in stmt.reads:
        indices = [dim.min for dim in access.region]
        trailing = axes[len(axes) - len(indices):] if len(indices) <= len(axes) else None
        if trailing is None or not all(isinstance(index, tirx.IntImm) or index.same_as(axis)
                                       for index, axis in zip(indices, trailing)):
            return False
    return True


class ElementwiseRule(_CpuRule):
    """Parallel, vectorized loops for functions made only of spatial blocks (elementwise, broadcast, layout)."""

    def schedule(self, sch: s_tir.Schedule, infos: list) -> s_tir.Schedule | None:
        """Schedule a function whose blocks are all spatial, else None."""
        if any(info.is_reduction() or any(it.kind != "S" for it in info.iters) for info in infos):
            return None
        broadcast = _broadcast_operands(sch, infos)
        packed = [info for info in _packed_pairs_source(sch, infos) if info not in broadcast]
        remaining = _inline_within_bounds(sch, [info for info in infos if info not in broadcast + packed],
                                          kept=[sch.get(info.block_rv).name_hint for info in packed])
        for info in [*broadcast, *packed, *remaining]:
            schedule_injective(sch, info.block_rv)
        return sch


def _packed_pairs_source(sch: s_tir.Schedule, infos: list) -> list:
    """The last block computing floats in a function that stores bf16 pairs (a runtime operand packed for the
    bf16 kernel, [..., 16, 2]), where one does: it stays a buffer in its own layout, computed in contiguous vectors,
    and the packing reads it as a copy. Inlined, its arithmetic (LLaMA's rotary on the keys) would run in the
    packing's gathered order, in which bf16 loads do not vectorize: element by element, and once per repeated
    head (grouped-query attention)."""
    store = sch.get(infos[-1].block_rv).body
    if not isinstance(store, tirx.BufferStore) or str(store.buffer.dtype) != "bfloat16":
        return []
    if _const(store.buffer.shape[-1]) != 2 or len(store.buffer.shape) < 3:
        return []
    computing = [info for info in infos[:-1] if _computes_floats(sch, info.block_rv) and any(
        isinstance(node, ARITHMETIC) for node in _subexpressions(sch.get(info.block_rv).body.value))]
    return computing[-1:]


def _inline_within_bounds(sch: s_tir.Schedule, infos: list, kept: "list[str]" = ()) -> list:
    """Inline blocks into their consumers (else their consumers into them, but not into the blocks named in
    `kept`) while TIR allows it, as dlight's try_inline does, except a block whose stored value has grown past
    MAX_INLINED_NODES: it stays a buffer. A chain of reshapes that alternate between two shapes would otherwise
    grow exponentially, each one's floordiv/floormod indices reading the index before it twice. Returns the blocks
    left."""
    remaining, small = list(infos), _SmallValues(sch)
    while (inlined := _inline_one(sch, remaining, small, kept)) is not None:
        remaining.pop(inlined)
    return remaining


def _inline_one(sch: s_tir.Schedule, infos: list, small: "_SmallValues", kept: "list[str]") -> "int | None":
    """The position in `infos` of the first block inlined into its consumers, else of the first consumer inlined
    into its producer (not one named in `kept`), each within MAX_INLINED_NODES; None where no block could be."""
    for position, info in enumerate(infos):
        if small([info.block_rv]) and _applies(sch.compute_inline, info.block_rv):
            return position
    for position, info in enumerate(infos):
        producers = sch.get_producers(info.block_rv)
        if any(sch.get(producer).name_hint in kept for producer in producers):
            continue
        if small([info.block_rv, *producers]) and _applies(sch.reverse_compute_inline, info.block_rv):
            return position
    return None


def _applies(inline, block) -> bool:
    """Apply `inline` to `block`; False where TIR refuses it (a ScheduleError) or fails on it, as it does on some
    reverse inlines of broadcast blocks (an InternalError; dlight's try_inline skips every exception alike)."""
    try:
        inline(block)
    except RuntimeError:  # TVM's errors
        return False
    return True


class _SmallValues:
    """Whether blocks of a schedule store values of at most MAX_INLINED_NODES expression nodes, each stored value
    counted once (the inlining loop asks about every block again after each inline)."""

    def __init__(self, sch: s_tir.Schedule):
        self.sch = sch
        self.known = {}  # a stored statement's handle -> (the statement, kept so the handle is not reused; small)

    def __call__(self, blocks: list) -> bool:
        """Whether each of `blocks` stores a small enough value."""
        return all(self._small(self.sch.get(block).body) for block in blocks)

    def _small(self, store) -> bool:
        key = store.__chandle__()
        if key not in self.known:
            self.known[key] = store, _value_nodes(store, MAX_INLINED_NODES + 1) <= MAX_INLINED_NODES
        return self.known[key][1]


def _value_nodes(store, limit: int) -> int:
    """The expression nodes of a block's stored value, its indices included, counted as a tree (a subexpression
    read twice counts twice, as TVM's substitutions copy it) up to `limit`."""
    count, pending = 0, [store.value] if isinstance(store, tirx.BufferStore) else []
    while pending and count < limit:
        node = pending.pop()
        count += 1
        pending.extend([*_operands(node), *getattr(node, "indices", ())])
    return count


def _broadcast_operands(sch: s_tir.Schedule, infos: list) -> list:
    """The blocks that compute BROADCAST_RATIO times fewer values than the function's output and feed a block that
    does not compute such values (a larger block, or a copy that may be inlined into one): inlined, they would be
    computed again for every value they broadcast to (EfficientNet's squeeze-and-excite gate, a sigmoid of 144
    values, for each of 56 x 56 pixels; a group norm's per-channel scale, reshaped from its groups)."""
    sizes = {sch.get(info.block_rv).name_hint: _written_values(sch, info.block_rv) for info in infos
             if sch.get(info.block_rv).writes}  # a block whose writes TIR could not describe is never small
    if not sizes:
        return []
    output = max(sizes.values())

    def small_computed(block) -> bool:
        return sizes.get(sch.get(block).name_hint, output) * BROADCAST_RATIO <= output and _computes_floats(sch, block)

    return [info for info in infos if small_computed(info.block_rv)
            and not all(small_computed(consumer) for consumer in sch.get_consumers(info.block_rv))]


def _computes_floats(sch: s_tir.Schedule, block) -> bool:
    """Whether `block` computes float values (not a copy, which costs nothing inlined, nor a bool mask: TVM's
    LLVM codegen mixes i1 and i8 lanes when a vectorized consumer loads bools back from a buffer)."""
    store = sch.get(block).body
    return (isinstance(store, tvm.tirx.BufferStore) and "float" in str(store.buffer.dtype)
            and not isinstance(store.value, tvm.ir.expr.TensorLoad))


def _written_values(sch: s_tir.Schedule, block) -> int:
    """How many values `block` writes: the size of its output buffer (a huge number when symbolic)."""
    return math.prod(_const(d) or 1 << 62 for d in sch.get(block).writes[0].source.shape)


def _leading_spatial(info) -> int:
    """How many spatial loops lead the block's loop nest."""
    kinds = info.dom_kind()
    return len(kinds) - len(kinds.lstrip("S"))


class RowReductionRule(_CpuRule):
    """Row reductions (softmax, layer norm, RMS norm, a dynamic int8 matmul's row scales): blocks sharing leading
    spatial axes (the rows), reducing over the rest in whole vectors, ending in an elementwise block or in a
    reduction. Each row runs all the blocks in one parallel iteration; each reduction keeps ACCUMULATOR_LANES
    partial results in each of up to PARTIAL_VECTORS vectors (rfactor; 8 where the row is made of those: a layer
    norm over ConvNeXt-atto's 40 channels; `_partial_result_lanes`) and adds them up at the end of the row in halves
    (`_halve_partial_results`). A block storing a bf16 row stores it in vectors of two registers where they divide
    it, which are rounded by one instruction (`_vectorize_row`).

    A function of one reduction over rows that are not whole vectors (ConViT's sum of 196 attention weights a row)
    runs the same way with a serial tail (`_reduction_with_tail`). TVM's dl.cpu.Reduction reduces one scalar at a
    time (a chain of dependent adds, 4 cycles each) and takes the functions of several such reductions (a layer norm
    over 197), since compute_at drops the tail predicate of a factored reduction. Softmax rows of that kind arrive
    padded (relay_amp.backend.cpu.rows).
    """

    def schedule(self, sch: s_tir.Schedule, infos: list) -> s_tir.Schedule | None:
        """Schedule a function of row reductions ending in an elementwise block or in a reduction, else None."""
        infos = _store_from_producer(sch, _inline_elementwise_steps(sch, _inline_widened_loads(sch, infos)))
        rows = min(_leading_spatial(info) for info in infos)
        reductions = [info for info in infos if not info.is_injective()]
        if not rows or not reductions:
            return None
        if any(not _reduces_whole_vectors(sch, info, rows) for info in reductions):
            return _reduction_with_tail(sch, infos, reductions, rows)
        if any(not _same_rows(sch, info, infos[-1], rows) for info in reductions):
            return _broadcast_reductions(sch, infos, reductions) if infos[-1].is_injective() else None
        try:
            factored = [_factor_reduction(sch, info.block_rv, rows) for info in reductions]
            halved = [block for info in reductions for block in _halve_partial_results(sch, info.block_rv)]
            _in_parallel_rows(sch, infos, rows, vectorize=infos[-1].is_injective())
            for block in [*factored, *halved]:
                _vectorize_partial_sums(sch, block)
            _vectorize_row_tails(sch, [info.block_rv for info in infos if info.is_injective()])
        except s_tir.ScheduleError:
            return None
        return sch


class ColumnReductionRule(_CpuRule):
    """Reductions over the outer axes of a tensor whose innermost axis is kept (a global average pool over H and W
    of NHWC data, as squeeze-excite blocks and classifier heads pool): a row reduction would sum one channel at a
    time, its elements a channel count apart (a gather per vector). Here each whole vector of channels is added
    across the reduced positions: a run of them a core, in chains, where they split so (`_columns_split_by_pixels`),
    else all of them in one parallel item per vector of channels; the ops before it are inlined, the ones after it
    run on that vector too. Reductions over a middle axis (a softmax over W of NHWC data) run the
    same way inside parallel rows (`_column_rows`). A kept axis shorter than a register (a softmax over the keys with
    4 heads last) takes vectors of its largest power-of-two divisor (`_short_axis_lanes`)."""

    def schedule(self, sch: s_tir.Schedule, infos: list) -> s_tir.Schedule | None:
        """Schedule a function of one such reduction and elementwise ops, or of reductions over a middle axis
        keeping the innermost and the elementwise ops between them, else None."""
        reductions = [info for info in infos if not info.is_injective()]
        if len(reductions) > 1 or (reductions and _middle_rows(sch, infos, reductions)):
            return _column_rows(sch, infos, reductions)
        kept = _kept_axis(sch, reductions[0]) if len(reductions) == 1 else None
        if kept is None:
            return None
        at = infos.index(reductions[0])
        if not all(try_primitive(sch.compute_inline, info.block_rv) for info in infos[:at]):
            return None
        split = sch.copy()
        items = _columns_split_by_pixels(split, reductions[0], *kept)
        if items is not None:
            sch = split
        else:
            items = _vector_columns(sch, reductions[0], *kept)
        for consumer in (info.block_rv for info in infos[at + 1:]):
            sch.reverse_compute_at(consumer, items)
            sch.vectorize(sch.get_loops(consumer)[-1])
        return sch


def _middle_rows(sch: s_tir.Schedule, infos: list, reductions: list) -> int:
    """The count of leading loops (the rows) outside a middle axis that every reduction of `reductions` reduces
    over, keeping its innermost spatial loop (a softmax over W of NHWC data, as attention's softmax over the keys
    becomes where heads are channels), where the last block runs over those rows too; else 0."""
    kept = [_kept_axis(sch, info) for info in reductions]
    if None in kept or len({lanes for _, lanes in kept}) != 1 or not infos[-1].is_injective():
        return 0
    row = kept[0][0]
    if any(position != row for position, _ in kept) or any(info.dom_kind() != "S" * row + "SR" for info in reductions):
        return 0
    extents = [[_extent(sch, loop) for loop in sch.get_loops(info.block_rv)[:row]] for info in (*reductions, infos[-1])]
    return row if row and all(e == extents[0] for e in extents) else 0


def _column_rows(sch: s_tir.Schedule, infos: list, reductions: list) -> s_tir.Schedule | None:
    """Reductions over a middle axis (see `_middle_rows`) and the elementwise ops around them, all in one parallel
    row loop: each reduction adds whole vectors of the kept innermost axis across the reduced positions, each
    elementwise block runs in vectors of its row."""
    infos = _store_from_producer(sch, infos)
    reductions = [info for info in infos if not info.is_injective()]
    rows = _middle_rows(sch, infos, reductions)
    if not rows:
        return None
    try:
        _in_parallel_rows(sch, infos, rows, vectorize=True)
        for info in reductions:
            lanes, reduced = sch.get_loops(info.block_rv)[-2:]
            sch.reorder(reduced, lanes)
            sch.vectorize(lanes)
            sch.vectorize(sch.get_loops(sch.decompose_reduction(info.block_rv, reduced))[-1])
    except s_tir.ScheduleError:
        return None
    return sch


def _kept_axis(sch: s_tir.Schedule, info) -> "tuple[int, int] | None":
    """(position among `info`'s loops, vector lanes) of the spatial loop indexing its reduced input's innermost
    axis, where that axis is not reduced and is whole vectors long (of `_row_lanes`: 16, else 8 for RegNetY's 104
    channels) or shorter than one (`_short_axis_lanes`); else None."""
    kinds = info.dom_kind()
    loops = sch.get_loops(info.block_rv)
    reduced = [it.var for it in info.iters if it.kind == "R"]
    reads = [read for read in sch.get(info.block_rv).reads
             if any(v.same_as(r) for v in index_vars(read) for r in reduced)]
    if len(reads) != 1 or "R" not in kinds or len(loops) != len(kinds):
        return None
    innermost = vars_in(reads[0].region[-1].min)
    for position, it in enumerate(info.iters):
        if it.kind == "S" and any(v.same_as(it.var) for v in innermost):
            extent = _extent(sch, loops[position]) or 0
            lanes = _row_lanes(extent) if extent >= ACCUMULATOR_LANES else _short_axis_lanes(extent)
            return (position, lanes) if extent and extent % lanes == 0 else None
    return None


def _short_axis_lanes(extent: int) -> int:
    """Lanes for a kept axis shorter than a register (a softmax over the keys with the heads last, as ONNX Runtime's
    transpose optimizer writes talking-heads attention: 4 heads): the largest power of two dividing it, so that its
    reductions still run a row at a time; TVM's rule, which took them, recomputed a row's max and sum for each of its
    elements (a [1, 196, 196, 4] softmax over the keys: 40 ms against 0.12 over the heads)."""
    return extent & -extent


def _columns_split_by_pixels(sch: s_tir.Schedule, info, kept: int, lanes: int):
    """The reduction `info` as partial sums over even runs of its reduced positions (pixels), a run for each core of
    the target (`cores.target_cores`, else DEFAULT_PARTS), each summed by `_chains` interleaved chains of vectors of
    `lanes` of its kept loop `kept`, in parallel; then the partial sums' sum, a vector at a time: that serial loop
    over the kept axis's vectors, or None where the positions do not split so. Each core then reads the run of
    pixels the conv before it wrote, which it holds in its own cache, and its chains hide the adds' latency:
    EfficientNet-B0's 17 squeeze-excite pools had summed each 16-channel vector over every pixel in one chain, one
    vector a parallel item (the whole model 4-9% slower so in bf16 on a 2-core Sapphire Rapids)."""
    block = info.block_rv
    kinds, loops = info.dom_kind(), sch.get_loops(block)
    reduced = [loop for position, loop in enumerate(loops) if kinds[position] == "R"]
    parts = cores.target_cores() or DEFAULT_PARTS
    chains = _chains(math.prod(_extent(sch, loop) or 0 for loop in reduced), parts)
    if not chains:
        return None
    vectors, vector_lanes = sch.split(loops[kept], [None, lanes])
    spatial = [loop for position, loop in enumerate(loops) if kinds[position] == "S" and position != kept]
    sch.reorder(*spatial, vectors, *reduced, vector_lanes)
    part, run, chain = sch.split(sch.fuse(*reduced), [parts, None, chains])
    sch.reorder(part, chain, run)
    try:
        partial = sch.rfactor(sch.fuse(part, chain), 0)
    except s_tir.ScheduleError:
        return None
    *partial_spatial, partial_vectors, partial_chains, partial_run, partial_lanes = sch.get_loops(partial)
    partial_part, partial_chain = sch.split(partial_chains, [parts, chains])
    sch.reorder(partial_part, *partial_spatial, partial_vectors, partial_run, partial_chain, partial_lanes)
    sch.parallel(sch.fuse(partial_part, *partial_spatial, partial_vectors))
    sch.unroll(partial_chain)
    sch.vectorize(partial_lanes)
    sch.vectorize(sch.get_loops(sch.decompose_reduction(partial, partial_run))[-1])
    *_, total_vectors, total_parts, total_lanes = sch.get_loops(block)
    sch.vectorize(total_lanes)
    sch.vectorize(sch.get_loops(sch.decompose_reduction(block, total_parts))[-1])
    return total_vectors


def _chains(positions: int, parts: int) -> int:
    """The interleaved chains (PARTIAL_VECTORS, 2 or 1) each of `parts` even runs of `positions` is summed in, each
    at least MIN_CHAIN long; 0 where none divides them so."""
    return next((chains for chains in (PARTIAL_VECTORS, 2, 1)
                 if positions % (parts * chains) == 0 and positions // (parts * chains) >= MIN_CHAIN), 0)


def _vector_columns(sch: s_tir.Schedule, info, kept: int, lanes: int):
    """The reduction `info` as (parallel vectors of `lanes` of its loop `kept`, reduced loops, vectorized lanes):
    the parallel loop."""
    block = info.block_rv
    kinds, loops = info.dom_kind(), sch.get_loops(block)
    vectors, lanes = sch.split(loops[kept], [None, lanes])
    spatial = [loop for position, loop in enumerate(loops) if kinds[position] == "S" and position != kept]
    reduced = [loop for position, loop in enumerate(loops) if kinds[position] == "R"]
    sch.reorder(*spatial, vectors, *reduced, lanes)
    items = sch.fuse(*spatial, vectors)
    sch.parallel(items)
    sch.vectorize(lanes)
    init = sch.decompose_reduction(block, reduced[0])
    sch.vectorize(sch.get_loops(init)[-1])
    return items


def _inline_widened_loads(sch: s_tir.Schedule, infos: list) -> list:
    """`infos` with each block that only casts or copies a loaded value (a bf16 input widened to fp32, the slice of
    a wider tensor it is read through) inlined into its readers: a layer norm's three passes then widen in
    registers as they load (two instructions a vector), which is faster than storing an fp32 copy of the row and
    loading it back."""
    moves = [info.block_rv for info in infos[:-1] if _moves_a_load(sch.get(info.block_rv))]
    inlined = [block for block in moves if try_primitive(sch.compute_inline, block)]
    return normalize_prim_func(sch) if inlined else infos


def _inline_elementwise_steps(sch: s_tir.Schedule, infos: list) -> list:
    """`infos` with each elementwise block before the last that no reduction reads inlined into its readers: a
    softmax's x - max into its exp, its division and an export's NaN guard after it (isnan, where) into the last
    block, which then computes them in registers instead of storing each in a row buffer and loading it back
    (DINOv2's guarded softmax over rows of 1376: 2.3 -> 1.4 ms, with relay_amp.backend.cpu.nan_tests). A block a
    reduction reads (the exps that the sum adds up) keeps its buffer: each reader would compute it again."""
    reductions = [sch.get(info.block_rv) for info in infos if not info.is_injective()]
    steps = [info.block_rv for info in infos[:-1] if info.is_injective() and not any(
        sch.get(reader).same_as(reduction) for reader in sch.get_consumers(info.block_rv) for reduction in reductions)]
    inlined = [block for block in steps if try_primitive(sch.compute_inline, block)]
    return normalize_prim_func(sch) if inlined else infos


def _moves_a_load(block: s_tir.SBlock) -> bool:
    """Whether `block` stores a loaded value cast, or a loaded value as it is from a window of its input (each
    index a constant or its own axis plus one, the axes in order: a slice, whose loads stay contiguous, unlike a
    transpose's)."""
    value = block.body.value if isinstance(block.body, tirx.BufferStore) else None
    if isinstance(value, tirx.Cast):
        return isinstance(value.value, tvm.ir.expr.TensorLoad)
    if not isinstance(value, tvm.ir.expr.TensorLoad):
        return False
    analyzer, axes = tvm.sym.Analyzer(), []
    for index in value.indices:
        used = list(vars_in(index))
        if len(used) > 1 or not isinstance(analyzer.simplify(index - used[0] if used else index), tirx.IntImm):
            return False
        axes.extend(used)
    return len(axes) == len(block.iter_vars) and all(a.same_as(iv.var) for a, iv in zip(axes, block.iter_vars))


def _store_from_producer(sch: s_tir.Schedule, infos: list) -> list:
    """`infos` with the last block (the function's output: a layer norm's bf16 cast) inlined into the elementwise
    block computing its value where TIR allows, so the value goes to the output in registers, not through a
    buffer of its own."""
    if len(infos) < 2 or not infos[-2].is_injective():
        return infos
    shape = _written_shape(sch, infos[-1])  # a slice of the value (after a padded softmax) keeps its own block
    if 0 in shape or shape != _written_shape(sch, infos[-2]) or not try_primitive(sch.reverse_compute_inline,
                                                                                   infos[-1].block_rv):
        return infos
    return normalize_prim_func(sch)


def _written_shape(sch: s_tir.Schedule, info) -> tuple:
    """The shape of the buffer `info`'s block writes, 0 for a symbolic extent."""
    return tuple(_const(extent) for extent in sch.get(info.block_rv).writes[0].source.shape)


def _same_rows(sch: s_tir.Schedule, reduction, last, rows: int) -> bool:
    """Whether `reduction`'s `rows` leading loops have the extents of the last block's: where the reduction keeps
    a reduced axis as 1 and the last block runs over it (a group norm of one group over a whole image, its mean
    broadcast back), those are not rows, and computing the reduction in them would redo it for every element (as
    TVM's dl.cpu.Reduction does: seconds for PoolFormer's norms)."""
    def extents(info) -> list:
        return [_extent(sch, loop) for loop in sch.get_loops(info.block_rv)[:rows]]
    return extents(reduction) == extents(last)


def _broadcast_reductions(sch: s_tir.Schedule, infos: list, reductions: list) -> s_tir.Schedule | None:
    """Reductions whose results the last (elementwise) block broadcasts over what they reduced: each runs once,
    in partial-sum vectors, then the elementwise ops, inlined into the last block, run over the whole tensor."""
    try:
        for info in infos[:-1]:
            if info.is_injective():
                try_primitive(sch.compute_inline, info.block_rv)
        for info in reductions:
            factored = _factor_reduction(sch, info.block_rv, _leading_spatial(info))
            *_, reduction, lanes = sch.get_loops(factored)
            sch.vectorize(lanes)
            sch.decompose_reduction(factored, reduction)
        schedule_injective(sch, infos[-1].block_rv)
    except s_tir.ScheduleError:
        return None
    return sch


def _reduces_whole_vectors(sch: s_tir.Schedule, info, rows: int) -> bool:
    """Whether `info` reduces one tensor (not a contraction) over all its loops after the `rows` leading ones,
    in whole vectors."""
    length = _row_length(sch, info, rows)
    return bool(length) and length % _row_lanes(length) == 0


def _row_length(sch: s_tir.Schedule, info, rows: int) -> int:
    """How many values `info` reduces a row, where it reduces one tensor (not a contraction) over all its loops
    after the `rows` leading ones, a constant count; else 0."""
    kinds = info.dom_kind()
    extents = [_extent(sch, loop) for loop in sch.get_loops(info.block_rv)[rows:]]
    reduced = [it.var for it in info.iters if it.kind == "R"]
    reads = [read for read in sch.get(info.block_rv).reads
             if any(v.same_as(r) for v in index_vars(read) for r in reduced)]
    whole = kinds[rows:] and set(kinds[rows:]) == {"R"} and all(extents) and len(reads) == 1
    return math.prod(extents) if whole else 0


def _reduction_with_tail(sch: s_tir.Schedule, infos: list, reductions: list, rows: int) -> s_tir.Schedule | None:
    """A function of one reduction over rows longer than a vector but not whole vectors (ConViT's sum of 196
    attention weights, a max over 50257 logits) and elementwise blocks: those before it inlined, each row in
    parallel adding its whole vectors in vector partial results and the rest in a serial loop (a partition of the
    loop, so the whole vectors carry no tail test), the blocks after it in the same row. The partial results'
    block keeps its tail predicate because it keeps its own loops: the others move into its row
    (reverse_compute_at), not it into theirs. A reduction of several values (argmax's value and index) is left to
    TVM's rule: the partitioned loops' copies of its block fail to lower. Else None."""
    single = len(reductions) == 1 and len(sch.get(reductions[0].block_rv).writes) == 1  # an argmax writes two
    length = _row_length(sch, reductions[0], rows) if single else 0
    at = infos.index(reductions[0])
    if length <= ACCUMULATOR_LANES or any(not _same_rows(sch, reductions[0], info, rows) for info in infos[at:]):
        return None
    if not all(try_primitive(sch.compute_inline, info.block_rv) for info in infos[:at]):
        return None
    try:
        factored = _factor_reduction(sch, reductions[0].block_rv, rows)
        row = _parallel_rows(sch, factored, rows, vectorize=False)
        for info in infos[at:]:
            sch.reverse_compute_at(info.block_rv, row)
        *_, steps, lanes = sch.get_loops(factored)
        sch.vectorize(lanes)
        sch.decompose_reduction(factored, steps)
        sch.loop_partition(steps, [length // _extent(sch, lanes), None])
    except s_tir.ScheduleError:
        return None
    return sch


def _factor_reduction(sch: s_tir.Schedule, block, rows: int):
    """Split `block`'s reduction into vectors of partial results (the rfactor block, returned;
    `_partial_result_lanes` of them: 8 over a layer norm's 40 channels, 64 over 384) and their sum into the original
    output."""
    loops = sch.get_loops(block)[rows:]
    reduction = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    _, lanes = sch.split(reduction, [None, _partial_result_lanes(_extent(sch, reduction))])
    return sch.rfactor(lanes, factor_axis=len(sch.get(block).writes[0].source.shape))


def _partial_result_lanes(row: int) -> int:
    """Partial results a row reduction of `row` values keeps: `_row_lanes` of them in each of up to PARTIAL_VECTORS
    vectors, as many as divide the row into two rounds or more (independent chains of adds, where one vector's chain
    of dependent adds bounded a layer norm over 384 channels)."""
    lanes = _row_lanes(row)
    counts = (count for count in (PARTIAL_VECTORS, 2) if row % (lanes * count) == 0 and row >= 2 * lanes * count)
    return lanes * next(counts, 1)


def _halve_partial_results(sch: s_tir.Schedule, block) -> list:
    """Add up the partial results a factored reduction `block` ends with in halves, a vector op each (64 -> 32 ->
    16 -> 8 -> 4 -> 2, in rfactor blocks, returned), leaving it the last two: added one at a time they were a chain
    of 15 dependent adds a row, about 60 cycles, which outlasts a layer norm's row of 32 channels (SegFormer-B0's
    16384 rows of 32: 104 -> 63 us in bf16)."""
    halves = []
    while (extent := _extent(sch, sch.get_loops(block)[-1]) or 0) >= 4 and extent % 2 == 0:
        _, half = sch.split(sch.get_loops(block)[-1], [2, extent // 2])
        halves.append(sch.rfactor(half, factor_axis=len(sch.get(block).writes[0].source.shape)))
    return halves


def _in_parallel_rows(sch: s_tir.Schedule, infos: list, rows: int, vectorize: bool) -> None:
    """The last block's `rows` leading loops as one parallel loop (`_parallel_rows`), every other block computed
    inside it and the elementwise ones vectorized along their row."""
    row = _parallel_rows(sch, infos[-1].block_rv, rows, vectorize)
    for block in reversed(sch.get_child_blocks(sch.get_sblock("root"))[:-1]):
        sch.compute_at(block, row, preserve_unit_loops=False)
    for info in infos[:-1]:
        if info.is_injective():
            _vectorize_row(sch, info.block_rv)


def _parallel_rows(sch: s_tir.Schedule, block, rows: int, vectorize: bool):
    """The `rows` leading loops of `block` fused into one parallel loop (returned); the rest vectorized where
    `vectorize` (a final reduction adds its partial results one at a time)."""
    loops = sch.get_loops(block)
    row = sch.fuse(*loops[:rows]) if rows > 1 else loops[0]
    sch.parallel(row)
    if vectorize:
        _vectorize_row(sch, block)
    return row


def _vectorize_row(sch: s_tir.Schedule, block) -> None:
    """Fuse the loops of `block` inside its row loop and vectorize them by whole registers, or halves, where they
    divide (`_row_lanes`); by two registers where `block` stores bfloat16 and they divide (rounded two registers
    at a time, relay_amp.backend.cpu.bf16_round)."""
    inner = sch.get_loops(block)[1:]
    if not inner:
        return
    fused = sch.fuse(*inner) if len(inner) > 1 else inner[0]
    extent = _extent(sch, fused)
    if not extent:
        return
    pairs = str(sch.get(block).writes[0].source.dtype) == "bfloat16" and not extent % PAIR_LANES
    lanes = PAIR_LANES if pairs else _row_lanes(extent)
    if extent % lanes == 0:
        sch.vectorize(sch.split(fused, [None, lanes])[1])


def _vectorize_row_tails(sch: s_tir.Schedule, blocks: list) -> None:
    """Vectorize the elementwise `blocks` whose row inside the parallel loop is off whole vectors and a vector long
    or more, in whole vectors and a serial rest (`_vectorize_whole_vectors`), once every block is in its row (a
    partition before that leaves compute_at two consumers): the 1370 columns of a softmax padded to 1376, sliced
    back and guarded against NaN by an export's attention ran serial in three blocks, a quarter of DINOv2's time
    at 518x518."""
    for block in blocks:
        inner = sch.get_loops(block)[1:]
        extent = math.prod(_extent(sch, loop) or 0 for loop in inner) if inner else 0
        vectorized = any(sch.get(loop).kind == tirx.ForKind.VECTORIZED for loop in inner)
        if extent >= ACCUMULATOR_LANES and extent % _row_lanes(extent) and not vectorized:
            _vectorize_whole_vectors(sch, sch.fuse(*inner) if len(inner) > 1 else inner[0], extent)


def _vectorize_partial_sums(sch: s_tir.Schedule, block) -> None:
    """Put the rfactor block's lanes innermost, vectorized, with its reduction loop around them."""
    *_, lanes, reduction = sch.get_loops(block)
    sch.reorder(reduction, lanes)
    sch.vectorize(lanes)
    sch.decompose_reduction(block, reduction)


def _rules(first_rules) -> list[dl.ScheduleRule]:
    return [*first_rules, ContractionRule(), ElementwiseRule(), ColumnReductionRule(), RowReductionRule(),
            dl.cpu.Reduction()]


def default_schedules(*first_rules: dl.ScheduleRule) -> tvm.transform.Pass:
    """The pass that gives every unscheduled CPU PrimFunc relay_amp's rule-based schedule (or TVM's CPU rules);
    `first_rules` get the first chance."""
    return dl.ApplyDefaultSchedule(*_rules(first_rules))


def default_schedule(func: tirx.PrimFunc, target: tvm.target.Target,
                     *first_rules: dl.ScheduleRule) -> s_tir.Schedule | None:
    """The schedule (with its trace) that default_schedules gives `func`, or None where no rule applies or `func` is
    scheduled already (a kernel written scheduled, which default_schedules leaves as it is)."""
    if func.attrs is not None and int(func.attrs.get("tirx.is_scheduled", 0)) == 1:
        return None
    for rule in _rules(first_rules):
        sch = rule.apply(func, target, False)
        if sch is not None:
            return sch
    return None
