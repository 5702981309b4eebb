"""Packed int4 weights on the CPU: `UsePackedInt4Kernels` swaps each weight-only int4 matmul's reference PrimFunc
(relay_amp.passes.weight_only) for a kernel that unpacks the weights in registers.

bf16 activations on a target with `avx512bf16`: per 32-bit word of 16 columns x 8 rows, four shift-and-mask
steps turn the nibbles into bf16 pairs `128 + code` (exponent bits OR-ed over the code: no conversion
instruction) and four `vdpbf16ps` multiply them by broadcast activation pairs; per group of rows, the sum of the
activations times `128 + 8` is subtracted and the group's scales applied. The loop over a group's words is LLVM IR
(`llvm_ir`), with its accumulators in registers. A batch-1 matmul reads a quarter of its bf16 twin's bytes, and
its speed is set by these unpacking instructions rather than by memory (README, 'int4').

Other activations or targets: the reference computation, parallel over 16-column blocks and vectorized across
them.
"""

import tvm
from tvm import s_tir
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..._ir import OPAQUE_PATTERN
from ...passes.weight_only import (
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
MAX_ROW_BLOCK = 8  # activation rows computed per group of weights loaded (reuse from L1)
DOT = "llvm.x86.avx512bf16.dpbf16ps.512"
VEC = "<16 x float>"


def symbol(panels: int) -> str:
    """The LLVM function computing one group of rows for `panels` 16-column blocks."""
    return f"relay_amp_int4_bf16_x{panels}"


def _activation_pairs() -> list[str]:
    """LLVM lines broadcasting the four bf16 activation pairs of word `%i` (pair j at bytes 4j)."""
    lines = ["  %xoff = mul i64 %i, 16"]
    for j in range(4):
        lines += [f"  %xq{j} = add i64 %xoff, {4 * j}", f"  %xp{j} = getelementptr i8, ptr %x, i64 %xq{j}",
                  f"  %xv{j} = load i32, ptr %xp{j}, align 2",
                  f"  %xi{j} = insertelement <16 x i32> poison, i32 %xv{j}, i64 0",
                  f"  %xs{j} = shufflevector <16 x i32> %xi{j}, <16 x i32> poison, <16 x i32> zeroinitializer",
                  f"  %xb{j} = bitcast <16 x i32> %xs{j} to <32 x bfloat>"]
    return lines


def _panel_products(panel: int) -> list[str]:
    """LLVM lines unpacking one 64-byte word block of `panel` and accumulating its four products: pairs 0 and 2 in
    accumulator 0, pairs 1 and 3 in accumulator 1 (two chains, not one, to hide the instruction's latency)."""
    p = panel
    lines = [f"  %ps{p} = mul i64 %stride, {p}", f"  %bq{p} = add i64 %boff, %ps{p}",
             f"  %bp{p} = getelementptr i8, ptr %b, i64 %bq{p}", f"  %w{p} = load <32 x i16>, ptr %bp{p}, align 4"]
    for j in range(4):
        source = f"%w{p}"
        if j:
            lines.append(f"  %sh{p}_{j} = lshr <32 x i16> %w{p}, splat (i16 {4 * j})")
            source = f"%sh{p}_{j}"
        half, previous = j % 2, f"%a{p}_{j % 2}" if j < 2 else f"%r{p}_{j % 2}_0"
        lines += [f"  %n{p}_{j} = and <32 x i16> {source}, splat (i16 15)",
                  f"  %m{p}_{j} = or <32 x i16> %n{p}_{j}, splat (i16 {MAGIC})",
                  f"  %v{p}_{j} = bitcast <32 x i16> %m{p}_{j} to <32 x bfloat>",
                  f"  %r{p}_{half}_{j // 2} = call {VEC} @{DOT}({VEC} {previous}, <32 x bfloat> %xb{j}, "
                  f"<32 x bfloat> %v{p}_{j})"]
    return lines


def llvm_ir(panels: int) -> str:
    """LLVM IR of `symbol(panels)(out, x, b, words, stride)`: for `panels` blocks `stride` bytes apart from `b`,
    out[block][16] = sum over `words` words of the bf16 activations at `x` times (128 + code)."""
    lines = [f"declare {VEC} @{DOT}({VEC}, <32 x bfloat>, <32 x bfloat>)",
             f"define void @{symbol(panels)}(ptr %out, ptr %x, ptr %b, i64 %words, i64 %stride) alwaysinline {{",
             "entry:", "  br label %loop", "loop:", "  %i = phi i64 [0, %entry], [%next, %loop]"]
    lines += [f"  %a{p}_{h} = phi {VEC} [zeroinitializer, %entry], [%r{p}_{h}_1, %loop]"
              for p in range(panels) for h in range(2)]
    lines += _activation_pairs() + ["  %boff = mul i64 %i, 64"]
    for p in range(panels):
        lines += _panel_products(p)
    lines += ["  %next = add i64 %i, 1", "  %done = icmp eq i64 %next, %words",
              "  br i1 %done, label %exit, label %loop", "exit:"]
    for p in range(panels):
        lines += [f"  %t{p} = fadd {VEC} %r{p}_0_1, %r{p}_1_1", f"  %o{p} = getelementptr {VEC}, ptr %out, i64 {p}",
                  f"  store {VEC} %t{p}, ptr %o{p}, align 4"]
    return "\n".join(lines + ["  ret void", "}", ""])


def panels_for(spec: PackedSpec) -> int:
    """16-column blocks per parallel item: as many as MAX_PANELS while MIN_ITEMS items remain."""
    blocks = spec.columns // COLUMNS
    return next(p for p in (MAX_PANELS, 2, 1) if blocks % p == 0 and (blocks // p >= MIN_ITEMS or p == 1))


def _row_block(rows: int) -> int:
    return max(d for d in range(1, MAX_ROW_BLOCK + 1) if rows % d == 0)


def bf16_kernel(spec: PackedSpec) -> tvm.tirx.PrimFunc:
    """The scheduled `vdpbf16ps` kernel for `spec` (bf16 activations), same parameters as the reference."""
    panels, block = panels_for(spec), _row_block(spec.rows)
    groups, words = spec.depth // spec.group_size, spec.group_size // ROWS_PER_WORD
    with IRBuilder() as builder:
        with T.prim_func(s_tir=True):
            T.func_name("main")
            T.func_attr({"tirx.noalias": True})
            data = T.arg("data", T.Buffer((spec.rows, spec.depth), "bfloat16"))
            packed = T.arg("packed", T.Buffer(spec.packed_shape, "uint32"))
            scales = T.arg("scales", T.Buffer(spec.scales_shape, "float32"))
            out = T.arg("out", T.Buffer((spec.rows, spec.columns), spec.out_dtype))
            sums = _group_sums(spec, data)
            with T.parallel(0, spec.columns // (COLUMNS * panels)) as item:
                with T.sblock("int4_panels"):
                    T.reads([data[0:spec.rows, 0:spec.depth], packed[0:spec.packed_shape[0], 0:words * groups, 0:COLUMNS],
                             scales[0:groups, 0:spec.columns], sums[0:spec.rows, 0:groups]])
                    T.writes(out[0:spec.rows, 0:spec.columns])
                    acc = T.alloc_buffer((block, panels, COLUMNS), "float32", scope="local")
                    part = T.alloc_buffer((panels, COLUMNS), "float32", scope="local")
                    with T.serial(0, spec.rows // block) as outer:
                        _fill(acc, block, panels)
                        with T.serial(0, groups) as group:
                            with T.serial(0, block) as inner:
                                row = outer * block + inner
                                T.evaluate(T.call_extern(
                                    "int32", symbol(panels), T.address_of(part[0, 0]),
                                    T.address_of(data[row, group * spec.group_size]),
                                    T.address_of(packed[item * panels, group * words, 0]), T.int64(words),
                                    T.int64(spec.packed_shape[1] * COLUMNS * 4)))
                                _add_group(acc, part, inner, (scales, group), sums[row, group], item * panels)
                        _store(out, acc, outer * block, item * panels)
    func = builder.get()
    sch = s_tir.Schedule(func)
    sch.annotate(sch.get_loops(sch.get_sblock("int4_panels"))[0], "pragma_import_llvm", llvm_ir(panels))
    return _as_kernel(sch.mod["main"].without_attr("global_symbol"))


def _group_sums(spec: PackedSpec, data):
    """A buffer of each row's activation sum per group of rows, filled before the parallel loop."""
    groups = spec.depth // spec.group_size
    sums = T.alloc_buffer((spec.rows, groups), "float32")
    with T.parallel(0, spec.rows) as row:
        with T.serial(0, groups) as group:
            T.buffer_store(sums, T.float32(0), (row, group))
            with T.serial(0, spec.group_size) as k:
                T.buffer_store(sums, sums[row, group] + T.Cast("float32", data[row, group * spec.group_size + k]),
                               (row, group))
    return sums


def _fill(acc, block: int, panels: int) -> None:
    with T.serial(0, block) as row:
        with T.unroll(0, panels) as panel:
            with T.vectorized(0, COLUMNS) as lane:
                T.buffer_store(acc, T.float32(0), (row, panel, lane))


def _add_group(acc, part, row, group_scales, activation_sum, first_block) -> None:
    """acc[row] += scale x (part - OFFSET x the group's activation sum), per column; `group_scales` is the scales
    buffer and the group's index in it."""
    scales, group = group_scales
    with T.unroll(0, part.shape[0]) as panel:
        with T.vectorized(0, COLUMNS) as lane:
            column = (first_block + panel) * COLUMNS + lane
            scale = scales[group, column]
            T.buffer_store(acc, acc[row, panel, lane] + scale * (part[panel, lane] - T.float32(OFFSET) * activation_sum),
                           (row, panel, lane))


def _store(out, acc, first_row, first_block) -> None:
    block, panels = acc.shape[:2]
    with T.serial(0, block) as row:
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
    return func.with_attrs({"tirx.is_scheduled": True, "op_pattern": OPAQUE_PATTERN})


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
