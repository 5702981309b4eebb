"""tensorcore: CUDA schedules that run int8 and float16 matmuls and convolutions on tensor cores (wmma).

TVM 0.27's dlight gives float16 matmuls tensor cores, but its int8 path fails to compile ("fragment_info_")
and it never tensorizes a convolution (nor any GEMM with a side of 64 or less). `TensorCoreRule` treats every
matmul-like block (matmul, batch matmul, dense, conv2d in NCHW, NHWC or HWNC) as the GEMM
C[b, i, j] += A[b, i, k] * B[b, j, k], where a convolution's A is its im2col view, gathered straight from
the input into shared memory. It pads the GEMM to whole tiles and computes it on 16x16x16 wmma fragments:
each warp owns a grid of accumulator fragments, and each block stages K in slices through shared memory.
"""

import math
import re
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import get_index_map, get_reduction_blocks

from ..._ir import import_tensor_intrinsics, index_vars, try_primitive, vars_in
from .short_reductions import ShortReductionRule

FRAGMENT = 16  # wmma m16n16k16: the side of every fragment
WARP_SIZE = 32
MAX_WARPS = 2  # warps per block along i and along j
MAX_FRAGMENTS = 2  # accumulator fragments per warp along i and along j
WMMA_ALIGN_BYTES = 32  # wmma loads need 256-bit aligned fragment pointers
VECTOR_BYTES = 16  # the widest CUDA load/store (int4 / float4)
SHARED = "shared"
# Lanes for a predicated (padded) or transposing copy: TVM 0.27's CUDA codegen writes wider int8 vectors of those
# as code nvcc rejects (make_int4 of 16 chars; 64-bit shifts packing 8 chars into an int)
GATHER_LANES = 4
IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")
KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\([^)]*\) \{')
TENSOR_CORE_MARKS = ("wmma::mma_sync", '"mma.sync.')  # in a kernel's source: a wmma call, or inline PTX mma
# (input dtype, accumulator dtype) -> the lowest sm version whose tensor cores take it
WMMA_DTYPES = {("float16", "float32"): 70, ("float16", "float16"): 70, ("int8", "int32"): 72}


@dataclass(frozen=True)
class _Tile:
    """Warps per block and accumulator fragments per warp along one GEMM axis."""
    warps: int
    fragments: int

    @property
    def size(self) -> int:
        """Rows (or columns) of C one block computes."""
        return self.warps * self.fragments * FRAGMENT


@dataclass(frozen=True)
class _Staging:
    """How an operand is copied to shared memory: vector lanes, and whether they run along K or across it."""
    lanes: int
    along_k: bool


def sm_version(target: tvm.target.Target) -> int:
    """The target's compute capability as an int (sm_80 -> 80), 0 when it is not a CUDA target."""
    if target.kind.name != "cuda":
        return 0
    found = re.fullmatch(r"sm_(\d+)\w*", str(target.attrs.get("arch", "")))
    return int(found.group(1)) if found else 0


def _tile_for(extent) -> _Tile:
    """The tile for a GEMM axis of `extent` (symbolic extents get the largest)."""
    size = int(extent) if isinstance(extent, tirx.IntImm) else MAX_WARPS * MAX_FRAGMENTS * FRAGMENT
    warps = MAX_WARPS if size > FRAGMENT else 1
    fragments = MAX_FRAGMENTS if size > warps * FRAGMENT else 1
    return _Tile(warps, fragments)


def _k_fragments(dtype: str) -> int:
    """Fragments of K per shared-memory stage: two where the second one still starts 256-bit aligned (float16),
    else one (int8: 16 bytes in)."""
    return 2 if FRAGMENT * tvm.DataType(dtype).itemsize % WMMA_ALIGN_BYTES == 0 else 1


def _dtypes(block: s_tir.SBlock) -> tuple[str, str]:
    return str(block.reads[0].source.dtype), str(block.writes[0].source.dtype)


def _fits(extents: list) -> bool:
    """Whether every static GEMM side (m, n, k) reaches a fragment: smaller ones waste the tensor core."""
    return all(int(extent) >= FRAGMENT for extent in extents if isinstance(extent, tirx.IntImm))


def _vector_lanes(access: tvm.ir.TensorRegion, axis: tirx.IterVar, dtype: str) -> int:
    """Lanes for copying `access` along `axis`: up to 16 bytes where its innermost index is that axis alone and
    both the axis and the buffer's innermost extent keep every vector whole and aligned, else 1."""
    innermost = access.region[-1].min
    extents = [access.source.shape[-1], axis.dom.extent]
    if not (isinstance(innermost, tirx.Var) and innermost.same_as(axis.var)
            and all(isinstance(extent, tirx.IntImm) for extent in extents)):
        return 1
    return math.gcd(VECTOR_BYTES // tvm.DataType(dtype).itemsize, *map(int, extents))


class TensorCoreRule(dl.ScheduleRule):
    """Schedules a function's matmul/conv block on wmma tensor cores when its dtypes and shape allow it."""

    def is_target_available(self, target: tvm.target.Target) -> bool:
        """Whether `target` has tensor cores (CUDA, sm_70 or newer)."""
        return sm_version(target) >= 70

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _: bool) -> s_tir.Schedule | None:
        """The tensorized schedule of `func`, or None where it holds no GEMM the tensor cores take."""
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if blocks is None:
            return None
        main = blocks[0]
        stmt = sch.get(main)
        dtypes = _dtypes(stmt)
        if dtypes not in WMMA_DTYPES or WMMA_DTYPES[dtypes] > sm_version(target) or get_index_map(stmt) is None:
            return None
        return _schedule(sch, main, dtypes)


def _inline_producers(sch: s_tir.Schedule, copy) -> None:
    """Inline every producer of an operand's shared-memory copy (reindex and tile padding, a convolution's zero
    padding, casts), so the copy reads the function's inputs."""
    producers = sch.get_producers(copy)
    while producers:
        for producer in producers:
            sch.compute_inline(producer)
        producers = sch.get_producers(copy)


def _inline_consumers(sch: s_tir.Schedule, block) -> None:
    """Inline the epilogue (layout, un-padding, elementwise ops) into `block`, the write-back to global memory.

    Intermediate epilogue blocks are first inlined into their consumers (GELU reads its input three times),
    then the one left reading `block` is inlined into it backwards; raises ScheduleError if one remains."""
    while sch.get_consumers(block):  # one block at a time: a block reached along two paths is listed twice
        if not (any(try_primitive(sch.compute_inline, consumer) for consumer in _all_consumers(sch, block))
                or any(try_primitive(sch.reverse_compute_inline, consumer) for consumer in sch.get_consumers(block))):
            sch.reverse_compute_inline(sch.get_consumers(block)[0])  # raises the reason it cannot be inlined


def _all_consumers(sch: s_tir.Schedule, block) -> list:
    direct = list(sch.get_consumers(block))
    return direct + [later for consumer in direct for later in _all_consumers(sch, consumer)]


def _order_reduction_like_input(sch: s_tir.Schedule, main) -> None:
    """Reorder the block's reduction axes as A's buffer nests them, so K runs along A's contiguous axis.

    A HWNC conv reduces over (c, kh, kw) but reads c innermost; fused in that order, K would step by
    whole pixels, and the im2col copy could not be vectorized."""
    stmt = sch.get(main)
    access = [vars_in(index.min) for index in stmt.reads[0].region]

    def depth(var: tirx.Var) -> int:
        return next((dim for dim, used in enumerate(access) if any(var.same_as(u) for u in used)), -1)

    axes = [(tirx.Var(f"v{n}", it.var.ty), it) for n, it in enumerate(stmt.iter_vars)]
    spatial = [var for var, it in axes if it.iter_type != tirx.IterVar.CommReduce]
    reduction = sorted((pair for pair in axes if pair[1].iter_type == tirx.IterVar.CommReduce),
                       key=lambda pair: depth(pair[1].var))
    sch.transform_block_layout(main, tirx.IndexMap([var for var, _ in axes],
                                                   spatial + [var for var, _ in reduction], None))


def _normalize(sch: s_tir.Schedule, main) -> None:
    """Rewrite the block as C[b, i, j] += A[b, i, k] * B[b, j, k] through reindex stages."""
    stages = [sch.reindex(main, ("read", 0)), sch.reindex(main, ("read", 1)), sch.reindex(main, ("write", 0))]
    block_map, a_map, b_map, c_map = get_index_map(sch.get(main))
    sch.transform_layout(stages[0], ("write", 0), a_map)
    sch.transform_layout(stages[1], ("write", 0), b_map)
    sch.transform_layout(stages[2], ("read", 0), c_map)
    sch.transform_block_layout(main, block_map)


def _schedule(sch: s_tir.Schedule, main, dtypes: tuple[str, str]) -> s_tir.Schedule | None:
    try:
        _order_reduction_like_input(sch, main)
        stmt = sch.get(main)
        staging = [_staging_of(stmt, operand, dtypes[0]) for operand in (0, 1)]
        _normalize(sch, main)
        _, m, n, k = (it.dom.extent for it in sch.get(main).iter_vars)
        if not _fits([m, n, k]):
            return None
        tiles = (_tile_for(m), _tile_for(n))
        sch.pad_einsum(main, [1, tiles[0].size, tiles[1].size, _k_fragments(dtypes[0]) * FRAGMENT])
        _tensorize(sch, main, tiles, staging, dtypes)
    except s_tir.ScheduleError:
        return None
    return sch


def _is_predicated(sch: s_tir.Schedule, block) -> bool:
    """Whether the block selects its value with if_then_else (a convolution's zero padding)."""
    value = sch.get(block).body.value
    while isinstance(value, tirx.Cast):
        value = value.value
    return isinstance(value, tvm.ir.Call) and value.op.same_as(IF_THEN_ELSE)


def _staging_of(stmt: s_tir.SBlock, operand: int, dtype: str) -> _Staging:
    """How to copy operand 0 (A) or 1 (B) to shared memory: along K where its innermost index is the innermost
    reduction axis, across (transposing) where it is its innermost spatial axis (a [K, N] weight), else lane by lane."""
    access = stmt.reads[operand]
    innermost = access.region[-1].min
    used = [it for it in stmt.iter_vars if any(it.var.same_as(var) for var in index_vars(access))]
    spatial = [it for it in used if it.iter_type == tirx.IterVar.DataPar]
    for axis, along_k in ((stmt.iter_vars[-1], True), (spatial[-1] if spatial else None, False)):
        if axis is not None and isinstance(innermost, tirx.Var) and axis.var.same_as(innermost):
            return _Staging(_vector_lanes(access, axis, dtype), along_k)
    return _Staging(1, True)


def _tensorize(sch: s_tir.Schedule, main, tiles: tuple[_Tile, _Tile], staging: list[_Staging],
               dtypes: tuple[str, str]) -> None:
    """Tile to blocks, warps and fragments; stage A and B in shared memory; run the fragments on wmma."""
    batch, i, j, k = sch.get_loops(main)
    i, i_frag = sch.split(i, [None, FRAGMENT])
    j, j_frag = sch.split(j, [None, FRAGMENT])
    k, k_frag = sch.split(k, [None, FRAGMENT])
    sch.reorder(i, j, k, i_frag, j_frag, k_frag)
    outer = sch.blockize(i_frag)
    i_block, i_warp, i_inner = sch.split(i, [None, tiles[0].warps, tiles[0].fragments])
    j_block, j_warp, j_inner = sch.split(j, [None, tiles[1].warps, tiles[1].fragments])
    k_stage, k_inner = sch.split(k, [None, _k_fragments(dtypes[0])])
    sch.reorder(i_block, j_block, i_warp, j_warp, k_stage, k_inner, i_inner, j_inner)
    sch.bind(batch, "blockIdx.y")
    sch.bind(sch.fuse(i_block, j_block), "blockIdx.x")
    warp = sch.fuse(i_warp, j_warp)
    sch.bind(warp, "threadIdx.y")
    warps = tiles[0].warps * tiles[1].warps
    for operand in (0, 1):
        _stage_in_shared(sch, outer, operand, k_stage, warps, staging[operand])
    fragments = [sch.cache_read(outer, 0, "wmma.matrix_a"), sch.cache_read(outer, 1, "wmma.matrix_b")]
    for fragment in fragments:
        sch.compute_at(fragment, k_inner)
    write_back = sch.cache_write(outer, 0, SHARED)
    sch.storage_align(write_back, 0, axis=-2, factor=16, offset=4)
    store = sch.cache_write(outer, 0, "wmma.accumulator")
    sch.reverse_compute_at(store, warp)
    sch.reverse_compute_at(write_back, warp)
    init = sch.decompose_reduction(outer, k_stage)
    wmma = import_tensor_intrinsics("tvm.s_tir.tensor_intrin.cuda")
    intrinsics = wmma.get_wmma_intrin_group(load_scope=SHARED, store_scope=SHARED, in_dtype=dtypes[0],
                                            out_dtype=dtypes[1], trans_b=True)
    for fragment, name in zip(fragments, ("load_a", "load_b")):
        sch.tensorize(_fragment_loop(sch, fragment), intrinsics[name])
    sch.tensorize(_fragment_loop(sch, store), intrinsics["store"])
    sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], intrinsics["init"])
    sch.tensorize(sch.get_loops(main)[-3], intrinsics["compute"])
    _inline_consumers(sch, write_back)
    _spread_over_warp(sch, write_back, _store_lanes(sch, write_back))


def _stage_in_shared(sch: s_tir.Schedule, block, operand: int, k_stage, warps: int, staging: _Staging) -> None:
    """Copy one K stage of an operand to shared memory, spread over every thread of the block, consecutive
    threads on consecutive addresses of the source."""
    copy = sch.cache_read(block, operand, SHARED)
    sch.compute_at(copy, k_stage)
    _inline_producers(sch, copy)
    lanes = staging.lanes if staging.along_k and not _is_predicated(sch, copy) else min(staging.lanes, GATHER_LANES)
    rows, columns = sch.get_loops(copy)[-2:]
    if not staging.along_k:
        sch.reorder(columns, rows)
    fused = sch.fuse(*sch.get_loops(copy)[-2:])
    per_thread = max(1, int(sch.get(fused).extent) // (warps * WARP_SIZE))
    _, warp, thread, vector = sch.split(fused, [None, warps, WARP_SIZE, math.gcd(lanes, per_thread)])
    sch.bind(warp, "threadIdx.y")
    sch.bind(thread, "threadIdx.x")
    sch.vectorize(vector)
    sch.storage_align(copy, 0, axis=-2, factor=32, offset=VECTOR_BYTES // tvm.DataType(_dtype(sch, copy)).itemsize)


def _dtype(sch: s_tir.Schedule, block) -> str:
    return str(sch.get(block).writes[0].source.dtype)


def _fragment_loop(sch: s_tir.Schedule, block):
    """Split a block's two innermost loops into fragments and return the loop a wmma intrinsic replaces."""
    i, j = sch.get_loops(block)[-2:]
    i_outer, i_inner = sch.split(i, [None, FRAGMENT])
    j_outer, j_inner = sch.split(j, [None, FRAGMENT])
    sch.reorder(i_outer, j_outer, i_inner, j_inner)
    return i_inner


def _store_lanes(sch: s_tir.Schedule, block) -> int:
    """Vector lanes for the final store, where the output's innermost index is the block's innermost axis: 16 bytes
    of the output, and no more than 16 bytes of the widest value the epilogue reads, since its arithmetic runs in
    that dtype (an int8 output requantized in fp32 gets 4 lanes). TVM 0.27's CUDA codegen prints wider vectors
    as ulonglong4 and their constants as make_ulonglong4 of 8 floats, which nvcc rejects."""
    stmt = sch.get(block)
    widest = max(tvm.DataType(str(region.source.dtype)).itemsize for region in [*stmt.reads, *stmt.writes])
    return min(_vector_lanes(stmt.writes[0], stmt.iter_vars[-1], _dtype(sch, block)), VECTOR_BYTES // widest)


def _spread_over_warp(sch: s_tir.Schedule, block, lanes: int) -> None:
    fused = sch.fuse(*sch.get_loops(block)[-2:])
    _, thread, vector = sch.split(fused, [None, WARP_SIZE, lanes])
    sch.bind(thread, "threadIdx.x")
    sch.vectorize(vector)


def gpu_schedules() -> tvm.transform.Pass:
    """The pass that schedules every unscheduled CUDA PrimFunc: tensor cores where they fit, short reductions one
    output a thread (relay_amp.backend.cuda.short_reductions), else TVM's dlight rules."""
    return dl.ApplyDefaultSchedule(TensorCoreRule(), dl.gpu.Matmul(), dl.gpu.GEMV(), ShortReductionRule(),
                                   dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())


def tensor_core_kernels(cuda_source: str) -> dict[str, bool]:
    """Each CUDA kernel of a generated source (see relay_amp.cuda_source), by name: whether it runs on tensor cores
    (wmma fragments, or PTX `mma.sync` such as the s4 kernels of relay_amp.backend.cuda.int4)."""
    return {name: any(mark in body for mark in TENSOR_CORE_MARKS) for name, body in kernel_sources(cuda_source).items()}


def kernel_sources(cuda_source: str) -> dict[str, str]:
    """Each CUDA kernel's body in a generated source (see relay_amp.cuda_source), by name."""
    starts = list(KERNEL.finditer(cuda_source))
    ends = [found.start() for found in starts[1:]] + [len(cuda_source)]
    return {found.group(1): cuda_source[found.end():end] for found, end in zip(starts, ends)}
