"""amx_experts: a mixture of experts' routed rows times their own expert's weight on AMX tiles.

`relay_amp.backend.cpu.experts` computes only each routed row's own expert's products; on an AMX host its bf16
products (bf16 -> fp32) and quantize's int8 ones (uint8 or int8 codes x int8 weight codes -> int32) run here
instead of on `vdpbf16ps` (which Sapphire Rapids issues at half an FMA's rate, so bf16 experts ran no faster than
fp32 ones there) or `vpdpbusd`. Each parallel item is one expert and a run of its 32-column panels: it scans the
taken rows for its expert's, copies each one's operands into a scratch of two 16-row A tiles, and whenever the
scratch is full (and after the scan, for the rest) multiplies it by each panel of its run with `amx`'s block
function and stores each row's outputs where the take put it (int8: its sums through the per-column affine and the
token's row scale, as `experts.expert_kernel` applies them). The expert weight is `experts.packed_weight`'s pairs
or fours of depths, which is AMX's B-tile layout (int8 codes as they are: AMX multiplies signed codes); an expert
no row chose costs its scan alone.
"""

import tvm
from tvm import s_tir
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.script import tirx as T

from ..._ir import fast_script_parsing, opaque_scheduled
from . import amx
from .kernels import LANES
from .schedules import largest_divisor

DTYPES = frozenset(amx.PRODUCTS)  # operand dtypes computed here: bf16, int8 and uint8 codes
TILE_ROWS = amx.MAX_TILE_ROWS
SCRATCH_ROWS = 2 * TILE_ROWS  # the block function's two A tiles
PANEL = amx.PANELS * LANES  # output columns of one block
WORD_BYTES = 4  # the copy moves operands as 32-bit words
AFFINE_ROWS = 3  # int8: per column (A, B, C), out = (sums x A + B) x the token's row scale + C (experts' own)


def supports(dtype: str, depth: int, columns: int, amx_dtypes: frozenset) -> bool:
    """Whether the AMX expert kernel computes `dtype` operands of `depth` by experts of `columns`: a dtype in
    DTYPES that the target computes on AMX (`amx_dtypes`), whole 32-column panels, and depths in whole 64-byte tile
    rows."""
    return (dtype in DTYPES and dtype in amx_dtypes and columns % PANEL == 0
            and depth * amx.PRODUCTS[dtype].element_bytes % amx.TILE_BYTES == 0)


def _panels_per_item(experts: int, panels: int) -> int:
    """32-column panels of one parallel item: all an expert's, unless that leaves fewer than amx.PARALLEL_ITEMS
    items (few experts), then the largest run that divides them and makes enough."""
    return largest_divisor(panels, max(1, panels * experts // amx.PARALLEL_ITEMS))


def expert_kernel(spec) -> tvm.tirx.PrimFunc:
    """The kernel computing an `experts.ExpertSpec` of AMX operands (see `supports`), with the same arguments as
    `experts.expert_kernel`'s: (operands, index, packed weight[, int8's affine per column and row scales]) ->
    (rows, columns)."""
    product = amx.PRODUCTS[spec.dtype]
    tokens, depth, experts, columns, rows = spec.tokens, spec.depth, spec.experts, spec.columns, spec.rows
    row_bytes = depth * product.element_bytes
    words = row_bytes // WORD_BYTES
    weight_shape = (experts, columns // LANES, words, LANES)
    run = _panels_per_item(experts, columns // PANEL)
    runs = columns // PANEL // run
    annotations = {"pragma_import_llvm": amx.llvm_ir(product)}
    with fast_script_parsing():
        @T.macro
        def store(out, acc, affine, row_scales, take_row, token, r, column):
            """Scratch row r's sums of the 32 columns from `column` (of every expert's) into row `take_row` of `out`
            (codes: through those columns' affine and `token`'s row scale)."""
            for lane in T.vectorized(PANEL):
                if spec.codes:
                    out[take_row, column % columns + lane] = T.Cast(spec.out_dtype, (
                        T.Cast("float32", acc[r // TILE_ROWS, r % TILE_ROWS, lane]) * affine[0, column + lane]
                        + affine[1, column + lane]) * row_scales[token, 0] + affine[2, column + lane])
                else:
                    out[take_row, column % columns + lane] = T.Cast(spec.out_dtype,
                                                                    acc[r // TILE_ROWS, r % TILE_ROWS, lane])

        @T.macro
        def multiply_rows(scratch, acc, order, weight, affine, row_scales, out, expert, first_panel, count):
            """The `count` rows of the scratch times each panel of the run from `first_panel`, stored in `out`."""
            for panel in range(first_panel, first_panel + run):
                T.evaluate(amx.block_call(product, acc, [amx.whole_tile(scratch, 0), amx.whole_tile(scratch, 1)],
                                          T.address_of(weight[expert, panel * amx.PANELS, 0, 0]), amx.TILE_BYTES,
                                          row_bytes, row_bytes))
                for r in range(SCRATCH_ROWS):
                    if r < count:
                        store(out, acc, affine, row_scales, order[0, r], order[1, r], r,
                              expert * columns + panel * PANEL)

        @T.macro
        def take_row(data_words, scratch, order, count, s, token):
            """Row `s` of the take (`token`'s operands) into the scratch's next row."""
            for w in range(words // LANES):
                for lane in T.vectorized(LANES):
                    scratch[count[0] // TILE_ROWS, count[0] % TILE_ROWS, w * LANES + lane] = data_words[
                        token, w * LANES + lane]
            for r in range(SCRATCH_ROWS):  # not order[., count[0]]: TVM's buffer compaction takes a data-dependent
                if r == count[0]:  # index for a constant one
                    order[0, r] = s
                    order[1, r] = token
            count[0] += 1

        @T.macro
        def grouped(data, index, weight, affine, row_scales, out):
            """Each expert's taken rows, two tiles at a time, times each panel of the item's run, in parallel over
            (run, expert)."""
            data_words = T.decl_buffer((tokens, words), "uint32", data=data.data)
            for item in T.parallel(experts * runs, annotations=annotations):
                scratch = T.alloc_buffer((2, TILE_ROWS, words), "uint32")  # the A tiles' operands, as 32-bit words
                acc = T.alloc_buffer((2, TILE_ROWS, PANEL), product.acc_dtype)
                order = T.alloc_buffer((2, SCRATCH_ROWS), "int32")  # each scratch row's row of the take, token
                count = T.alloc_buffer((1,), "int32")  # scratch rows filled
                with T.sblock("amx_experts"):
                    if spec.codes:
                        T.reads(data[0:tokens, 0:depth], index[0:rows], weight[0:experts, 0:columns // LANES,
                                                                               0:words, 0:LANES],
                                affine[0:AFFINE_ROWS, 0:experts * columns], row_scales[0:tokens, 0:1])
                    else:
                        T.reads(data[0:tokens, 0:depth], index[0:rows], weight[0:experts, 0:columns // LANES,
                                                                               0:words, 0:LANES])
                    T.writes(out[0:rows, 0:columns])
                    T.evaluate(T.call_extern("int32", f"{product.symbol}_config", T.int64(TILE_ROWS),
                                             T.int64(amx.TILE_BYTES)))
                    expert, first_panel = item % experts, item // experts * run
                    count[0] = 0
                    for s in range(rows):
                        if T.floormod(index[s], experts) == T.Cast(spec.index_dtype, expert):
                            take_row(data_words, scratch, order, count,
                                     s, T.max(T.min(T.Cast("int32", T.floordiv(index[s], experts)), tokens - 1), 0))
                            if count[0] == SCRATCH_ROWS:
                                multiply_rows(scratch, acc, order, weight, affine, row_scales, out, expert,
                                              first_panel, SCRATCH_ROWS)
                                count[0] = 0
                    if count[0] > 0:
                        multiply_rows(scratch, acc, order, weight, affine, row_scales, out, expert, first_panel,
                                      count[0])
                    T.evaluate(T.call_extern("int32", f"{product.symbol}_release"))

        if spec.codes:
            @T.prim_func(s_tir=True)
            def kernel(data: T.Buffer((tokens, depth), spec.dtype), index: T.Buffer((rows,), spec.index_dtype),
                       weight: T.Buffer(weight_shape, "int32"),
                       affine: T.Buffer((AFFINE_ROWS, experts * columns), "float32"),
                       row_scales: T.Buffer((tokens, 1), "float32"), out: T.Buffer((rows, columns), spec.out_dtype)):
                T.func_attr({"tirx.noalias": True})
                grouped(data, index, weight, affine, row_scales, out)
        else:
            @T.prim_func(s_tir=True)
            def kernel(data: T.Buffer((tokens, depth), spec.dtype), index: T.Buffer((rows,), spec.index_dtype),
                       weight: T.Buffer(weight_shape, "uint32"), out: T.Buffer((rows, columns), spec.out_dtype)):
                T.func_attr({"tirx.noalias": True})
                grouped(data, index, weight, weight, weight, out)
    sch = s_tir.Schedule(kernel)
    sch.annotate(get_root_block(sch), "schedule_rule", "None")  # MetaSchedule's rules leave it as written
    scheduled = sch.mod["main"].without_attr("global_symbol")
    return opaque_scheduled(scheduled)
