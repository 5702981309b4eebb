"""kernels: AVX-512 dot-product tensor intrinsics and the packed-weight conv/matmul kernels that use them.

Five TIR tensor intrinsics, registered with `tvm.s_tir.TensorIntrin.register`:
- `BF16_DOT` on `vdpbf16ps`: 16 fp32 lanes, each += a bf16 pair of A times a bf16 pair of B.
- `INT8_DOT` on `vpdpbusd`: 16 int32 lanes, each += four uint8 of A times four int8 of B.
- `AVX_VNNI_DOT`: the same on two 256-bit `vpdpbusd` (AVX-VNNI), for 8-bit codes on hosts without AVX-512 that have
  it (Intel's client CPUs since Alder Lake).
- `AVX512_INT16_DOT` on `vpmaddwd`: 16 int32 lanes, each += an int16 pair of A times an int16 pair of B; the 8-bit
  codes of AVX-512 hosts without VNNI (Skylake-SP), widened to int16 in the kernel and in its packed weight;
  `INT16_DOT` the same on two 256-bit halves, for other AVX2 hosts (Zen 3).
`target_intrinsic` picks among the 8-bit ones by the target's features.
Their bodies call a small LLVM IR function that TVM links in and inlines (`pragma_import_llvm`), because TVM's
bf16 legalization rewrites bfloat16 vectors before LLVM sees them, so the intrinsic cannot be called from TIR.

`conv2d_nhwc` builds a tensorized NHWC convolution (a matmul is the 1x1 case) over weights packed once, at
compile time, by `pack_weight` into [O/16, KH, KW, I/group, 16, group] (`group` = 2 for bf16, 4 for int8).
Signed int8 activations are shifted to uint8 (+128) and the shift is subtracted again through the weight sums.
fp32 (`FP32_FMA`) takes the same packed layout with vectorized FMAs instead of an intrinsic, on AVX2 hosts too
(each 16-lane vector then two ymm registers, in a smaller register tile: `row_budget`).

`Epilogue` lists the elementwise ops a kernel applies to its accumulators as it stores them (bias, scale,
residual add, clamp, activation, cast): `conv2d_nhwc_compute` puts them in its output stage, `amx` in its tile
write-back, and `relay_amp.backend.cpu.epilogue` fuses them from the graph.

`conv2d_nhwc_compute` is the kernel before scheduling, its blocks annotated for relay_amp's schedule rule:
MetaSchedule (`ApplyCustomRule`) samples the register tile around the intrinsic, `DotKernelRule` gives the
default tile to an untuned build. `relay_amp.backend.cpu.amx` computes the same convolutions on AMX tiles, over the same
packed weight.
"""

import json
import math
from dataclasses import asdict, dataclass

import numpy as np
import tvm
from tvm import s_tir, te
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.script import tirx as T

from ..._ir import OPAQUE_PATTERN, fast_script_parsing
from ...dtypes import LOW_FLOAT_DTYPES
from ...errors import DTypeError
from ...serialization import dataclass_from_json
from . import formula
from .schedules import CACHE_BYTES, STACK_BYTES, largest_divisor, schedule_injective

LANES = 16  # 32-bit accumulator lanes of one zmm register
INT8_SHIFT = 128  # int8 -> uint8 offset for vpdpbusd's unsigned operand
UINT8_MAX = 255
INT16_MAX = 2 ** 15 - 1  # the largest sum of products AVX2_BYTE_DOT's vpmaddubsw holds without saturating
MAX_ROWS = (STACK_BYTES - 1) // (LANES * 4)  # accumulator vectors (rows x columns) that stay on the stack: 15
MAX_GROUP_WASTE = 4  # products per useful one a grouped conv's block-diagonal weight may cost (see grouped_weight)
MIN_ROWS = 4  # an untuned tile of fewer pixel rows leaves FMA latency exposed: pad the rows instead
COLUMN_CHOICES = (2, 3, 4, 1)  # 16-lane output-channel columns of an untuned tile, preferred in this order on ties
SLICE_BYTES = 1 << 20  # the packed weight of a tile's columns, over the whole reduction, that stays in a core's L2
# (Zen 4's 1 MiB, half of Sapphire Rapids') while the tile's pixels sweep past it
ISSUE_PER_CYCLE = 2  # vector products a core issues a cycle: Zen 5's and Sapphire Rapids' two 512-bit units
RULE = "relay_amp_dot"  # the blocks' `schedule_rule` annotation: MetaSchedule calls s_tir.meta_schedule.cpu.<RULE>
SPEC_ANNOTATION = "relay_amp.conv_spec"
_RULE_ATTRS = {"schedule_rule": RULE}
FUSABLE_ATTR = "relay_amp.dot_spec"  # on a kernel without an epilogue: its ConvSpec as JSON, for epilogue fusion
WIDE = "float32"  # the dtype epilogues compute in
QUANTIZED_DTYPES = ("int8", "uint8")  # integer dtypes a kernel may store its finished value in (requantized codes)
BIAS, SCALE, RESIDUAL, CLIP, MAP = "bias", "scale", "residual", "clip", "map"  # epilogue step kinds
ROW_SCALE = "row_scale"  # multiplies by one runtime value per output pixel: a dynamic matmul's row scales
TAKES_OPERAND = (BIAS, SCALE, RESIDUAL, ROW_SCALE)
# fields spec_json leaves out at these values
LATER_FIELDS = {"dilation": (1, 1), "stored_width": 0, "instruction": "", "stored_channels": 0,
                "padding": (0, 0, 0, 0)}


@dataclass(frozen=True)
class DotIntrin:
    """One dot-product instruction: its operand dtypes, the group it reduces per lane, and its LLVM form."""
    name: str
    a_dtype: str
    b_dtype: str
    acc_dtype: str
    group: int
    llvm_feature: str  # the LLVM target feature the instruction needs
    llvm_intrinsic: str = ""  # empty: no instruction to tensorize with, the lane loop is vectorized (fp32 FMA)
    llvm_acc: str = ""
    llvm_operand: str = ""
    # the instruction's products commute (bf16 x bf16): the broadcast group goes in its last source, the only one
    # that may be a memory operand, so LLVM folds the broadcast load into it ({1to16}) instead of issuing a
    # broadcast of its own for every product; vpdpbusd's unsigned operand must stay first
    commutes: bool = False
    halves: int = 1  # 2: the instruction takes 256-bit registers, and each 16-lane product is two of them (AVX2)
    accumulates: bool = True  # the instruction adds its products to an accumulator operand (not vpmaddwd)
    # the instruction's products are int16 sums of byte pairs (vpmaddubsw), which this one (vpmaddwd against ones)
    # sums in pairs into the accumulator's 32-bit lanes
    pair_sums: str = ""

    @property
    def symbol(self) -> str:
        """The name of the LLVM IR function the intrinsic's body calls."""
        return "relay_amp_" + self.name.replace(".", "_")

    @property
    def _operands(self) -> str:
        """The instruction's two sources in LLVM IR: the broadcast group last where the products commute."""
        first, second = ("%bv", "%av") if self.commutes else ("%av", "%bv")
        return f"{self.llvm_operand} {first}, {self.llvm_operand} {second}"

    def llvm_ir(self) -> str:
        """LLVM IR of the inlined function: acc[16] = instruction(acc, broadcast(a group), b[16 x group]), on each
        half of the lanes for a 256-bit instruction (`halves`), the products added after it where it does not
        accumulate (`vpmaddwd`)."""
        lanes = LANES // self.halves
        acc = f"<{lanes} x {self.llvm_acc}>"
        sources = f"{self.llvm_operand}, {self.llvm_operand}"
        parts = "\n".join(self._part_ir(part, acc) for part in range(self.halves))
        declarations = (f"declare {acc} @{self.llvm_intrinsic}({f'{acc}, {sources}' if self.accumulates else sources})"
                        if not self.pair_sums else f"declare {self._pairs} @{self.llvm_intrinsic}({sources})\n"
                        f"declare {acc} @{self.pair_sums}({self._pairs}, {self._pairs})")
        return f"""
{declarations}
define void @{self.symbol}(ptr %c, ptr %a, ptr %b) {{
  %group = load i32, ptr %a, align 1
  %one = insertelement <{lanes} x i32> poison, i32 %group, i64 0
  %all = shufflevector <{lanes} x i32> %one, <{lanes} x i32> poison, <{lanes} x i32> zeroinitializer
  %av = bitcast <{lanes} x i32> %all to {self.llvm_operand}
{parts}
  ret void
}}
"""

    @property
    def _pairs(self) -> str:
        """The LLVM type of a `pair_sums` instruction's operands: int16 sums of byte pairs, filling a register."""
        return f"<{LANES // self.halves * 2} x i16>"

    def _part_ir(self, part: int, acc: str) -> str:
        """The IR of one register's share of the lanes: load its accumulators and its b vector, add the products."""
        offset = part * LANES // self.halves * 4  # bytes: 32-bit accumulators, and b's groups of 32 bits per lane
        operands = self._operands.replace("%bv", f"%b{part}")
        if self.accumulates:
            product = f"%r{part} = call {acc} @{self.llvm_intrinsic}({acc} %acc{part}, {operands})"
        elif self.pair_sums:
            ones = f"{self._pairs} <{', '.join(['i16 1'] * (LANES // self.halves * 2))}>"
            product = (f"%s{part} = call {self._pairs} @{self.llvm_intrinsic}({operands})\n"
                       f"  %p{part} = call {acc} @{self.pair_sums}({self._pairs} %s{part}, {ones})\n"
                       f"  %r{part} = add {acc} %acc{part}, %p{part}")
        else:
            product = (f"%p{part} = call {acc} @{self.llvm_intrinsic}({operands})\n"
                       f"  %r{part} = add {acc} %acc{part}, %p{part}")
        return f"""  %c{part} = getelementptr i8, ptr %c, i64 {offset}
  %bp{part} = getelementptr i8, ptr %b, i64 {offset}
  %acc{part} = load {acc}, ptr %c{part}, align 4
  %b{part} = load {self.llvm_operand}, ptr %bp{part}, align 1
  {product}
  store {acc} %r{part}, ptr %c{part}, align 4"""


BF16_DOT = DotIntrin("relay_amp.dot_16x2_bf16", "bfloat16", "bfloat16", "float32", 2, "avx512bf16",
                     "llvm.x86.avx512bf16.dpbf16ps.512", "float", "<32 x bfloat>", commutes=True)
INT8_DOT = DotIntrin("relay_amp.dot_16x4_u8i8", "uint8", "int8", "int32", 4, "avx512vnni",
                     "llvm.x86.avx512.vpdpbusd.512", "i32", "<16 x i32>")
# int8 and uint8 codes on hosts without any vpdpbusd: widened to int16, pairs of products summed in int32, on
# AVX-512 (Skylake-SP) or on AVX2's two 256-bit halves (Zen 3)
AVX512_INT16_DOT = DotIntrin("relay_amp.dot_16x2_i16_zmm", "int16", "int16", "int32", 2, "avx512bw",
                             "llvm.x86.avx512.pmaddw.d.512", "i32", "<32 x i16>", accumulates=False)
INT16_DOT = DotIntrin("relay_amp.dot_16x2_i16", "int16", "int16", "int32", 2, "avx2", "llvm.x86.avx2.pmadd.wd", "i32",
                      "<16 x i16>", halves=2, accumulates=False)
# uint8 codes times int8 weight codes on AVX2 hosts without VNNI, where no pair of products can saturate vpmaddubsw's
# int16 sums (byte_pairs_fit: 7-bit data, as relay_amp.targets.seven_bit_codes has quantize make it); vpmaddwd
# against ones adds those sums in pairs
AVX2_BYTE_DOT = DotIntrin("relay_amp.dot_16x4_u8i8_avx2", "uint8", "int8", "int32", 4, "avx2",
                          "llvm.x86.avx2.pmadd.ub.sw", "i32", "<32 x i8>", halves=2, accumulates=False,
                          pair_sums="llvm.x86.avx2.pmadd.wd")
# int8 codes on hosts with AVX-VNNI but no AVX-512 (Intel's client CPUs since Alder Lake): vpdpbusd on 256 bits
AVX_VNNI_DOT = DotIntrin("relay_amp.dot_16x4_u8i8_ymm", "uint8", "int8", "int32", 4, "avxvnni",
                         "llvm.x86.avx512.vpdpbusd.256", "i32", "<8 x i32>", halves=2)
FP32_FMA = DotIntrin("relay_amp.fma_16x1_fp32", "float32", "float32", "float32", 1, "fma")  # AVX2 hosts too
# registered as tensor intrinsics; FP32_FMA is plain vectorized code
INTRINSICS = (BF16_DOT, INT8_DOT, AVX_VNNI_DOT, AVX512_INT16_DOT, INT16_DOT, AVX2_BYTE_DOT)
INTRINSICS_BY_NAME = {dot.name: dot for dot in INTRINSICS}
EIGHT_BIT_CHOICES = (INT8_DOT, AVX_VNNI_DOT, AVX512_INT16_DOT, INT16_DOT)  # 8-bit codes' instructions, best first


@dataclass(frozen=True)
class Step:
    """One op of a kernel's epilogue: BIAS adds a per-channel fp32 operand, SCALE multiplies by one, RESIDUAL adds
    an operand of the output's shape, ROW_SCALE multiplies by an fp32 operand of one value per output pixel, CLIP
    clamps to [low, high], MAP applies `formula` (relay_amp.backend.cpu.formula: an activation such as GELU or
    SiLU)."""
    kind: str
    low: float = -math.inf
    high: float = math.inf
    formula: tuple = ()
    scale: float = 1.0  # a RESIDUAL operand's step: it holds integer codes of the values it adds
    zero_point: float = 0.0  # the code of a RESIDUAL operand that stands for 0 (offset codes of a signed tensor)


@dataclass(frozen=True)
class Epilogue:
    """What a kernel does to each accumulator before it stores it: `steps` in order, in fp32, then a cast to
    `out_dtype` ("": the accumulator's dtype). BIAS, SCALE, RESIDUAL and ROW_SCALE steps take an operand each, in
    order."""
    steps: tuple[Step, ...] = ()
    residual_dtype: str = ""  # the RESIDUAL operand's dtype, read and widened to fp32
    out_dtype: str = ""

    @property
    def operand_steps(self) -> list["Step"]:
        """The steps that take an operand, in the order of the kernel's operand parameters."""
        return [step for step in self.steps if step.kind in TAKES_OPERAND]

    def operand_buffer(self, step: Step, out_shape: tuple) -> tuple[tuple, str]:
        """(shape, dtype) of `step`'s operand for a kernel computing the channels of `out_shape` at its pixels."""
        if step.kind == RESIDUAL:
            return tuple(out_shape), self.residual_dtype
        if step.kind == ROW_SCALE:
            return (*out_shape[:-1], 1), WIDE
        return (out_shape[-1],), WIDE

    @staticmethod
    def operand_index(step: Step, at: tuple) -> tuple:
        """Where `step`'s operand holds the value for output element `at`."""
        if step.kind == RESIDUAL:
            return tuple(at)
        if step.kind == ROW_SCALE:
            return (*at[:-1], 0)
        return (at[-1],)

    def apply(self, value: tvm.ir.Expr, out_dtype: str, operand_at) -> tvm.ir.Expr:
        """The value stored for accumulator `value`; `operand_at(i, step)` loads operand i for this output element
        (its channel's value for a per-channel step)."""
        if not self.steps:
            return value if str(value.ty) == out_dtype else tvm.tirx.Cast(out_dtype, value)
        value, taken = tvm.tirx.Cast(WIDE, value), 0
        for step in self.steps:
            if step.kind == CLIP:
                value = _clamped(value, step.low, step.high)
                continue
            if step.kind == MAP:
                value = formula.expression(_as_accurate_as(step.formula, out_dtype), value)
                continue
            operand = tvm.tirx.Cast(WIDE, operand_at(taken, step))
            if step.zero_point:
                operand = operand - tvm.tirx.FloatImm(WIDE, step.zero_point)
            if step.scale != 1.0:
                operand = operand * tvm.tirx.FloatImm(WIDE, step.scale)
            taken += 1
            value = value * operand if step.kind in (SCALE, ROW_SCALE) else value + operand
        return tvm.tirx.Cast(out_dtype, value)


def _as_accurate_as(activation: tuple, out_dtype: str) -> tuple:
    """`activation` computed only as accurately as a result of `out_dtype` keeps it (formula.narrowed)."""
    if out_dtype in LOW_FLOAT_DTYPES:
        return formula.narrowed(activation)
    return formula.narrowed(activation, requantized=True) if out_dtype in QUANTIZED_DTYPES else activation


def _clamped(value: tvm.ir.Expr, low: float, high: float) -> tvm.ir.Expr:
    if low > -math.inf:
        value = tvm.tirx.max(value, tvm.tirx.FloatImm(WIDE, low))
    if high < math.inf:
        value = tvm.tirx.min(value, tvm.tirx.FloatImm(WIDE, high))
    return value


def _description(dot: DotIntrin):
    a_dtype, b_dtype, acc, group = dot.a_dtype, dot.b_dtype, dot.acc_dtype, dot.group

    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((group,), a_dtype, offset_factor=1),
             B: T.Buffer((LANES, group), b_dtype, offset_factor=1),
             C: T.Buffer((LANES,), acc, offset_factor=1)):
        with T.sblock("root"):
            T.reads(C[0:LANES], A[0:group], B[0:LANES, 0:group])
            T.writes(C[0:LANES])
            for i, k in T.grid(LANES, group):
                with T.sblock("update"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    C[vi] = C[vi] + T.cast(A[vk], acc) * T.cast(B[vi, vk], acc)

    return desc


def _implementation(dot: DotIntrin):
    a_dtype, b_dtype, acc, group, symbol = dot.a_dtype, dot.b_dtype, dot.acc_dtype, dot.group, dot.symbol

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((group,), a_dtype, offset_factor=1),
             B: T.Buffer((LANES, group), b_dtype, offset_factor=1),
             C: T.Buffer((LANES,), acc, offset_factor=1)):
        with T.sblock("root"):
            T.reads(C[0:LANES], A[0:group], B[0:LANES, 0:group])
            T.writes(C[0:LANES])
            T.evaluate(T.call_extern("int32", symbol, T.address_of(C[0]), T.address_of(A[0]),
                                     T.address_of(B[0, 0])))

    return impl


with fast_script_parsing():  # 1.5 s of every `import relay_amp` otherwise
    for _dot in INTRINSICS:
        s_tir.TensorIntrin.register(_dot.name, _description(_dot), _implementation(_dot), override=True)


def intrinsic_for(dtype: str) -> DotIntrin:
    """The dot product that computes `dtype` ("float32", "bfloat16" or "int8"/"uint8") operands."""
    if dtype == "float32":
        return FP32_FMA
    if dtype == "bfloat16":
        return BF16_DOT
    if dtype in ("int8", "uint8"):
        return INT8_DOT
    raise DTypeError(f"no AVX-512 dot-product kernel for {dtype!r}: relay_amp has them for float32, bfloat16, int8 and uint8")


def target_intrinsic(dtype: str, target: "tvm.target.Target | None" = None) -> DotIntrin:
    """The dot product `target` (the current one by default) computes `dtype` operands with: `intrinsic_for`'s, or
    for 8-bit codes on a target without AVX-512's vpdpbusd, AVX-VNNI's 256-bit one, else int16 pairs on AVX-512
    (AVX512_INT16_DOT) or AVX2 (INT16_DOT)."""
    dot = intrinsic_for(dtype)
    target = target or tvm.target.Target.current(allow_none=True)
    if dot is not INT8_DOT or target is None or target.kind.name != "llvm":
        return dot
    has = tvm.target.codegen.target_has_features
    return next((choice for choice in EIGHT_BIT_CHOICES if has(choice.llvm_feature, target)), dot)


def weight_intrinsic(dot: DotIntrin, weight: np.ndarray, in_axis: int, data_high: int = UINT8_MAX) -> DotIntrin:
    """`dot`, or AVX2_BYTE_DOT in place of INT16_DOT where its products of uint8 data up to `data_high` by the
    constant integer `weight` (input channels on `in_axis`) cannot saturate (`byte_pairs_fit`)."""
    return AVX2_BYTE_DOT if dot is INT16_DOT and byte_pairs_fit(weight, in_axis, data_high) else dot


def byte_pairs_fit(codes: np.ndarray, axis: int, data_high: int = UINT8_MAX) -> bool:
    """Whether vpmaddubsw's int16 sum of two uint8 values up to `data_high` times each pair of integer `codes` along
    `axis` (channels 2j and 2j + 1, as the kernels pack them) cannot saturate: `data_high` times the larger of a
    pair's positive and negative codes' magnitudes summed is at most 32767 (any int8 pair for 7-bit data; pairs
    summing to 128 for 8-bit data)."""
    if codes.dtype.kind not in "iu":
        return False
    pairs = _pairs(codes.astype("int32"), axis)
    positive, negative = np.maximum(pairs, 0).sum(-1), np.maximum(-pairs, 0).sum(-1)
    return bool(data_high * np.maximum(positive, negative).max(initial=0) <= INT16_MAX)


def _pairs(values: np.ndarray, axis: int) -> np.ndarray:
    """`values` with `axis` moved last, zero-padded to even length and split into pairs: [..., pairs, 2]."""
    moved = np.moveaxis(values, axis, -1)
    padded = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, moved.shape[-1] % 2)])
    return padded.reshape(*padded.shape[:-1], -1, 2)


def instruction_name(dtype: str, dot: DotIntrin) -> str:
    """`ConvSpec.instruction` for a kernel of `dtype` operands on `dot`: its name where that is not
    `intrinsic_for`'s, else ""."""
    return "" if dot is intrinsic_for(dtype) else dot.name


def pack_weight(weight: np.ndarray, layout: str, dot: DotIntrin) -> np.ndarray:
    """Reorder a conv weight (`layout` a permutation of "OIHW") or a [I, O] matmul weight into the kernel's layout."""
    if layout == "IO":
        weight, layout = weight[:, :, None, None], "IOHW"
    ohwi = np.transpose(weight, [layout.index(axis) for axis in "OHWI"])
    out_ch, height, width, in_ch = ohwi.shape
    blocked = ohwi.reshape(out_ch // LANES, LANES, height, width, in_ch // dot.group, dot.group)
    packed = np.ascontiguousarray(blocked.transpose(0, 2, 3, 4, 1, 5))
    return packed.astype(dot.b_dtype, copy=False) if packed.dtype.kind in "iu" else packed  # int8 codes for INT16_DOT


def grouped_weight(weight_oihw: np.ndarray, groups: int, block: int = LANES) -> "tuple[np.ndarray, int] | None":
    """A grouped convolution's [O, I/groups, KH, KW] weight for the kernel, with its number of channel blocks
    (`ConvSpec.groups`): output channels in blocks of `block` (16 lanes; AMX's panels of 32), each reducing over the
    input channels of the groups it covers, zero where they are not its own group's (block diagonal). A last block
    short of groups gets zero output channels (sliced off) and reads zero input channels (padded). Groups whose
    width neither divides 16 nor is a multiple of it (RegNetY-1.6GF's 24, Visformer's) get zero output channels up
    to whole blocks each (`padded_group_width`; the result's groups are compacted after), and padded groups are
    merged into blocks of 32 only where they fill them (MixNet-S's groups of 12 as 16, two a panel). None where the
    zeros would be more than MAX_GROUP_WASTE - 1 products per useful one (a depthwise convolution: 15)."""
    out_channels, group_depth = weight_oihw.shape[:2]
    group_width = out_channels // groups
    padded = padded_group_width(group_width)
    merged = 1 if padded % block == 0 or padded > block else block // padded  # groups per block
    if padded != group_width:
        if padded > MAX_GROUP_WASTE * group_width:
            return None
        if groups % merged or merged * padded > MAX_GROUP_WASTE * group_width:
            merged = 1
        weight_oihw, group_width, out_channels = _padded_groups(weight_oihw, groups, padded), padded, groups * padded
    if merged > MAX_GROUP_WASTE:
        return None
    blocks = -(-groups // merged)
    dense = np.zeros((blocks * merged * group_width, merged * group_depth, *weight_oihw.shape[2:]), weight_oihw.dtype)
    place = np.arange(out_channels) // group_width % merged  # the output channel's group within its block
    for slot in range(merged):
        rows = np.flatnonzero(place == slot)
        dense[rows, slot * group_depth:(slot + 1) * group_depth] = weight_oihw[rows]
    return dense, blocks


def _padded_groups(weight_oihw: np.ndarray, groups: int, padded: int) -> np.ndarray:
    """A grouped conv's weight with zero output channels after each group's, up to `padded` a group."""
    dense = np.zeros((groups, padded, *weight_oihw.shape[1:]), weight_oihw.dtype)
    dense[:, :weight_oihw.shape[0] // groups] = weight_oihw.reshape(groups, -1, *weight_oihw.shape[1:])
    return dense.reshape(groups * padded, *weight_oihw.shape[1:])


def padded_group_width(group_width: int) -> int:
    """The output channels the kernel computes per group: the width itself where it divides 16 or is a multiple of
    it, else the next multiple of 16."""
    return group_width if LANES % group_width == 0 or group_width % LANES == 0 else -(-group_width // LANES) * LANES


def weight_sums(weight_ohwi_packed: np.ndarray) -> np.ndarray:
    """Per output channel, INT8_SHIFT times the sum of its int8 weights: the correction for shifted activations."""
    sums = weight_ohwi_packed.astype("int64").sum(axis=(1, 2, 3, 5))  # [O/16, 16]
    return (INT8_SHIFT * sums).reshape(-1).astype("int32")


def supports(out_channels: int, in_channels: int, dot: DotIntrin, groups: int = 1) -> bool:
    """Whether a conv/matmul with these channel counts fits the kernel's 16-lane, group-wide blocks."""
    return out_channels % (groups * LANES) == 0 and in_channels % (groups * dot.group) == 0


@dataclass(frozen=True)
class ConvSpec:
    """An unpadded NHWC convolution the kernel computes (pad the data first): shapes, strides, dtypes; `groups`
    splits the channels into that many blocks, each output block reducing over its own input block (a grouped
    convolution; see `grouped_weight`); `dilation` spaces the window's taps (DeepLab's atrous convs); `padding`
    names the rows and columns of the input (top, left, bottom, right) that hold the padding dispatch added, whose
    taps the kernel skips where a tile reads nothing else through them (relay_amp.backend.cpu.tap_skips)."""
    data_shape: tuple[int, int, int, int]
    kernel_size: tuple[int, int]
    out_channels: int
    strides: tuple[int, int] = (1, 1)
    data_dtype: str = "bfloat16"
    out_dtype: str = "float32"
    weight_batch: int = 0  # 0: one weight for the whole batch; else one packed weight per batch element
    groups: int = 1
    dilation: tuple[int, int] = (1, 1)
    stored_width: int = 0  # 0: every output pixel; else the leading output pixels of each row the kernel stores
    instruction: str = ""  # the DotIntrin's name where it is not intrinsic_for(data_dtype)'s (target_intrinsic)
    stored_channels: int = 0  # 0: every output channel; else the leading output channels the kernel stores
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """The NHWC output the register tiles compute."""
        batch, height, width, _ = self.data_shape
        out_h = (height - self.window[0]) // self.strides[0] + 1
        out_w = (width - self.window[1]) // self.strides[1] + 1
        return batch, out_h, out_w, self.out_channels

    @property
    def stored_shape(self) -> tuple[int, int, int, int]:
        """The NHWC output the kernel stores: `out_shape`, or its first `stored_width` pixels of each row (the
        last register tile's rows past the width, 197 tokens computed as 200, are not stored) and its first
        `stored_channels` channels (the zero channels that padded a weight to whole vectors)."""
        batch, height, width, channels = self.operand_shape
        return batch, height, width, self.stored_channels or channels

    @property
    def operand_shape(self) -> tuple[int, int, int, int]:
        """The NHWC shape the epilogue's operands are given for: the stored pixels, every computed channel."""
        batch, height, width, channels = self.out_shape
        return batch, height, self.stored_width or width, channels

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        """The NHWC data the kernel reads: `data_shape`, less the pixels only unstored outputs read (the kernel's
        last tile reads the row's last pixel again for them)."""
        batch, height, width, channels = self.data_shape
        unstored = self.out_shape[2] - self.stored_shape[2]
        return batch, height, width - unstored * self.strides[1], channels

    @property
    def window(self) -> tuple[int, int]:
        """The input pixels (rows, columns) one output reads across: the kernel's extent, dilated."""
        return tuple((size - 1) * step + 1 for size, step in zip(self.kernel_size, self.dilation))

    @property
    def depth(self) -> int:
        """The input channels each output channel reduces over: its group's."""
        return self.data_shape[-1] // self.groups

    @property
    def dot(self) -> DotIntrin:
        """The intrinsic: `instruction`'s, or the data dtype's."""
        if not self.instruction:
            return intrinsic_for(self.data_dtype)
        if self.instruction not in INTRINSICS_BY_NAME:
            raise DTypeError(f"no dot-product instruction named {self.instruction!r}; relay_amp's are "
                             f"{', '.join(INTRINSICS_BY_NAME)}")
        return INTRINSICS_BY_NAME[self.instruction]

    @property
    def shifted(self) -> bool:
        """Whether signed int8 data is shifted to uint8 (and corrected through the weight sums)."""
        return self.data_dtype == "int8" and self.dot.a_dtype == "uint8"

    @property
    def input_stage(self) -> str:
        """The stage that brings the data to the instruction's dtype: "shifted" (int8 to uint8), "widened" (8-bit
        codes to INT16_DOT's int16), or "" (none)."""
        if self.shifted:
            return "shifted"
        return "widened" if self.data_dtype != self.dot.a_dtype else ""


def _compute(spec: ConvSpec, epilogue: Epilogue) -> list:
    """TE stages: [shift int8 to uint8,] the blocked dot product, the output stage ([weight sums subtracted,]
    `epilogue`, cast to the output dtype).

    A bf16 operand must be a parameter: TVM's bf16 legalization would store an intermediate bf16 buffer as fp32.
    """
    dot, channels = spec.dot, spec.depth
    data = te.placeholder(spec.input_shape, spec.data_dtype, "data")
    blocks = (spec.out_channels // LANES, *spec.kernel_size, channels // dot.group, LANES, dot.group)
    packed = te.placeholder((spec.weight_batch, *blocks) if spec.weight_batch else blocks, dot.b_dtype, "packed")
    operand = data
    if spec.input_stage:
        def converted(*i):
            if spec.shifted:
                return (data[i].astype("int32") + INT8_SHIFT).astype("uint8")
            return data[i].astype(dot.a_dtype)
        operand = te.compute(spec.input_shape, converted, name=spec.input_stage, attrs=_RULE_ATTRS)
    row = te.reduce_axis((0, spec.kernel_size[0]), "row")
    col = te.reduce_axis((0, spec.kernel_size[1]), "col")
    chan = te.reduce_axis((0, channels), "chan")
    (stride_h, stride_w), (step_h, step_w) = spec.strides, spec.dilation

    def weight(b, o, r, c, k):
        index = (o // LANES, r, c, k // dot.group, o % LANES, k % dot.group)
        return packed[(b, *index) if spec.weight_batch else index]

    blocks_per_group = spec.out_channels // spec.groups // LANES

    def channel(o, k):  # the input channel of output channel o's k-th product; its 16-lane block's group
        return k if spec.groups == 1 else o // LANES // blocks_per_group * channels + k

    def pixel(x, c):  # the input pixel; an unstored output's reads stay in the input
        at = x * stride_w + c * step_w
        return te.min(at, spec.input_shape[2] - 1) if spec.stored_width else at

    acc = te.compute(spec.out_shape, lambda b, y, x, o: te.sum(
        operand[b, y * stride_h + row * step_h, pixel(x, col), channel(o, chan)].astype(dot.acc_dtype)
        * weight(b, o, row, col, chan).astype(dot.acc_dtype),
        axis=[row, col, chan]), name="acc", attrs={**_RULE_ATTRS, SPEC_ANNOTATION: spec_json(spec)})
    sums = [te.placeholder((spec.weight_batch, spec.out_channels) if spec.weight_batch else (spec.out_channels,),
                           "int32", "sums")] if spec.shifted else []
    operands = [te.placeholder(*epilogue.operand_buffer(step, spec.operand_shape), f"operand{i}")
                for i, step in enumerate(epilogue.operand_steps)]

    def output(*i):
        value = acc(*i) - sums[0](*((i[0], i[-1]) if spec.weight_batch else i[-1:])) if sums else acc(*i)
        return epilogue.apply(value, epilogue.out_dtype or spec.out_dtype,
                              lambda k, step: operands[k](*epilogue.operand_index(step, i)))

    return [data, packed, *sums, *operands, te.compute(spec.stored_shape, output, name="out", attrs=_RULE_ATTRS)]


def mark_fusable(func: tvm.tirx.PrimFunc, spec: ConvSpec, epilogue: Epilogue, attr: str) -> tvm.tirx.PrimFunc:
    """`func` with `spec` under `attr` when it has no epilogue yet (FuseKernelEpilogues may give it one)."""
    return func if epilogue != Epilogue() else func.with_attr(attr, spec_json(spec))


def fusable_spec(func, attr: str) -> ConvSpec | None:
    """The spec `mark_fusable` put on `func` under `attr`, None for any other function."""
    if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None or attr not in func.attrs:
        return None
    return spec_from_json(str(func.attrs[attr]))


def conv2d_nhwc_compute(spec: ConvSpec, epilogue: Epilogue = Epilogue()) -> tvm.tirx.PrimFunc:
    """The unscheduled kernel for `spec` with `epilogue` in its output stage: its blocks carry relay_amp's schedule
    rule, which MetaSchedule tunes (`ApplyCustomRule`) and `DotKernelRule` applies untuned. It stays out of
    operator fusion. Parameters: data, packed weight, [weight sums,] the epilogue's operands, output."""
    if not supports(spec.out_channels, spec.data_shape[-1], spec.dot, spec.groups):
        in_groups = f" in each of {spec.groups} groups" if spec.groups > 1 else ""
        raise DTypeError(f"kernel needs output channels divisible by {LANES} and input channels by "
                         f"{spec.dot.group}{in_groups}; got {spec.out_channels} and {spec.data_shape[-1]}")
    sch = s_tir.Schedule(te.create_prim_func(_compute(spec, epilogue)))
    sch.annotate(get_root_block(sch), "schedule_rule", "None")  # MetaSchedule's generic rules skip the function
    func = sch.mod["main"].without_attr("global_symbol").with_attr("op_pattern", OPAQUE_PATTERN)
    return mark_fusable(func, spec, epilogue, FUSABLE_ATTR)


def conv2d_nhwc(spec: ConvSpec) -> tvm.tirx.PrimFunc:
    """A scheduled, tensorized PrimFunc computing `spec` over a weight packed by `pack_weight` (+ `weight_sums` for int8)."""
    sch = s_tir.Schedule(conv2d_nhwc_compute(spec))
    schedule_kernel(sch, sch.get_sblock("acc"))
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def kernel_spec(sch: s_tir.Schedule, block) -> ConvSpec | None:
    """The ConvSpec a kernel's accumulating block was built from, or None for any other block."""
    annotation = sch.get(block).annotations.get(SPEC_ANNOTATION)
    return None if annotation is None else spec_from_json(str(annotation))


def spec_json(spec: ConvSpec) -> str:
    """`spec` as JSON, without the fields added since tuning records were first written that hold their default
    (`dilation`): a kernel's workload, and so the records tuned for it, stay what they were."""
    return json.dumps({name: value for name, value in asdict(spec).items()
                       if name not in LATER_FIELDS or value != LATER_FIELDS[name]})


def spec_from_json(text: str) -> ConvSpec:
    """The ConvSpec `spec_json` wrote."""
    return dataclass_from_json(ConvSpec, text)


@dataclass(frozen=True)
class RegisterFile:
    """What an untuned register tile is sized for: the target's vector registers, how many of them a 16-lane vector
    takes, the cycles a product's accumulator chain needs to stay busy, the operand loads a core issues a cycle, and
    the bytes of weight vectors it streams a cycle from L2 (a weight panel, a column's 64 bytes a step of the
    reduction over all of it, outgrows L1 from 512 products deep). AVX-512's figures are fitted on Zen 5 (bf16
    tiles of 15 accumulators ran 5-9% faster than tiles of 12 at ViT's shapes; a lone column of 14 or 15 rows,
    whose every product loads its own broadcast, 10% slower than two or three columns of as many accumulators;
    its L2 feeds 64 bytes a cycle); AVX2's are an FMA's latency, its only instruction, two loads a cycle, and a
    Zen 3's 16 bytes of weight a cycle (2 x 2 tiles, which stream 32 at full rate, ran ResNet-18's fp32 3x3 convs
    and BERT's 768x768 matmuls, fp32 and int8, 4-20% slower than 1 x 4 tiles)."""
    registers: int
    per_vector: int
    chain_cycles: int
    loads_per_cycle: float
    weight_bytes_per_cycle: float


AVX512_REGISTERS = RegisterFile(32, 1, 8, 1.75, 64)
AVX2_REGISTERS = RegisterFile(16, 2, 4, 2, 16)


def register_file() -> RegisterFile:
    """The current target's RegisterFile: AVX-512's, or AVX2's on an llvm target without AVX-512 (fp32 FMA kernels
    on AVX2)."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm" or tvm.target.codegen.target_has_features("avx512f", target):
        return AVX512_REGISTERS
    return AVX2_REGISTERS


def default_tile(width: int, out_channels: int, column_bytes: int = 0) -> tuple[int, int]:
    """The untuned register tile for an output row of `width` pixels, (16-lane columns, pixel rows): of the tiles
    whose rows divide `width`, the one `_products_per_cycle` rates best, of columns whose packed weight
    (`column_bytes` each, over the whole reduction) fits SLICE_BYTES where any does, else of one column. Each of
    the output's pixel tiles reads its columns' weight again: DeepLabV3's atrous 3x3 convs over 2048 channels
    (18432 products an output) streamed 2.4 MB of fp32 weight from memory per tile of 2 columns (125 ms, 51 ms
    with one column)."""
    fitting = max(1, SLICE_BYTES // column_bytes) if column_bytes else None
    return _best_tile(width, out_channels, padding=False, max_columns=fitting)


def padded_width(width: int, out_channels: int) -> int:
    """`width`, or rounded up to whole row tiles where a tile with rows past the width beats every tile that
    divides it (197 tokens): dispatch gives the kernel this computed width and the stored one (`ConvSpec.stored_width`),
    and `default_tile` of the result divides it."""
    return _padded_rows(width, _best_tile(width, out_channels, padding=True)[1])


def _padded_rows(width: int, rows: int) -> int:
    """`width` rounded up to whole tiles of `rows`."""
    return -(-width // rows) * rows


def row_budget(columns: int) -> int:
    """The most pixel rows a tile of `columns` may take: its accumulators stay on the stack (MAX_ROWS vectors),
    and they, a weight vector per column and the broadcast input fit the target's registers (0: none fit)."""
    registers = register_file()
    return min(MAX_ROWS // columns, (registers.registers - 1) // registers.per_vector // columns - 1)


def _column_choices(out_channels: int) -> list[int]:
    """The 16-lane column counts a tile of `out_channels` may take: those that divide its blocks and fit a row."""
    return [c for c in COLUMN_CHOICES if out_channels // LANES % c == 0 and row_budget(c) > 0]


def _best_tile(width: int, out_channels: int, padding: bool, max_columns: "int | None" = None) -> tuple[int, int]:
    """The (columns, rows) tile `_products_per_cycle` rates best for `width` rows, with rows past it where `padding`,
    of at most `max_columns` columns where that leaves a choice."""
    choices = _column_choices(out_channels)
    choices = [c for c in choices if max_columns is None or c <= max_columns] or [min(choices)]
    tiles = [(c, rows) for c in choices for rows in _tile_rows(width, c, padding)]

    def rank(tile):  # on equal rates: no rows past the width, then more accumulators, then COLUMN_CHOICES' order
        padded = _padded_rows(width, tile[1])
        rate = _products_per_cycle(*tile) * width / padded
        return round(rate, 3), padded == width, tile[0] * tile[1], -tiles.index(tile)
    return max(tiles, key=rank)


def _tile_rows(width: int, columns: int, padding: bool) -> list[int]:
    """Pixel rows a tile of `columns` may take: the most that divide `width` and fit `row_budget`, and, with
    `padding` where those are under MIN_ROWS (197 tokens: a 1-row tile runs two accumulator chains,
    latency-bound), the budget and each count from MIN_ROWS below it, rows past the width completing the last tile
    (on AVX2, 7 pixels in a 4-row tile and one zero row, not a 6-row tile and five)."""
    budget = row_budget(columns)
    rows = largest_divisor(width, budget)
    return [rows, budget, *range(MIN_ROWS, budget)] if padding and rows < MIN_ROWS and width > budget else [rows]


def _products_per_cycle(columns: int, rows: int) -> float:
    """Vector products a (columns, rows) tile issues a cycle in a model of the core: ISSUE_PER_CYCLE products, the
    RegisterFile's loads (a weight vector per column and a broadcast per row each step of the reduction) and the
    weight bytes it streams, and its chain cycles before an accumulator takes its next product. BERT's 128 tokens
    in 4-row tiles of 2 columns, 8 accumulators, latency-bound, ran a 768x768 bf16 matmul 1.29x slower than 3
    columns' 12 on Zen 5."""
    registers = register_file()
    products, loads = columns * rows * registers.per_vector, columns * registers.per_vector + rows
    weight_cycles = columns * LANES * 4 / registers.weight_bytes_per_cycle  # 16 lanes of 32-bit groups a column
    return products / max(products / ISSUE_PER_CYCLE, loads / registers.loads_per_cycle, registers.chain_cycles,
                          weight_cycles)


def schedule_kernel(sch: s_tir.Schedule, block, tunable: bool = False) -> None:
    """Tile, tensorize and parallelize a kernel's accumulating `block`; `tunable` samples its register tile
    (output-channel columns and pixel rows) for MetaSchedule instead of taking the default one."""
    spec = kernel_spec(sch, block)
    _, _, out_x, *_ = sch.get_loops(block)
    if tunable:
        choices = sorted(_column_choices(spec.out_channels))
        columns = sch.sample_categorical(choices, [1 / len(choices)] * len(choices)) if len(choices) > 1 else 1
        rows = sch.sample_perfect_tile(out_x, n=2, max_innermost_factor=MAX_ROWS)[1]
    else:
        columns, rows = default_tile(spec.out_shape[2], spec.out_channels, _weight_column_bytes(spec))
    _schedule_conv(sch, spec, block, columns, rows, vectorize_copies=not tunable)


def _weight_column_bytes(spec: ConvSpec) -> int:
    """The bytes of one 16-lane output-channel column of `spec`'s packed weight, over its whole reduction."""
    return math.prod(spec.kernel_size) * spec.depth * LANES * tvm.DataType(spec.dot.b_dtype).itemsize


def packed_weight_bytes(spec: ConvSpec) -> int:
    """The bytes of `spec`'s packed weight (one image's, where it has one per image)."""
    return _weight_column_bytes(spec) * (spec.out_channels // LANES)


def pixels_outermost(spec: ConvSpec) -> bool:
    """Whether a dot-product kernel's parallel tiles take pixels outermost (the AMX kernel's: `amx.pixels_outermost`):
    where the packed weight is no larger than the data and fits in CACHE_BYTES, each thread streams its pixels once,
    in whole pixel rows of data, residual and output, and reads the weight from L2. Otherwise output-channel panels
    go outermost, so each thread streams only its share of the weight, which is then the larger read: a layer's
    weight arrives from memory, not from cache, at every inference. A weight per image (attention's keys and values,
    computed just before) fitting CACHE_BYTES is in cache whatever its size beside the data: the pixels go
    outermost, and each thread stores whole rows, as the softmax or the matmul that reads them takes them (ViT-S/16
    in bf16 on AMX, scores split by columns between the threads: its softmaxes took 1.3x their fp32 time, the
    kernels 4% more)."""
    weight_bytes = packed_weight_bytes(spec)
    if spec.weight_batch:
        return weight_bytes <= CACHE_BYTES
    return weight_bytes <= min(CACHE_BYTES, math.prod(spec.data_shape) * tvm.DataType(spec.data_dtype).itemsize)


def _schedule_conv(sch: s_tir.Schedule, spec: ConvSpec, block, columns, rows, vectorize_copies: bool) -> None:
    """The kernel's loop nest. The accumulators' copy to the output (the epilogue's write-back) is unrolled over
    its pixel rows and output-channel columns, a 16-lane vector each, as in schedules._tile: rolled, LLVM kept the
    accumulators in a stack buffer and computed one row's epilogue after the other (EfficientNet-B0's int8 stem
    with its SiLU: 63 -> 42 us). Each vector is one accumulator register: rows of 48 lanes, as one vector, made LLVM
    move the accumulators lane by lane inside the reduction loop (BERT's bf16 matmuls: 24x as long). With sampled tiles
    the accumulator copies are left to LLVM's vectorizer: how many loops they keep depends on the sample, and a
    traced get_loops must return as many loops on every replay."""
    batch, out_y, out_x, out_c, row, col, chan = sch.get_loops(block)
    out_c_outer, out_c_column, out_c_lane = sch.split(out_c, [None, columns, LANES])
    chan_outer, chan_group = sch.split(chan, [None, spec.dot.group])
    x_outer, x_row = sch.split(out_x, [None, rows])
    tensorized = spec.dot in INTRINSICS
    lanes = [out_c_lane, chan_group] if tensorized else [chan_group, out_c_lane]
    outer = [batch, out_y, x_outer, out_c_outer] if pixels_outermost(spec) else [out_c_outer, batch, out_y, x_outer]
    sch.reorder(*outer, row, col, chan_outer, x_row, out_c_column, *lanes)
    cache = sch.cache_write(block, 0, "global")
    sch.reverse_compute_at(cache, outer[-1])
    sch.reverse_compute_inline(sch.get_sblock("out"))
    tile = sch.fuse(*outer)
    sch.parallel(tile)
    sch.unroll(x_row)
    sch.unroll(out_c_column)
    if not tensorized:
        sch.vectorize(out_c_lane)
    init = sch.decompose_reduction(block, row)
    if vectorize_copies:
        *_, copy_rows, copy_lanes = sch.get_loops(cache)
        copy_columns, copy_lanes = sch.split(copy_lanes, [None, LANES])
        sch.vectorize(copy_lanes)
        sch.unroll(copy_columns)
        if not sch.get(copy_rows).same_as(sch.get(tile)):  # one row: the tile's loop is the only one around it
            sch.unroll(copy_rows)
        sch.vectorize(sch.get_loops(init)[-1])
    if tensorized:
        sch.tensorize(out_c_lane, spec.dot.name)
        sch.annotate(tile, "pragma_import_llvm", spec.dot.llvm_ir())
    if spec.input_stage:
        schedule_injective(sch, sch.get_sblock(spec.input_stage))


def _kernel_block(sch: s_tir.Schedule):
    """The accumulating block of a kernel compute (see conv2d_nhwc_compute), or None."""
    for block in sch.get_child_blocks(get_root_block(sch)):
        if kernel_spec(sch, block) is not None:
            return block
    return None


class DotKernelRule(dl.ScheduleRule):
    """Default (untuned) schedule for the kernel computes UseDotKernels emits: `schedule_kernel`'s register tile."""

    def is_target_available(self, target: tvm.target.Target) -> bool:
        """Whether the rule applies to `target` (CPU targets only)."""
        return target.kind.name == "llvm"

    def apply(self, func: tvm.tirx.PrimFunc, target: tvm.target.Target, _: bool) -> s_tir.Schedule | None:
        """The scheduled kernel, or None for any other function."""
        if not isinstance(func, tvm.tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        block = _kernel_block(sch)
        if block is None:
            return None
        schedule_kernel(sch, block)
        return sch


@tvm.register_global_func(f"s_tir.meta_schedule.cpu.{RULE}", override=True)
def _sample_kernel_schedule(sch: s_tir.Schedule, block) -> list:
    """MetaSchedule's ApplyCustomRule calls this for each annotated block; the accumulating one is scheduled with
    a sampled register tile, the others (int8 shift, output cast) are scheduled with it."""
    if kernel_spec(sch, block) is not None:
        schedule_kernel(sch, block, tunable=True)
    return [sch]
