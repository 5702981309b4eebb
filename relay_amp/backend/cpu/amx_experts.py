"""amx_experts: a mixture of experts' routed rows times their own expert's weight on AMX tiles (bf16 -> fp32).

`relay_amp.backend.cpu.experts` computes only each routed row's own expert's products; on an AMX host its bf16
products run here instead of on `vdpbf16ps` (which Sapphire Rapids issues at half an FMA's rate, so bf16 experts
ran no faster than fp32 ones there). Each parallel item is one expert and a run of its 32-column panels: it scans
the taken rows for its expert's, copies each one's operands into a scratch of two 16-row A tiles, and whenever the
scratch is full (and after the scan, for the rest) multiplies it by each panel of its run with `amx`'s block
function and stores each row's outputs where the take put it. The expert weight is `experts.packed_weight`'s
bf16 pairs, which is AMX's B-tile layout; an expert no row chose costs its scan alone.
"""

import tvm
from tvm import s_tir
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.script import tirx as T

from ..._ir import OPAQUE_PATTERN, fast_script_parsing
from . import amx
from .kernels import LANES
from .schedules import largest_divisor

DTYPES = frozenset({"bfloat16"})  # operand dtypes computed here
TILE_ROWS = amx.MAX_TILE_ROWS
SCRATCH_ROWS = 2 * TILE_ROWS  # the block function's two A tiles
PANEL = amx.PANELS * LANES  # output columns of one block
WORD_BYTES = 4  # the copy moves bf16 pairs as 32-bit words


def supports(dtype: str, depth: int, columns: int, amx_dtypes: frozenset) -> bool:
    """Whether the AMX expert kernel computes `dtype` operands of `depth` by experts of `columns`: a dtype in
    DTYPES that the target computes on AMX, whole 32-column panels, and depths in whole 64-byte tile rows."""
    return (dtype in DTYPES and dtype in amx_dtypes and columns % PANEL == 0
            and depth * amx.PRODUCTS[dtype].element_bytes % amx.TILE_BYTES == 0)


def _panels_per_item(experts: int, panels: int) -> int:
    """32-column panels of one parallel item: all an expert's, unless that leaves fewer than amx.PARALLEL_ITEMS
    items (few experts), then the largest run that divides them and makes enough."""
    return largest_divisor(panels, max(1, panels * experts // amx.PARALLEL_ITEMS))


def expert_kernel(spec) -> tvm.tirx.PrimFunc:
    """The kernel computing an `experts.ExpertSpec` of AMX operands (see `supports`): (operands, index, packed
    weight) -> (rows, columns), the same call as `experts.expert_kernel`'s."""
    product = amx.PRODUCTS[spec.dtype]
    tokens, depth, experts, columns, rows = spec.tokens, spec.depth, spec.experts, spec.columns, spec.rows
    row_bytes = depth * product.element_bytes
    words = row_bytes // WORD_BYTES
    run = _panels_per_item(experts, columns // PANEL)
    runs = columns // PANEL // run
    annotations = {"pragma_import_llvm": amx.llvm_ir(product)}
    with fast_script_parsing():
        @T.macro
        def store_rows(scratch, acc, order, weight, out, expert, first_panel, count):
            """The `count` rows of the scratch times each panel of the run from `first_panel`, stored in `out`."""
            for panel in range(first_panel, first_panel + run):
                T.evaluate(T.call_extern(
                    "int32", product.symbol, amx.whole_tile(acc, 0), amx.whole_tile(acc, 1),
                    amx.whole_tile(scratch, 0), amx.whole_tile(scratch, 1),
                    T.address_of(weight[expert, panel * amx.PANELS, 0, 0]), T.int64(amx.TILE_BYTES),
                    T.int64(row_bytes), T.int64(0), T.int64(1), T.int64(row_bytes), T.int64(PANEL * 4)))
                for r in range(SCRATCH_ROWS):
                    if r < count:
                        for lane in T.vectorized(PANEL):
                            out[order[r], panel * PANEL + lane] = T.Cast(
                                spec.out_dtype, acc[r // TILE_ROWS, r % TILE_ROWS, lane])

        @T.macro
        def take_row(data_words, scratch, order, count, s, token):
            """Row `s` of the take (`token`'s operands) into the scratch's next row."""
            for w in range(words // LANES):
                for lane in T.vectorized(LANES):
                    scratch[count[0] // TILE_ROWS, count[0] % TILE_ROWS, w * LANES + lane] = data_words[
                        token, w * LANES + lane]
            for r in range(SCRATCH_ROWS):  # not order[count[0]]: TVM's buffer compaction takes a data-dependent
                if r == count[0]:  # index for a constant one
                    order[r] = s
            count[0] += 1

        @T.prim_func(s_tir=True)
        def kernel(data: T.Buffer((tokens, depth), spec.dtype), index: T.Buffer((rows,), spec.index_dtype),
                   weight: T.Buffer((experts, columns // LANES, words, LANES), "uint32"),
                   out: T.Buffer((rows, columns), spec.out_dtype)):
            T.func_attr({"tirx.noalias": True})
            data_words = T.decl_buffer((tokens, words), "uint32", data=data.data)
            for item in T.parallel(experts * runs, annotations=annotations):
                scratch = T.alloc_buffer((2, TILE_ROWS, words), "uint32")  # the A tiles' operands, as bf16 pairs
                acc = T.alloc_buffer((2, TILE_ROWS, PANEL), product.acc_dtype)
                order = T.alloc_buffer((SCRATCH_ROWS,), "int32")  # the take's row of each scratch row
                count = T.alloc_buffer((1,), "int32")  # scratch rows filled
                with T.sblock("amx_experts"):
                    T.reads(data[0:tokens, 0:depth], index[0:rows], weight[0:experts, 0:columns // LANES, 0:words,
                                                                           0:LANES])
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
                                store_rows(scratch, acc, order, weight, out, expert, first_panel, SCRATCH_ROWS)
                                count[0] = 0
                    if count[0] > 0:
                        store_rows(scratch, acc, order, weight, out, expert, first_panel, count[0])
                    T.evaluate(T.call_extern("int32", f"{product.symbol}_release"))
    sch = s_tir.Schedule(kernel)
    sch.annotate(get_root_block(sch), "schedule_rule", "None")  # MetaSchedule's rules leave it as written
    scheduled = sch.mod["main"].without_attr("global_symbol")
    return scheduled.with_attrs({"tirx.is_scheduled": True, "op_pattern": OPAQUE_PATTERN})
