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
sort of the taken rows by expert, then, in parallel over (expert, block of columns), each expert's rows a tile at a
time (4 rows of 64 columns on AVX-512) times its weight, packed so that each 16 columns of an expert are one stream
of depths, and each row's outputs stored where the take put them. fp32 (and fp16, widened as loaded) on FMAs; bf16
on `vdpbf16ps` over pairs of depths where the target has it (a 32-bit word per pair, broadcast from the row), else
widened. A decode step's matmul of gathered weights takes the same kernel, each row its own token, and reads each
chosen expert's weight in place. Only the routed rows' products are computed; an expert's weight is read once per
tile of its rows, and not at all where no row chose it. The decoder above: fp32 19.0 ms, bf16 11.0 ms; one token
6.0 -> 2.6 ms and 3.4 -> 1.7 ms (its up and down projections alone, 64 tokens of 512 by 64 experts of 512, top 8,
then the 512 rows by experts of 256 back: fp32 2.3 + 1.2 ms, bf16 1.6 + 0.5 ms, bf16 widened to FMAs 2.1 + 0.9 ms).
"""

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, s_tir
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.script import tirx as T

from ..._dead_code import EliminateDeadCode
from ..._expert_matmuls import GATHERS, MATMUL, TAKE, gathered_experts, taken_product
from ..._ir import (OPAQUE_PATTERN, add_func_once, calls_any_op, fast_script_parsing, get_function, is_static_shape,
                    read_counts, rewrite_function, tensor_dtype, tensor_shape)
from ...dtypes import MODEL_FLOAT_DTYPES
from ...ops import call_op_name
from .dispatch import kernel_dtypes
from .kernels import BF16_DOT, LANES, register_file

MAX_TILE_ROWS = 4  # rows a tile multiplies by each weight vector it loads (more did not run faster on Zen 4)
PANEL_CHOICES = (4, 2, 1)  # 16-column blocks of a tile, preferred in this order
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
    group: int = 1  # BF16_DOT.group: bf16 operands in pairs on vdpbf16ps; 1: fp32 FMAs, operands widened

    @property
    def tile(self) -> "tuple[int, int]":
        """(16-column blocks, rows) of the register tile: as many accumulators as the target's registers hold next to
        a weight vector per block and a broadcast operand, rows first."""
        registers = register_file()
        blocks = self.columns // LANES

        def rows_for(panels: int) -> int:
            free = registers.registers - 1 - panels * registers.per_vector
            return min(MAX_TILE_ROWS, free // (panels * registers.per_vector))
        fitting = [p for p in PANEL_CHOICES if blocks % p == 0 and rows_for(p) > 0]
        panels = max(fitting, key=lambda p: (rows_for(p), p * rows_for(p)))
        return panels, rows_for(panels)


def packed_weight(weight: np.ndarray, spec: ExpertSpec) -> np.ndarray:
    """A (depth, experts * columns) weight as `expert_kernel` reads it: (experts, columns / 16, depth / group, 16),
    each 16 columns' `spec.group` consecutive depths one element (bf16 pairs as uint32 words)."""
    blocks, group = spec.columns // LANES, spec.group
    split = weight.reshape(spec.depth // group, group, spec.experts, blocks, LANES)
    packed = np.ascontiguousarray(split.transpose(2, 3, 0, 4, 1))
    return packed.view(np.uint32)[..., 0] if group == BF16_DOT.group else packed[..., 0]


def expert_kernel(spec: ExpertSpec) -> tvm.tirx.PrimFunc:
    """The kernel computing `spec`'s take: (operands, index, packed weight) -> (rows, columns)."""
    panels, tile_rows = spec.tile
    tokens, depth, experts, columns, rows, group = (spec.tokens, spec.depth, spec.experts, spec.columns, spec.rows,
                                                    spec.group)
    items = experts * columns // (LANES * panels)  # (expert, panel of blocks) pairs
    per_expert = items // experts
    annotations = {"pragma_import_llvm": PAIRS_DOT_IR} if group == BF16_DOT.group else {}
    pair_dtype = "uint32" if group == BF16_DOT.group else spec.dtype  # the operands' bf16 pairs as 32-bit words
    vector = tvm.tirx.Ramp(0, 1, LANES)  # a whole 16-lane vector's indices
    with fast_script_parsing():
        @T.macro
        def products(acc, data, pairs, weight, token, expert, block):
            """acc[r, p] += each tile row's operands times the weight's 16 columns of block + p, over the depth."""
            for k in range(depth // group):
                for r in T.unroll(tile_rows):
                    for p in T.unroll(panels):
                        if group == 1:
                            for lane in T.vectorized(LANES):
                                acc[r, p, lane] += T.Cast("float32", data[token[r], k]) * T.Cast(
                                    "float32", weight[expert, block + p, k, lane])
                        else:
                            acc[r, p, vector] = T.call_extern("float32x16", PAIRS_DOT, acc[r, p, vector],
                                                              T.Broadcast(pairs[token[r], k], LANES),
                                                              weight[expert, block + p, k, vector])

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

        @T.prim_func(s_tir=True)
        def kernel(data: T.Buffer((tokens, depth), spec.dtype), index: T.Buffer((rows,), spec.index_dtype),
                   weight: T.Buffer((experts, columns // LANES, depth // group, LANES), pair_dtype),
                   out: T.Buffer((rows, columns), spec.out_dtype)):
            T.func_attr({"tirx.noalias": True})
            with T.sblock("root"):
                pairs = T.decl_buffer((tokens, depth // group), pair_dtype, data=data.data)
                start = T.alloc_buffer((experts + 1,), "int32")  # the first sorted row of each expert
                order = T.alloc_buffer((rows,), "int32")  # the taken rows, sorted by expert
                sort_by_expert(index, start, order)
                for item in T.parallel(items, annotations=annotations):
                    token = T.alloc_buffer((tile_rows,), "int32", scope="local")
                    acc = T.alloc_buffer((tile_rows, panels, LANES), "float32", scope="local")
                    first = start[item // per_expert]
                    count = start[item // per_expert + 1] - first
                    for tile in range((count + tile_rows - 1) // tile_rows):
                        for r in T.unroll(tile_rows):  # rows past the expert's repeat its last one, and are not stored
                            token[r] = T.Cast("int32", T.max(T.min(T.floordiv(
                                index[order[first + T.min(tile * tile_rows + r, count - 1)]], experts), tokens - 1), 0))
                        for r in T.unroll(tile_rows):
                            for p in T.unroll(panels):
                                for lane in T.vectorized(LANES):
                                    acc[r, p, lane] = T.float32(0)
                        products(acc, data, pairs, weight, token, item // per_expert, item % per_expert * panels)
                        for r in range(T.min(tile_rows, count - tile * tile_rows)):
                            for p in T.unroll(panels):
                                for lane in T.vectorized(LANES):
                                    out[order[first + tile * tile_rows + r],
                                        (item % per_expert * panels + p) * LANES + lane] = T.Cast(spec.out_dtype,
                                                                                                 acc[r, p, lane])
    sch = s_tir.Schedule(kernel)
    sch.annotate(get_root_block(sch), "schedule_rule", "None")  # MetaSchedule's rules leave it as written
    scheduled = sch.mod["main"].without_attr("global_symbol")
    return scheduled.with_attrs({"tirx.is_scheduled": True, "op_pattern": OPAQUE_PATTERN})


@relax.expr_functor.mutator
class _ExpertRows(relax.PyExprMutator):
    """Replaces each take of rows out of a reshaped product by every expert's weight (read by the take alone), and
    each matmul of expert weights gathered per row, with a call of `expert_kernel`."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        super().__init__(mod)
        self.uses = read_counts(func)
        self.kernels: dict = {}  # ExpertSpec -> the kernel's GlobalVar (add_func_once)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        name = call_op_name(new_call)
        rewritten = None
        if name == TAKE:
            rewritten = self._taken_product(new_call)
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
        spec = ExpertSpec(tokens, depth, tensor_shape(weight)[1] // columns, columns, rows, tensor_dtype(data),
                          tensor_dtype(take), tensor_dtype(index), _group(tensor_dtype(data), depth))
        computed = _computes(spec, tensor_dtype(weight))
        return self._kernel_call(spec, data, index, weight.value.numpy()) if computed else None

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
    core) and the depth is even, else 1."""
    target = tvm.target.Target.current(allow_none=True)
    dot = (dtype == BF16_DOT.a_dtype and depth % BF16_DOT.group == 0 and target is not None
           and dtype in kernel_dtypes(target))
    return BF16_DOT.group if dot else 1


def _computes(spec: ExpertSpec, weight_dtype: str) -> bool:
    """Whether `expert_kernel` computes `spec` by a weight of `weight_dtype`: two experts or more, float operands
    of the weight's dtype, whole 16-column blocks, and fewer rows than the product by every expert has."""
    dtypes = {spec.dtype, weight_dtype}
    return (spec.experts > 1 and spec.columns % LANES == 0 and dtypes <= set(MODEL_FLOAT_DTYPES) and len(dtypes) == 1
            and spec.out_dtype in MODEL_FLOAT_DTYPES and spec.rows < spec.tokens * spec.experts)


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
