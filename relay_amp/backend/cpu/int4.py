"""Packed int4 weights on the CPU: `UsePackedInt4Kernels` swaps each weight-only int4 matmul's reference PrimFunc
(relay_amp.passes.weight_only) for a kernel that unpacks the weights in registers.

bf16 activations on a target with `avx512bf16`: per 32-bit word of 16 columns x 8 rows, four shift-and-mask
steps turn the nibbles into bf16 pairs `128 + code` (exponent bits OR-ed over the code: no conversion
instruction) and four `vdpbf16ps` per activation row multiply them by broadcast activation pairs; per group of
rows, the sum of the activations times `128 + 8` is subtracted and the group's scales applied. The loops over the
groups and their words are LLVM IR (`llvm_ir`), with the accumulators and totals in registers. One call unpacks each word once for
up to `rows_per_call` activation rows (a prompt's tokens), so the unpacking is shared by the rows; a batch-1
matmul reads a quarter of its bf16 twin's bytes, and its speed is set by these unpacking instructions rather than
by memory (README, 'int4').

Other activations or targets: the reference computation, parallel over 16-column blocks and vectorized across
them.
"""

import math
from dataclasses import dataclass

import tvm
from tvm import s_tir
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..._ir import opaque_scheduled
from ...packed_int4 import (
    COLUMNS,
    ROWS_PER_WORD,
    SPEC_ATTR,
    ZERO_POINT,
    PackedSpec,
    reference_kernel,
    spec_of,
)

MAGIC = 0x4300  # bf16 bits of 128.0: OR-ed over a 4-bit code it gives 128 + code exactly
OFFSET = 128 + ZERO_POINT  # what the magic numbers add to each weight, taken back per group
MAX_PANELS = 4  # 16-column blocks one parallel item computes: weight streams read at once
MIN_ITEMS = 8  # parallel items wanted before blocks are grouped into panels
MAX_ACCUMULATORS = 16  # zmm accumulators of one call (rows x panels); its unpacked words and temporaries use the rest
DOT = "llvm.x86.avx512bf16.dpbf16ps.512"
FMA = "llvm.fma.v16f32"
VEC = "<16 x float>"


def symbol(panels: int, rows: int = 1) -> str:
    """The LLVM function computing a block of `rows` activation rows for `panels` 16-column blocks."""
    return f"relay_amp_int4_bf16_x{panels}_r{rows}"


def _activation_pairs(row: int) -> list[str]:
    """LLVM lines broadcasting the four bf16 activation pairs of word `%i` of `row` (pair j at bytes 4j)."""
    lines = [f"  %xrow{row} = mul i64 %xstride, {row}", f"  %xoff{row} = add i64 %xrow{row}, %wordx"]
    for j in range(4):
        name = f"{row}_{j}"
        lines += [f"  %xq{name} = add i64 %xoff{row}, {4 * j}",
                  f"  %xp{name} = getelementptr i8, ptr %x, i64 %xq{name}",
                  f"  %xv{name} = load i32, ptr %xp{name}, align 2",
                  f"  %xi{name} = insertelement <16 x i32> poison, i32 %xv{name}, i64 0",
                  f"  %xs{name} = shufflevector <16 x i32> %xi{name}, <16 x i32> poison, <16 x i32> zeroinitializer",
                  f"  %xb{name} = bitcast <16 x i32> %xs{name} to <32 x bfloat>"]
    return lines


def _unpacked_weights(panel: int) -> list[str]:
    """LLVM lines loading one 64-byte word block of `panel` and unpacking its four bf16 pair vectors `%v{p}_{j}`
    (`128 + code`: the code's nibble with the exponent bits of 128.0 OR-ed over it)."""
    p = panel
    lines = [f"  %ps{p} = mul i64 %stride, {p}", f"  %bq{p} = add i64 %boff, %ps{p}",
             f"  %bp{p} = getelementptr i8, ptr %b, i64 %bq{p}", f"  %w{p} = load <32 x i16>, ptr %bp{p}, align 4"]
    for j in range(4):
        source = f"%w{p}"
        if j:
            lines.append(f"  %sh{p}_{j} = lshr <32 x i16> %w{p}, splat (i16 {4 * j})")
            source = f"%sh{p}_{j}"
        lines += [f"  %n{p}_{j} = and <32 x i16> {source}, splat (i16 15)",
                  f"  %m{p}_{j} = or <32 x i16> %n{p}_{j}, splat (i16 {MAGIC})",
                  f"  %v{p}_{j} = bitcast <32 x i16> %m{p}_{j} to <32 x bfloat>"]
    return lines


def _chains(rows: int) -> int:
    """Accumulators per row and block: one row's four products per word go to two chains, to hide the
    instruction's latency; several rows are independent chains already."""
    return 2 if rows == 1 else 1


def _products(panels: int, rows: int, current: dict) -> list[str]:
    """LLVM lines of one word's products: its activation pairs and unpacked weights, each word unpacked once for all
    the rows; `current` maps each accumulator to its latest value and is updated."""
    lines = ["  %gw = mul i64 %g, %words", "  %w = add i64 %gw, %i", "  %wordx = mul i64 %w, 16",
             "  %boff = mul i64 %w, 64"]
    for r in range(rows):
        lines += _activation_pairs(r)
    chains = _chains(rows)
    for p in range(panels):
        lines += _unpacked_weights(p)
        for r in range(rows):
            for j in range(4):
                acc = (r, p, j % chains)
                result = "%r{}_{}_{}_{}".format(r, p, j % chains, j)
                lines.append(f"  {result} = call {VEC} @{DOT}({VEC} {current[acc]}, <32 x bfloat> %v{p}_{j}, "
                             f"<32 x bfloat> %xb{r}_{j})")  # the broadcast last: LLVM folds its load ({1to16})
                current[acc] = result
    return lines


def _scaled_group(panels: int, rows: int, current: dict) -> list[str]:
    """LLVM lines adding a finished group to the totals: %U = %T + scale x (part - OFFSET x activation sum), the
    group's scales per block and each row's activation sum loaded once."""
    lines = []
    for r in range(rows):
        lines += [f"  %so{r} = mul i64 %sumstride, {r}", f"  %sg{r} = mul i64 %g, 4",
                  f"  %sq{r} = add i64 %so{r}, %sg{r}",
                  f"  %sp{r} = getelementptr i8, ptr %sums, i64 %sq{r}", f"  %s{r} = load float, ptr %sp{r}, align 4",
                  f"  %sm{r} = fmul float %s{r}, {float(OFFSET):e}",
                  f"  %si{r} = insertelement {VEC} poison, float %sm{r}, i64 0",
                  f"  %sv{r} = shufflevector {VEC} %si{r}, {VEC} poison, <16 x i32> zeroinitializer"]
    for p in range(panels):
        lines += [f"  %cg{p} = mul i64 %g, %sstride", f"  %cq{p} = add i64 %cg{p}, {p * COLUMNS * 4}",
                  f"  %cp{p} = getelementptr i8, ptr %scales, i64 %cq{p}", f"  %c{p} = load {VEC}, ptr %cp{p}, align 4"]
    for r in range(rows):
        for p in range(panels):
            part = current[(r, p, 0)]
            if _chains(rows) == 2:
                lines.append(f"  %t{r}_{p} = fadd {VEC} {part}, {current[(r, p, 1)]}")
                part = f"%t{r}_{p}"
            lines += [f"  %d{r}_{p} = fsub {VEC} {part}, %sv{r}",
                      f"  %U{r}_{p} = call {VEC} @{FMA}({VEC} %c{p}, {VEC} %d{r}_{p}, {VEC} %T{r}_{p})"]
    return lines


def llvm_ir(panels: int, rows: int = 1) -> str:
    """LLVM IR of `symbol(panels, rows)(out, x, xstride, b, words, stride, scales, sstride, sums, sumstride,
    groups)`: for `rows` rows `xstride` bytes apart from `x`, `panels` blocks `stride` bytes apart from `b` and
    `groups` groups of `words` words, out[row][block][16] = sum over groups of the group's scales (`sstride` bytes
    a group from `scales`) times (the row's bf16 activations times (128 + code), less OFFSET times the row's
    activation sum in the group (`sumstride` bytes a row from `sums`)). The totals stay in registers."""
    chains = _chains(rows)
    accumulators = [(r, p, h) for r in range(rows) for p in range(panels) for h in range(chains)]
    totals = [(r, p) for r in range(rows) for p in range(panels)]
    current = {acc: "%a{}_{}_{}".format(*acc) for acc in accumulators}
    body = _products(panels, rows, current)
    lines = [f"define void @{symbol(panels, rows)}(ptr %out, ptr %x, i64 %xstride, ptr %b, i64 %words, i64 %stride, "
             "ptr %scales, i64 %sstride, ptr %sums, i64 %sumstride, i64 %groups) alwaysinline {",
             "entry:", "  br label %group", "group:", "  %g = phi i64 [0, %entry], [%gnext, %scaled]"]
    lines += ["  %T{}_{} = phi {} [zeroinitializer, %entry], [%U{}_{}, %scaled]".format(r, p, VEC, r, p)
              for r, p in totals]
    lines += ["  br label %loop", "loop:", "  %i = phi i64 [0, %group], [%next, %loop]"]
    lines += ["  %a{}_{}_{} = phi {} [zeroinitializer, %group], [{}, %loop]".format(*acc, VEC, current[acc])
              for acc in accumulators]
    lines += body + ["  %next = add i64 %i, 1", "  %done = icmp eq i64 %next, %words",
                     "  br i1 %done, label %scaled, label %loop", "scaled:"]
    lines += _scaled_group(panels, rows, current)
    lines += ["  %gnext = add i64 %g, 1", "  %gdone = icmp eq i64 %gnext, %groups",
              "  br i1 %gdone, label %exit, label %group", "exit:"]
    for r, p in totals:
        lines += [f"  %o{r}_{p} = getelementptr {VEC}, ptr %out, i64 {r * panels + p}",
                  f"  store {VEC} %U{r}_{p}, ptr %o{r}_{p}, align 4"]
    return "\n".join(lines + ["  ret void", "}", ""])


def llvm_module(panels: int, row_counts: list[int]) -> str:
    """The LLVM IR a kernel imports: the instructions' declarations and `llvm_ir(panels, rows)` for each count."""
    return "\n".join([f"declare {VEC} @{DOT}({VEC}, <32 x bfloat>, <32 x bfloat>)",
                      f"declare {VEC} @{FMA}({VEC}, {VEC}, {VEC})"] + [llvm_ir(panels, rows) for rows in row_counts])


def panels_for(spec: PackedSpec) -> int:
    """16-column blocks per parallel item: as many as MAX_PANELS while MIN_ITEMS items remain."""
    blocks = spec.columns // COLUMNS
    return next(p for p in (MAX_PANELS, 2, 1) if blocks % p == 0 and (blocks // p >= MIN_ITEMS or p == 1))


def rows_per_call(panels: int) -> int:
    """Activation rows one call computes with each word it unpacks: as many as MAX_ACCUMULATORS allow."""
    return MAX_ACCUMULATORS // panels


def bf16_kernel(spec: PackedSpec) -> tvm.tirx.PrimFunc:
    """The scheduled `vdpbf16ps` kernel for `spec` (bf16 activations), same parameters as the reference: blocks
    of `rows_per_call` rows, then the rows left one at a time."""
    panels = panels_for(spec)
    block = min(rows_per_call(panels), spec.rows)
    with IRBuilder() as builder:
        with T.prim_func(s_tir=True):
            T.func_name("main")
            T.func_attr({"tirx.noalias": True})
            data = T.arg("data", T.Buffer((spec.rows, spec.depth), "bfloat16"))
            packed = T.arg("packed", T.Buffer(spec.packed_shape, "uint32"))
            scales = T.arg("scales", T.Buffer(spec.scales_shape, "float32"))
            out = T.arg("out", T.Buffer((spec.rows, spec.columns), spec.out_dtype))
            operands = _Operands(spec, data, packed, scales, _group_sums(spec, data), out)
            groups = spec.depth // spec.group_size
            with T.parallel(0, spec.columns // (COLUMNS * panels)) as item:
                with T.sblock("int4_panels"):
                    T.reads([data[0:spec.rows, 0:spec.depth],
                             packed[0:spec.packed_shape[0], 0:spec.packed_shape[1], 0:COLUMNS],
                             scales[0:groups, 0:spec.columns], operands.sums[0:spec.rows, 0:groups]])
                    T.writes(out[0:spec.rows, 0:spec.columns])
                    totals = T.alloc_buffer((block, panels, COLUMNS), "float32", scope="local")
                    whole = spec.rows // block * block
                    _row_blocks(operands, totals, item, range(0, whole, block))
                    if whole < spec.rows:
                        _row_blocks(operands, totals, item, range(whole, spec.rows))
    func = builder.get()
    sch = s_tir.Schedule(func)
    imported = llvm_module(panels, sorted({block, 1}))
    sch.annotate(sch.get_loops(sch.get_sblock("int4_panels"))[0], "pragma_import_llvm", imported)
    return _as_kernel(sch.mod["main"].without_attr("global_symbol"))


@dataclass(frozen=True)
class _Operands:
    """A kernel's spec and buffers: activations, packed codes, scales, per-group activation sums, output."""
    spec: PackedSpec
    data: object
    packed: object
    scales: object
    sums: object
    out: object


def _row_blocks(operands: _Operands, totals, item, first_rows: range) -> None:
    """The loop over the blocks of rows starting at `first_rows` (`first_rows.step` rows each) for parallel item
    `item`: one call of the LLVM function per block, its totals then stored."""
    spec, size = operands.spec, first_rows.step
    panels, groups = totals.shape[1], spec.depth // spec.group_size
    with T.serial(0, len(first_rows)) as index:
        first = first_rows.start + index * size
        T.evaluate(T.call_extern(
            "int32", symbol(panels, size), T.address_of(totals[0, 0, 0]), T.address_of(operands.data[first, 0]),
            T.int64(spec.depth * 2), T.address_of(operands.packed[item * panels, 0, 0]),
            T.int64(spec.group_size // ROWS_PER_WORD), T.int64(spec.packed_shape[1] * COLUMNS * 4),
            T.address_of(operands.scales[0, item * panels * COLUMNS]), T.int64(spec.columns * 4),
            T.address_of(operands.sums[first, 0]), T.int64(groups * 4), T.int64(groups)))
        _store(operands.out, totals, (first, size), item * panels)


def _group_sums(spec: PackedSpec, data):
    """A buffer of each row's activation sum per group of rows, filled before the parallel loop: partial sums in
    vector lanes, then the lanes added."""
    groups, lanes = spec.depth // spec.group_size, math.gcd(spec.group_size, COLUMNS)
    sums = T.alloc_buffer((spec.rows, groups), "float32")
    partial = T.alloc_buffer((spec.rows, lanes), "float32")
    with T.parallel(0, spec.rows) as row:
        with T.serial(0, groups) as group:
            with T.vectorized(0, lanes) as lane:
                T.buffer_store(partial, T.float32(0), (row, lane))
            with T.serial(0, spec.group_size // lanes) as step:
                with T.vectorized(0, lanes) as lane:
                    value = data[row, group * spec.group_size + step * lanes + lane]
                    T.buffer_store(partial, partial[row, lane] + T.Cast("float32", value), (row, lane))
            T.buffer_store(sums, T.float32(0), (row, group))
            with T.serial(0, lanes) as lane:
                T.buffer_store(sums, sums[row, group] + partial[row, lane], (row, group))
    return sums


def _store(out, acc, rows, first_block) -> None:
    """out[rows] = acc[:count], cast to the output dtype; `rows` is the first row and the count."""
    first_row, count = rows
    panels = acc.shape[1]
    with T.serial(0, count) as row:
        with T.unroll(0, panels) as panel:
            with T.vectorized(0, COLUMNS) as lane:
                T.buffer_store(out, T.Cast(str(out.dtype), acc[row, panel, lane]),
                               (first_row + row, (first_block + panel) * COLUMNS + lane))


def generic_kernel(spec: PackedSpec) -> tvm.tirx.PrimFunc:
    """The reference computation scheduled for any llvm target: parallel over 16-column blocks, the 16 columns
    vectorized, rows and depth serial inside."""
    sch = s_tir.Schedule(reference_kernel(spec).with_attr("global_symbol", "main"))
    acc = sch.get_sblock("acc")
    rows, columns, depth = sch.get_loops(acc)
    blocks, lanes = sch.split(columns, [None, COLUMNS])
    sch.reorder(blocks, rows, depth, lanes)
    sch.parallel(blocks)
    sch.vectorize(lanes)
    sch.decompose_reduction(acc, depth)
    out_rows, out_columns = sch.get_loops(sch.get_sblock("out"))
    sch.parallel(out_rows)
    sch.vectorize(sch.split(out_columns, [None, COLUMNS])[1])
    return _as_kernel(sch.mod["main"].without_attr("global_symbol").without_attr(SPEC_ATTR))


def _as_kernel(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    return opaque_scheduled(func)


def kernel_for(spec: PackedSpec, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    """The fastest kernel for `spec` on `target`: `vdpbf16ps` for bf16 activations where the target has it."""
    if spec.data_dtype == "bfloat16" and tvm.target.codegen.target_has_features("avx512bf16", target):
        return bf16_kernel(spec)
    return generic_kernel(spec)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.UsePackedInt4Kernels")
class UsePackedInt4Kernels:
    """Every weight-only int4 reference PrimFunc replaced by the CPU kernel for its spec on `target`."""

    def __init__(self, target: tvm.target.Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updated = mod.clone()
        for gvar, func in mod.functions_items():
            spec = spec_of(func)
            if spec is not None:
                updated.update_func(gvar, kernel_for(spec, self.target))
        return updated
