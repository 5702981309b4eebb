"""experts: the rows a take reads out of a product by every expert's weight, computed alone and grouped by expert.

relay_amp's frontend writes a mixture-of-experts layer over at least as many routed rows as experts as one matmul of
the tokens by every expert's weight, a constant (K, E * N), and a take of each routed row's N outputs at
token * E + expert (relay_amp._expert_matmuls): each token times all E experts, where it was routed to top-k of them.
With Mixtral's 8 experts of top 2 that is 4x the products; with Qwen3-MoE's and OLMoE's 64 experts of top 8 it is 8x,
and each down projection's row, a token of its own, is multiplied by all 64 (a Qwen3-MoE-style decoder, 4 layers of
512, 64 experts of 256, top 8, 64 tokens, on a 2-core Zen 4: relay_amp fp32 220.9 ms, bf16 110.6 ms; PyTorch's eager
experts 96.6 and 61.6 ms). A decode step's form, fewer rows than experts, copies each row's expert weight out of the
stack and multiplies the row by its copy.

`GroupedExpertMatmuls` replaces such a take, where nothing else reads the product, by `expert_kernel`: a counting
sort of the taken rows by expert, then, in parallel over (block of columns, expert), so that each thread's share
holds blocks of every expert wherever the routing sends the rows, each expert's rows a tile at a time (4 rows of 64
columns on AVX-512; the last rows one at a time, not repeated to fill a tile) times its weight, packed so that each
16 columns of an expert are one stream of depths, and each row's outputs stored where the take put them. fp32 (and
fp16, widened as loaded) on FMAs; bf16 on `vdpbf16ps` over pairs of depths where the target has it (a 32-bit word
per pair, broadcast from the row), else widened. A decode step's matmul of gathered weights takes the same kernel,
each row its own token, and reads each chosen expert's weight in place. Only the routed rows' products are computed;
an expert's weight is read once per tile of its rows, and not at all where no row chose it. The decoder above: fp32
19.0 ms, bf16 11.0 ms; one token 6.0 -> 2.6 ms and 3.4 -> 1.7 ms (its up and down projections alone, 64 tokens of
512 by 64 experts of 512, top 8, then the 512 rows by experts of 256 back: fp32 2.3 + 1.2 ms, bf16 1.6 + 0.5 ms,
bf16 widened to FMAs 2.1 + 0.9 ms).

On a target that computes bf16 or int8 on AMX tiles, those products run on `amx_experts`' kernel instead (the
same call and packed weight; int8 codes unshifted), which the dense form's many rows fill: Sapphire Rapids issues
`vdpbf16ps` at half an FMA's rate, so there the bf16 experts above ran no faster than fp32. A decode step's
gathered form stays here (a row or two per expert fills no tile).

Weight-only int4 (`quantize_weights`) writes the product by every expert as its reference int4 kernel on packed
codes (relay_amp.packed_int4's layout, whose 16-column blocks are already one expert's after another); a take of it
becomes the same kernel on the codes: per group of depths, each row's operands times the nibbles (bf16 pairs on
`vdpbf16ps`, a bf16 128.0 OR-ed over each pair of nibbles making 128 + nibble exactly; fp32 widened), less the
offset times the operands' sum over the group (computed once per token), times the group's scales. A gpt-oss-style
decoder (Zen 4, AMP's bf16 first): a decode step's experts read a quarter of bf16's bytes, the step 4.77 -> 3.79 ms;
a prompt of 64 tokens 37 ms (bf16 34 ms), where the reference kernel computed every expert's products (272 ms).

quantize's int8 (on AVX-512 VNNI targets: relay_amp.targets.int8_expert_products) writes the product by every expert
as an int32 matmul of 8-bit activation codes by int8 weight codes, cast to fp32, times per-column scales, plus
per-column offsets and, for per-row codes, times each token's row scale; a take of it becomes the same kernel on
the codes: four depths a 32-bit word on `vpdpbusd` (int8 codes XOR-ed into their uint8 code + 128, whose products
the per-column offset takes back), int32 sums, then (sums x A + B) x row scale + C, the steps folded into A, B and C
per column, stored once. The zoo's Qwen3-MoE (64 experts of 256, top 8, 128 tokens, Zen 4): int8q 20.7 -> 13.8 ms
(per-row codes 21.0 -> 14.2), where its experts ran in the bf16 fallback; bf16 22.8 ms. Its expert kernels: 9.9 +
5.6 ms in bf16, 5.6 + 3.5 ms in int8.
"""

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, s_tir
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.script import tirx as T

from ..._dead_code import EliminateDeadCode
from ..._expert_matmuls import (CAST, GATHERS, MATMUL, RESHAPE, TAKE, bound_once, gathered_experts, taken_product,
                               takes_rows)
from ..._ir import (add_func_once, called_prim_func, calls_any_op, fast_script_parsing, get_function,
                    is_static_shape, opaque_scheduled, read_counts, rewrite_function, tensor_dtype, tensor_shape)
from ...dtypes import MODEL_FLOAT_DTYPES
from ...ops import call_op_name
from ...packed_int4 import ROWS_PER_WORD, ZERO_POINT, nibble_shift, spec_of
from ...targets import int8_expert_products
from . import amx, amx_experts
from .amx_experts import AFFINE_ROWS
from .dispatch import kernel_dtypes
from .kernels import BF16_DOT, INT8_DOT, INT8_SHIFT, LANES, register_file

MULTIPLY, ADD = "relax.multiply", "relax.add"  # an int8 product's steps after its int32 sums
MAX_TILE_ROWS = 4  # rows a tile multiplies by each weight vector it loads (more did not run faster on Zen 4)
PANEL_CHOICES = (4, 2, 1)  # 16-column blocks of a tile, preferred in this order
NIBBLE_PAIRS = 0x000F000F  # a word's nibbles of depths 2j and 2j + 1, shifted down by 4j, one per half
BF16_128_PAIR = 0x43004300  # a bf16 128.0 in each half: OR-ed over a nibble c, the bf16 128 + c, exactly
BIAS_128 = 128  # what the OR adds to each code
CHAINS = 2  # int4: independent sums of each accumulator (a single row's products otherwise wait on each other)
PAIRS_DOT = "relay_amp_experts_dpbf16"  # acc[16] + 16 vdpbf16ps products of bf16 pairs held as 32-bit words
PAIRS_DOT_IR = f"""
declare <16 x float> @{BF16_DOT.llvm_intrinsic}(<16 x float>, <32 x bfloat>, <32 x bfloat>)
define <16 x float> @{PAIRS_DOT}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {{
  %av = bitcast <16 x i32> %a to <32 x bfloat>
  %bv = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @{BF16_DOT.llvm_intrinsic}(<16 x float> %acc, <32 x bfloat> %bv, <32 x bfloat> %av)
  ret <16 x float> %r
}}
"""  # the broadcast operand last: LLVM folds its load into the instruction ({1to16})
QUADS_DOT = "relay_amp_experts_dpbusd"  # acc[16] + 16 vpdpbusd sums of four uint8 x int8 products
QUADS_DOT_IR = f"""
declare <16 x i32> @{INT8_DOT.llvm_intrinsic}(<16 x i32>, <16 x i32>, <16 x i32>)
define <16 x i32> @{QUADS_DOT}(<16 x i32> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {{
  %r = call <16 x i32> @{INT8_DOT.llvm_intrinsic}(<16 x i32> %acc, <16 x i32> %a, <16 x i32> %b)
  ret <16 x i32> %r
}}
"""
CODES = ("uint8", "int8")  # activation codes an int8 kernel reads
SIGNED_SHIFT = -0x7F7F7F80  # 0x80808080 as int32: XOR-ed over four int8 codes, each becomes its uint8 code + 128


@dataclass(frozen=True)
class ExpertSpec:
    """A take of `rows` rows (index token * experts + expert) out of the (tokens * experts, columns) product of
    (tokens, depth) operands by a (depth, experts * columns) constant, in `dtype`, stored in `out_dtype`."""
    tokens: int
    depth: int
    experts: int
    columns: int
    rows: int
    dtype: str
    out_dtype: str
    index_dtype: str
    group: int = 1  # BF16_DOT.group: bf16 operands in pairs on vdpbf16ps; INT8_DOT.group: 8-bit codes in fours on
    # vpdpbusd; 1: fp32 FMAs (int32 products for codes), operands widened
    int4_group: int = 0  # the depths of each scale of an int4 weight (relay_amp.packed_int4's layout); 0: float weights
    amx: bool = False  # computed on AMX tiles (relay_amp.backend.cpu.amx_experts)

    @property
    def codes(self) -> bool:
        """Whether the operands are 8-bit codes and the weight int8 (quantize's int8 expert products)."""
        return self.dtype in CODES

    @property
    def tile(self) -> "tuple[int, int]":
        """(16-column blocks, rows) of the register tile: as many accumulators (and, for int4, group sums) as the
        target's registers hold next to a weight vector per block and a broadcast operand, rows first."""
        registers = register_file()
        blocks = self.columns // LANES
        per_row = 1 + CHAINS if self.int4_group else 1  # int4: each accumulator and its group's sums

        def rows_for(panels: int) -> int:
            free = registers.registers - 1 - panels * registers.per_vector
            return min(MAX_TILE_ROWS, free // (per_row * panels * registers.per_vector))
        fitting = [p for p in PANEL_CHOICES if blocks % p == 0 and rows_for(p) > 0]
        panels = max(fitting, key=lambda p: (rows_for(p), p * rows_for(p)))
        return panels, rows_for(panels)


def packed_weight(weight: np.ndarray, spec: ExpertSpec) -> np.ndarray:
    """A (depth, experts * columns) weight as `expert_kernel` reads it: (experts, columns / 16, depth / group, 16),
    each 16 columns' `spec.group` consecutive depths one element (bf16 pairs as uint32 words)."""
    blocks, group = spec.columns // LANES, spec.group
    split = weight.reshape(spec.depth // group, group, spec.experts, blocks, LANES)
    packed = np.ascontiguousarray(split.transpose(2, 3, 0, 4, 1))
    return packed[..., 0] if group == 1 else packed.view(np.int32 if spec.codes else np.uint32)[..., 0]


def expert_kernel(spec: ExpertSpec) -> tvm.tirx.PrimFunc:
    """The kernel computing `spec`'s take: (operands, index, packed weight[, int4 scales][, int8's affine per
    column and row scales]) -> (rows, columns)."""
    if spec.amx:
        return amx_experts.expert_kernel(spec)
    panels, tile_rows = spec.tile
    tokens, depth, experts, columns, rows, group = (spec.tokens, spec.depth, spec.experts, spec.columns, spec.rows,
                                                    spec.group)
    items = experts * columns // (LANES * panels)  # (panel of blocks, expert) pairs
    quads = spec.codes and group == INT8_DOT.group
    annotations = {"pragma_import_llvm": QUADS_DOT_IR if quads else PAIRS_DOT_IR} if group > 1 else {}
    # the operands' bf16 pairs or four codes as 32-bit words
    pair_dtype = "int32" if quads else "uint32" if group == BF16_DOT.group else spec.dtype
    weight_dtype = "int8" if spec.codes and group == 1 else pair_dtype
    acc_dtype, dot = ("int32", QUADS_DOT) if spec.codes else ("float32", PAIRS_DOT)  # dot: for group > 1
    word_shift = SIGNED_SHIFT if quads and spec.dtype == "int8" else 0  # XOR-ed over each word of operands
    vector = tvm.tirx.Ramp(0, 1, LANES)  # a whole 16-lane vector's indices
    int4_group = spec.int4_group
    offset = ZERO_POINT + (BIAS_128 if group == BF16_DOT.group else 0)  # what an int4 code reads beyond its weight
    sums_shape = (tokens, depth // int4_group) if int4_group else (1, 1)
    with fast_script_parsing():
        @T.macro
        def dot_products(acc, data, pairs, weight, scales, sums, token, expert, block, height):
            """acc[r, p] += each of the tile's `height` rows' operands times the weight's 16 columns of block + p,
            over the depth: fp32 sums (int32 for 8-bit codes, int8 ones XOR-ed into uint8 + 128 on vpdpbusd)."""
            for k in range(depth // group):
                for r in T.unroll(height):
                    for p in T.unroll(panels):
                        if group == 1:
                            for lane in T.vectorized(LANES):
                                acc[r, p, lane] += T.Cast(acc_dtype, data[token[r], k]) * T.Cast(
                                    acc_dtype, weight[expert, block + p, k, lane])
                        else:
                            acc[r, p, vector] = T.call_extern(f"{acc_dtype}x{LANES}", dot, acc[r, p, vector],
                                                              T.Broadcast(T.bitwise_xor(pairs[token[r], k], T.Cast(
                                                                  pair_dtype, word_shift)), LANES),
                                                              weight[expert, block + p, k, vector])

        @T.macro
        def int4_products(acc, data, pairs, weight, scales, sums, token, expert, block, height):
            """The same over int4 codes: per group of depths, each row's operands times each nibble (bf16 pairs on
            vdpbf16ps: 128 + the nibble, a bf16 of 128 OR-ed over each pair of nibbles; else widened to fp32), less
            `offset` times the operands' sum over the group (`sums`), times the group's scales."""
            wide = T.alloc_buffer((panels, LANES), "float32", scope="local")
            words = T.alloc_buffer((panels, LANES), "uint32", scope="local")
            # two chains of sums, even and odd pairs of depths: a row's products wait on half as many before them
            grouped_sums = T.alloc_buffer((CHAINS, tile_rows, panels, LANES), "float32", scope="local")
            for g in range(depth // int4_group):
                for c, r, p in T.grid(CHAINS, height, panels):
                    for lane in T.vectorized(LANES):
                        grouped_sums[c, r, p, lane] = T.float32(0)
                for word in range(g * (int4_group // ROWS_PER_WORD), (g + 1) * (int4_group // ROWS_PER_WORD)):
                    for pair in T.unroll(ROWS_PER_WORD // 2):  # depths 2 pair and 2 pair + 1: one nibble each half
                        if group == BF16_DOT.group:
                            for p in T.unroll(panels):
                                for lane in T.vectorized(LANES):
                                    words[p, lane] = T.bitwise_or(T.bitwise_and(T.shift_right(
                                        weight[expert, block + p, word, lane], T.uint32(4 * pair)),
                                        T.uint32(NIBBLE_PAIRS)), T.uint32(BF16_128_PAIR))
                            for r in T.unroll(height):
                                for p in T.unroll(panels):
                                    grouped_sums[pair % CHAINS, r, p, vector] = T.call_extern(
                                        "float32x16", PAIRS_DOT, grouped_sums[pair % CHAINS, r, p, vector],
                                        T.Broadcast(pairs[token[r], word * (ROWS_PER_WORD // 2) + pair], LANES),
                                        words[p, vector])
                        else:
                            for half in T.unroll(2):
                                for p in T.unroll(panels):
                                    for lane in T.vectorized(LANES):
                                        wide[p, lane] = T.Cast("float32", T.bitwise_and(T.shift_right(
                                            weight[expert, block + p, word, lane], T.uint32(16 * half + 4 * pair)),
                                            T.uint32(15)))
                                for r in T.unroll(height):
                                    for p in T.unroll(panels):
                                        for lane in T.vectorized(LANES):
                                            grouped_sums[pair % CHAINS, r, p, lane] += T.Cast("float32", data[
                                                token[r], word * ROWS_PER_WORD + 2 * pair + half]) * wide[p, lane]
                for r in T.unroll(height):
                    for p in T.unroll(panels):
                        for lane in T.vectorized(LANES):
                            acc[r, p, lane] += (grouped_sums[0, r, p, lane] + grouped_sums[1, r, p, lane]
                                                - T.float32(offset) * sums[token[r], g]) * scales[
                                g, (expert * (columns // LANES) + block + p) * LANES + lane]

        @T.macro
        def int8_products(acc, data, pairs, weight, scales, sums, token, expert, block, height):
            """acc[r, p] = each of the tile's rows' codes times the weight's int8 codes of block + p over the depth,
            summed in int32 (`dot_products`)."""
            sums32 = T.alloc_buffer((tile_rows, panels, LANES), "int32", scope="local")
            for r, p in T.grid(height, panels):
                for lane in T.vectorized(LANES):
                    sums32[r, p, lane] = 0
            dot_products(sums32, data, pairs, weight, scales, sums, token, expert, block, height)
            for r, p in T.grid(height, panels):
                for lane in T.vectorized(LANES):
                    acc[r, p, lane] = T.Cast("float32", sums32[r, p, lane])

        products = int4_products if int4_group else int8_products if spec.codes else dot_products

        @T.macro
        def sort_by_expert(index, start, order):
            """A counting sort of the rows by expert (index % experts): order holds them, expert e's from start[e]."""
            fill = T.alloc_buffer((experts,), "int32")
            for e in range(experts + 1):
                start[e] = 0
            for s in range(rows):
                start[T.Cast("int32", T.floormod(index[s], experts)) + 1] += 1
            for e in range(experts):
                start[e + 1] += start[e]
                fill[e] = start[e]
            for s in range(rows):
                order[fill[T.Cast("int32", T.floormod(index[s], experts))]] = s
                fill[T.Cast("int32", T.floormod(index[s], experts))] += 1

        @T.macro
        def tile_of(data, pairs, weight, scales, row_scales, sums, out, index, order, token, acc, expert, block,
                    first, height):
            """The `height` sorted rows from `first` times `expert`'s 16-column blocks from `block` (int8: each
            column's affine, `scales`, and each token's row scale applied)."""
            for r in T.unroll(height):
                token[r] = T.Cast("int32", T.max(T.min(T.floordiv(index[order[first + r]], experts), tokens - 1), 0))
                for p in T.unroll(panels):
                    for lane in T.vectorized(LANES):
                        acc[r, p, lane] = T.float32(0)
            products(acc, data, pairs, weight, scales, sums, token, expert, block, height)
            for r in T.unroll(height):
                for p in T.unroll(panels):
                    for lane in T.vectorized(LANES):
                        if spec.codes:
                            out[order[first + r], (block + p) * LANES + lane] = T.Cast(spec.out_dtype, (
                                acc[r, p, lane] * scales[0, (expert * (columns // LANES) + block + p) * LANES + lane]
                                + scales[1, (expert * (columns // LANES) + block + p) * LANES + lane])
                                * row_scales[token[r], 0]
                                + scales[2, (expert * (columns // LANES) + block + p) * LANES + lane])
                        else:
                            out[order[first + r], (block + p) * LANES + lane] = T.Cast(spec.out_dtype,
                                                                                       acc[r, p, lane])

        @T.macro
        def grouped(data, index, weight, scales, row_scales, out):
            """Each expert's sorted rows a tile at a time (the last ones one at a time) times its weight, in
            parallel over (panel, expert): each thread's share of the items holds panels of every expert, so the
            routed experts' work is split between the threads wherever the routing puts it."""
            pairs = T.decl_buffer((tokens, depth // group), pair_dtype, data=data.data)
            start = T.alloc_buffer((experts + 1,), "int32")  # the first sorted row of each expert
            order = T.alloc_buffer((rows,), "int32")  # the taken rows, sorted by expert
            sort_by_expert(index, start, order)
            sums = T.alloc_buffer(sums_shape, "float32")  # int4: each token's operands summed per group of depths
            if int4_group > 0:
                for t, g in T.grid(tokens, depth // int4_group):
                    sums[t, g] = T.float32(0)
                    for d in range(int4_group):
                        sums[t, g] += T.Cast("float32", data[t, g * int4_group + d])
            for item in T.parallel(items, annotations=annotations):
                token = T.alloc_buffer((tile_rows,), "int32", scope="local")
                acc = T.alloc_buffer((tile_rows, panels, LANES), "float32", scope="local")
                first = start[item % experts]
                count = start[item % experts + 1] - first
                for tile in range(count // tile_rows):
                    tile_of(data, pairs, weight, scales, row_scales, sums, out, index, order, token, acc,
                            item % experts, item // experts * panels, first + tile * tile_rows, tile_rows)
                for rest in range(count % tile_rows):
                    tile_of(data, pairs, weight, scales, row_scales, sums, out, index, order, token, acc,
                            item % experts, item // experts * panels, first + count // tile_rows * tile_rows + rest, 1)

        if int4_group:
            @T.prim_func(s_tir=True)
            def kernel(data: T.Buffer((tokens, depth), spec.dtype), index: T.Buffer((rows,), spec.index_dtype),
                       weight: T.Buffer((experts, columns // LANES, depth // ROWS_PER_WORD, LANES), "uint32"),
                       scales: T.Buffer((depth // int4_group, experts * columns), "float32"),
                       out: T.Buffer((rows, columns), spec.out_dtype)):
                T.func_attr({"tirx.noalias": True})
                with T.sblock("root"):
                    grouped(data, index, weight, scales, scales, out)
        elif spec.codes:
            @T.prim_func(s_tir=True)
            def kernel(data: T.Buffer((tokens, depth), spec.dtype), index: T.Buffer((rows,), spec.index_dtype),
                       weight: T.Buffer((experts, columns // LANES, depth // group, LANES), weight_dtype),
                       affine: T.Buffer((AFFINE_ROWS, experts * columns), "float32"),
                       row_scales: T.Buffer((tokens, 1), "float32"), out: T.Buffer((rows, columns), spec.out_dtype)):
                T.func_attr({"tirx.noalias": True})
                with T.sblock("root"):
                    grouped(data, index, weight, affine, row_scales, out)
        else:
            @T.prim_func(s_tir=True)
            def kernel(data: T.Buffer((tokens, depth), spec.dtype), index: T.Buffer((rows,), spec.index_dtype),
                       weight: T.Buffer((experts, columns // LANES, depth // group, LANES), pair_dtype),
                       out: T.Buffer((rows, columns), spec.out_dtype)):
                T.func_attr({"tirx.noalias": True})
                with T.sblock("root"):
                    grouped(data, index, weight, weight, weight, out)
    sch = s_tir.Schedule(kernel)
    sch.annotate(get_root_block(sch), "schedule_rule", "None")  # MetaSchedule's rules leave it as written
    scheduled = sch.mod["main"].without_attr("global_symbol")
    return opaque_scheduled(scheduled)


@relax.expr_functor.mutator
class _ExpertRows(relax.PyExprMutator):
    """Replaces each take of rows out of a reshaped product by every expert's weight (read by the take alone), and
    each matmul of expert weights gathered per row, with a call of `expert_kernel`."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        super().__init__(mod)
        self.mod = mod
        self.uses = read_counts(func)
        self.kernels: dict = {}  # ExpertSpec -> the kernel's GlobalVar (add_func_once)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        name = call_op_name(new_call)
        rewritten = None
        if name == TAKE:
            rewritten = self._taken_product(new_call)
            rewritten = self._taken_int4_product(new_call) if rewritten is None else rewritten
            rewritten = self._taken_int8_product(new_call) if rewritten is None else rewritten
        elif name == MATMUL:
            rewritten = self._gathered_weights(new_call)
        return new_call if rewritten is None else rewritten

    def _taken_product(self, take: relax.Call) -> "relax.Expr | None":
        """The kernel's call where `take` reads rows out of a product by every expert's weight (the frontend's
        dense form), nothing else reading the product; else None."""
        product = taken_product(take, self.lookup_binding, self.uses)
        if product is None or not is_static_shape(tensor_shape(take)):
            return None
        (data, weight), index = self.lookup_binding(product).args, take.args[1]
        (tokens, depth), (rows, columns) = tensor_shape(data), tensor_shape(take)
        dtype, group = tensor_dtype(data), _group(tensor_dtype(data), depth)
        spec = ExpertSpec(tokens, depth, tensor_shape(weight)[1] // columns, columns, rows, dtype, tensor_dtype(take),
                          tensor_dtype(index), group, amx=_on_amx(dtype, depth, columns, group))
        computed = _computes(spec, tensor_dtype(weight))
        return self._kernel_call(spec, data, index, weight.value.numpy()) if computed else None

    def _taken_int4_product(self, take: relax.Call) -> "relax.Expr | None":
        """The kernel's call on int4 codes where `take` reads rows out of weight-only int4's product by every
        expert's packed weight (quantize_weights' reference kernel on symmetric codes, reshaped or cast), nothing
        else reading the product; else None."""
        table, index = take.args
        product = table
        while call_op_name(bound_once(product, self.lookup_binding, self.uses)) in (RESHAPE, CAST):
            product = self.lookup_binding(product).args[0]  # AMP's cast of the product: the kernel's store
        call = self.lookup_binding(product) if isinstance(product, relax.Var) else None
        packed = spec_of(called_prim_func(self.mod, call)) if call_op_name(call) == "relax.call_tir" else None
        if packed is None or self.uses.get(product, 0) != 1 or not takes_rows(take) \
                or not is_static_shape(tensor_shape(take)):
            return None
        data, codes, scales = call.args[1].fields
        rows, columns = tensor_shape(take)
        spec = ExpertSpec(packed.rows, packed.depth, packed.columns // columns, columns, rows, packed.data_dtype,
                          tensor_dtype(take), tensor_dtype(index), _group(packed.data_dtype, packed.depth),
                          packed.group_size)
        if not (_computes(spec, packed.data_dtype) and isinstance(codes, tvm.ir.expr.Constant)
                and tensor_shape(table) == (packed.rows * spec.experts, columns)):
            return None
        gvar = add_func_once(self.builder_, self.kernels, spec, lambda: expert_kernel(spec), "expert_matmul")
        blocks = codes.value.numpy().reshape(spec.experts, columns // LANES, packed.depth // ROWS_PER_WORD, LANES)
        return relax.call_tir(gvar, [data, index, relax.const(blocks), scales],
                              relax.TensorType((rows, columns), spec.out_dtype))

    def _taken_int8_product(self, take: relax.Call) -> "relax.Expr | None":
        """The int8 kernel's call where `take` reads rows out of quantize's int8 product by every expert's weight
        (8-bit codes times int8 weight codes summed in int32, cast to fp32, then per-column multiplies and adds and
        one multiply by each token's row scale, reshaped), nothing else reading it; else None."""
        table, index = take.args
        chain = self._int8_chain(table)
        if chain is None or not takes_rows(take) or not is_static_shape(tensor_shape(take)):
            return None
        (codes, weight), steps = chain[0].args, chain[1]
        if not (isinstance(weight, tvm.ir.expr.Constant) and tensor_dtype(weight) == "int8"
                and is_static_shape(tensor_shape(codes)) and len(tensor_shape(codes)) == 2):
            return None
        (tokens, depth), (rows, columns) = tensor_shape(codes), tensor_shape(take)
        experts = tensor_shape(weight)[-1] // columns
        group = _group(tensor_dtype(codes), depth)
        spec = ExpertSpec(tokens, depth, experts, columns, rows, tensor_dtype(codes), tensor_dtype(take),
                          tensor_dtype(index), group, amx=_on_amx(tensor_dtype(codes), depth, columns, group))
        folded = _affine(steps, experts * columns, tokens)
        if folded is None or tensor_shape(weight) != (depth, experts * columns) or tensor_shape(table) != (
                tokens * experts, columns) or not _computes(spec, "int8"):
            return None
        affine, row_scales = folded
        values = weight.value.numpy()
        if spec.group == INT8_DOT.group and spec.dtype == "int8" and not spec.amx:  # vpdpbusd: int8 codes + 128
            affine[1] -= INT8_SHIFT * values.astype("int64").sum(axis=0) * affine[0]
        gvar = add_func_once(self.builder_, self.kernels, spec, lambda: expert_kernel(spec), "expert_matmul")
        ones = relax.const(np.ones((tokens, 1), "float32"))
        return relax.call_tir(gvar, [codes, index, relax.const(packed_weight(values, spec)),
                                     relax.const(affine.astype("float32")), ones if row_scales is None else row_scales],
                              relax.TensorType((rows, columns), spec.out_dtype))

    def _int8_chain(self, table: relax.Expr) -> "tuple[relax.Call, list] | None":
        """(the int32 matmul, the (op, operand) steps from its sums to the product, in order) where `table` is a
        reshape of them, each value read once (float casts between steps are passed over); else None."""
        reshape = bound_once(table, self.lookup_binding, self.uses)
        if call_op_name(reshape) != RESHAPE:
            return None
        steps, value = [], reshape.args[0]
        while True:
            call = bound_once(value, self.lookup_binding, self.uses)
            name = call_op_name(call)
            if name == CAST and tensor_dtype(call.args[0]) == "int32":
                matmul = bound_once(call.args[0], self.lookup_binding, self.uses)
                return (matmul, steps[::-1]) if call_op_name(matmul) == MATMUL else None
            if name == CAST and tensor_dtype(call) in MODEL_FLOAT_DTYPES:
                value = call.args[0]
                continue
            chained = [arg for arg in call.args if isinstance(arg, relax.Var)
                       and tensor_shape(arg) == tensor_shape(call)] if name in (MULTIPLY, ADD) else []
            if len(chained) != 1:
                return None
            steps.append((name, call.args[1] if call.args[0].same_as(chained[0]) else call.args[0]))
            value = chained[0]

    def _gathered_weights(self, matmul: relax.Call) -> "relax.Expr | None":
        """The kernel's call, reshaped as `matmul`'s output, where `matmul` multiplies each row (or column) by its
        expert's weight gathered out of a constant stack (a decode step's experts); else None."""
        gathered = gathered_experts(matmul, self)
        if gathered is None or not is_static_shape(tensor_shape(matmul)):
            return None
        rows, experts, dtype = gathered.rows, gathered.stack.shape[0], tensor_dtype(gathered.vector)
        spec = ExpertSpec(rows, gathered.depth, experts, gathered.width, rows, dtype, tensor_dtype(matmul), "int64",
                          _group(dtype, gathered.depth))
        if not _computes(spec, str(gathered.stack.dtype)):
            return None
        data = self.builder_.emit(relax.op.reshape(gathered.vector, [rows, gathered.depth]))
        index = self.builder_.emit(relax.op.add(relax.const(np.arange(rows) * experts, "int64"),
                                                gathered.flat_index()))
        called = self.builder_.emit(self._kernel_call(spec, data, index, gathered.every_weight()))
        return relax.op.reshape(called, tensor_shape(matmul))

    def _kernel_call(self, spec: ExpertSpec, data: relax.Expr, index: relax.Expr, weight: np.ndarray) -> relax.Call:
        """The call of `spec`'s kernel on (data, index) and `weight` (depth, experts * columns), packed."""
        gvar = add_func_once(self.builder_, self.kernels, spec, lambda: expert_kernel(spec), "expert_matmul")
        return relax.call_tir(gvar, [data, index, relax.const(packed_weight(weight, spec))],
                              relax.TensorType((spec.rows, spec.columns), spec.out_dtype))


def _group(dtype: str, depth: int) -> int:
    """The depths each product of the kernel for `dtype` operands takes at once on the current target: bf16 pairs
    where the dot-product kernels compute bf16 there (`kernel_dtypes`: vdpbf16ps, not slower than fp32's FMA on the
    core) and the depth is even; four 8-bit codes where it has AVX-512 VNNI and the depth is a multiple of 4; else
    1."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None:
        return 1
    if dtype in CODES:
        return INT8_DOT.group if depth % INT8_DOT.group == 0 and int8_expert_products(target) else 1
    dot = dtype == BF16_DOT.a_dtype and depth % BF16_DOT.group == 0 and dtype in kernel_dtypes(target)
    return BF16_DOT.group if dot else 1


def _on_amx(dtype: str, depth: int, columns: int, group: int) -> bool:
    """Whether the current target computes the products of `dtype` operands of `depth` by experts of `columns` on
    AMX tiles (`amx_experts.supports`), their weight packed in the 32-bit groups of depths AMX's B tiles take."""
    target = tvm.target.Target.current(allow_none=True)
    return (target is not None and amx_experts.supports(dtype, depth, columns, amx.target_dtypes(target))
            and group == 4 // amx.PRODUCTS[dtype].element_bytes)


def _affine(steps: list, columns: int, tokens: int) -> "tuple[np.ndarray, relax.Expr | None] | None":
    """(A, B, C) per column (AFFINE_ROWS x columns, float64), and the (tokens, 1) row scales or None, such that
    `steps` applied in order to sums give (sums x A + B) x row scales + C; None where a step is neither a multiply
    or add of a scalar or per-column constant nor the one multiply by an fp32 (tokens, 1) tensor."""
    affine = np.stack([np.ones(columns), np.zeros(columns), np.zeros(columns)])
    row_scales = None
    for name, operand in steps:
        if isinstance(operand, tvm.ir.expr.Constant):
            values = operand.value.numpy().astype("float64")
            if values.size != 1 and (values.size != columns or values.shape[-1] != columns):
                return None
            values = np.broadcast_to(values.reshape(-1), (columns,))
            if name == MULTIPLY:
                affine *= values
            else:
                affine[1 if row_scales is None else 2] += values
        elif name == MULTIPLY and row_scales is None and tensor_shape(operand) == (tokens, 1) \
                and tensor_dtype(operand) == "float32":
            row_scales = operand
        else:
            return None
    return affine, row_scales


def _computes(spec: ExpertSpec, weight_dtype: str) -> bool:
    """Whether `expert_kernel` computes `spec` by a weight of `weight_dtype`: two experts or more, float operands
    of the weight's dtype (or 8-bit codes and int8 weight codes), whole 16-column blocks, and fewer rows than the
    product by every expert has."""
    dtypes = {spec.dtype, weight_dtype}
    operands = weight_dtype == "int8" if spec.codes else dtypes <= set(MODEL_FLOAT_DTYPES) and len(dtypes) == 1
    return (spec.experts > 1 and spec.columns % LANES == 0 and operands and spec.out_dtype in MODEL_FLOAT_DTYPES
            and spec.rows < spec.tokens * spec.experts)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.GroupedExpertMatmuls")
class GroupedExpertMatmuls:
    """Every take of rows out of a reshaped matmul by a constant (depth, experts * columns) weight, rows indexed
    token * experts + expert (relay_amp's mixture-of-experts form), and every matmul of expert weights gathered per
    row out of a constant stack (a decode step's), computed by `expert_kernel` instead: only each row's own
    expert's products, grouped by expert, no weight copied."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        get_function(mod, self.func)  # a ModuleError naming the functions the module has, where it lacks `func`
        if not calls_any_op(mod, GATHERS):
            return mod
        mutator = _ExpertRows(mod, get_function(mod, self.func))
        rewritten = rewrite_function(mutator, mod, self.func)
        return EliminateDeadCode()(rewritten) if mutator.kernels else mod
