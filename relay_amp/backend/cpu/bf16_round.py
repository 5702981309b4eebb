"""bf16_round: fp32 -> bfloat16 roundings in scheduled CPU functions, on `vcvtneps2bf16`, and none in registers.

TVM's BF16ComputeLegalize writes each rounding to bfloat16 as integer arithmetic on the fp32 bits (shift, mask,
add a bias, shift, narrow: five instructions per vector), because its LLVM code generator has no bfloat16 type.
On a CPU with avx512_bf16 one instruction does it. `NativeBF16Rounding` runs on the scheduled PrimFuncs, before
TVM's lowering: in each vectorized loop it replaces `Cast("bfloat16", x)` of an fp32 `x` by the op
`relay_amp.round_to_bf16`, which TVM's legalization leaves alone and its vectorizer widens to the loop's lanes;
the op's LLVM lowering then calls the instruction on 16 lanes at a time (fewer lanes are padded to 16, more
split into 16s), or its two-register form (`vcvtne2ps2bf16`) on 32 where the loop's lanes are whole 32s: one
instruction and one 64-byte store for two registers (a bf16 layer norm over Swin-T's 28x28x384, stored 32 lanes at
a time: 17% faster than one register at a time, Zen 5). Casts in loops TVM leaves scalar keep its integer
rounding: LLVM's loop vectorizer widens that, where a call on one lane would stop it.

The instruction rounds to nearest even like TVM's arithmetic, and keeps NaN a NaN; it treats fp32 denormals
(below 1.2e-38) as zero, as oneDNN's and PyTorch's bfloat16 conversions on these CPUs do.

`DropRegisterRoundTrips` (every CPU target) first removes the roundings a value undergoes between two ops of one
fused function once the schedule has put them in one expression: `float32(bfloat16(x))`, where the bf16 value
never reaches memory (a SiLU's input, which AMP rounds because two ops read it).
"""

import tvm
import tvm_ffi
from tvm.ir.prim.expr import Cast

ROUND_OP = "relay_amp.round_to_bf16"  # fp32 value -> the uint16 bits of its bfloat16 rounding
FEATURE = "avx512bf16"
CHUNK = 16  # fp32 lanes `vcvtneps2bf16` rounds at once (one zmm register)
PAIR_LANES = 2 * CHUNK  # fp32 lanes `vcvtne2ps2bf16` rounds at once (two registers into one)
_LLVM_INTRINSIC = "llvm.x86.avx512bf16.cvtneps2bf16.512"
_PAIR_INTRINSIC = "llvm.x86.avx512bf16.cvtne2ps2bf16.512"  # 32 lanes of two fp32 registers into one
_PURE = tvm.ir.Op.get("tirx.exp").get_attr("TCallEffectKind")  # the effect kind of a pure math op


def register_vector_op(name: str, lowering) -> None:
    """Register `name` as a pure TIR op that TVM's vectorizer widens to a loop's lanes, lowered for LLVM by
    `lowering` (a call -> its LLVM form); once per process."""
    if name in tvm.ir.Op.list_op_names():
        return
    tvm.ir.register_op_attr(name, "TCallEffectKind", _PURE)
    tvm.ir.register_op_attr(name, "TVectorizable", True)
    tvm.ir.register_op_attr(name, "TScriptPrinterName", name)
    tvm.tirx.register_intrin_lowering(name, target="llvm", f=lowering, level=99)


def lanes_of(expr: tvm.ir.Expr) -> int:
    """The number of vector lanes of a TIR expression (1 for a scalar)."""
    return tvm.DataType(str(expr.ty)).lanes


def shuffle(vectors: list[tvm.ir.Expr], indices: range) -> tvm.ir.Expr:
    """The lanes `indices` of the vectors `vectors` laid end to end, as one vector."""
    return tvm.tirx.Shuffle(vectors, [tvm.tirx.const(i, "int32") for i in indices])


def as_chunks(value: tvm.ir.Expr) -> list[tvm.ir.Expr]:
    """`value`'s lanes in 16-lane vectors, the last one padded with zeros."""
    lanes = lanes_of(value)
    if lanes == 1:
        return [tvm.tirx.Broadcast(value, CHUNK)]
    zeros = tvm.tirx.Broadcast(tvm.tirx.const(0, "float32"), CHUNK)  # whole: a Broadcast of one lane is invalid
    padded = [value, zeros] if lanes % CHUNK else [value]
    return [shuffle(padded, range(start, start + CHUNK)) for start in range(0, lanes, CHUNK)]


def lower_round(call: tvm.ir.Expr) -> tvm.ir.Expr:
    """The LLVM form of one `relay_amp.round_to_bf16` call: `vcvtne2ps2bf16` on each 32 lanes of its operand where
    they are whole 32s (two registers rounded into one by one instruction), else `vcvtneps2bf16` on each 16."""
    value = call.args[0]
    lanes = lanes_of(value)
    chunks = as_chunks(value)
    if lanes % PAIR_LANES == 0:  # the instruction's second operand fills the low half
        rounded = [_bits(PAIR_LANES, _PAIR_INTRINSIC, high, low) for low, high in zip(chunks[::2], chunks[1::2])]
    else:
        rounded = [_bits(CHUNK, _LLVM_INTRINSIC, chunk) for chunk in chunks]
    return rounded[0] if lanes_of(rounded[0]) == lanes else shuffle(rounded, range(lanes))


def _bits(lanes: int, intrinsic: str, *operands: tvm.ir.Expr) -> tvm.ir.Expr:
    return tvm.tirx.call_intrin(f"uint16x{lanes}", "tirx.reinterpret",
                                tvm.tirx.call_llvm_pure_intrin(f"int16x{lanes}", intrinsic, *operands))


def _native_cast(cast: Cast) -> tvm.ir.Expr:
    if str(cast.ty) != "bfloat16" or str(cast.value.ty) != "float32":
        return cast
    bits = tvm.tirx.call_intrin("uint16", ROUND_OP, cast.value)
    return tvm.tirx.call_intrin("bfloat16", "tirx.reinterpret", bits)


def _native_vector_loop(loop: tvm.tirx.For) -> tvm.tirx.For:
    if loop.kind != tvm.tirx.ForKind.VECTORIZED:
        return loop
    return tvm_ffi.structural_map(loop, [(Cast, _native_cast)])


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="NativeBF16Rounding")
def NativeBF16Rounding(func: tvm.tirx.PrimFunc, _mod: tvm.IRModule, _ctx) -> tvm.tirx.PrimFunc:  # noqa: N802
    """Every fp32 -> bfloat16 cast in a vectorized loop of `func` as `relay_amp.round_to_bf16` (one
    instruction per 16 lanes, or per 32); casts in other loops keep TVM's integer rounding, which LLVM vectorizes."""
    body = tvm_ffi.structural_map(func.body, [(tvm.tirx.For, _native_vector_loop)])
    return func if body.same_as(func.body) else func.with_body(body)


def _unrounded(cast: Cast) -> tvm.ir.Expr:
    inner = cast.value
    if (str(cast.ty) == "float32" and isinstance(inner, Cast) and str(inner.ty) == "bfloat16"
            and str(inner.value.ty) == "float32"):
        return inner.value
    return cast


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="DropRegisterRoundTrips")
def DropRegisterRoundTrips(func: tvm.tirx.PrimFunc, _mod: tvm.IRModule, _ctx) -> tvm.tirx.PrimFunc:  # noqa: N802
    """`float32(bfloat16(x))` of an fp32 `x` as `x`: a bf16 rounding that a value undergoes between two ops of one
    fused function, in registers, never reaching memory (SiLU's input, read twice by its sigmoid and its product,
    was rounded there). Values get closer to fp32, as in PyTorch's compiled kernels, which keep fp32 inside."""
    body = tvm_ffi.structural_map(func.body, [(Cast, _unrounded)])
    return func if body.same_as(func.body) else func.with_body(body)


def rounding_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """For an LLVM target: DropRegisterRoundTrips, then NativeBF16Rounding where it has avx512_bf16; else none."""
    if target.kind.name != "llvm":
        return []
    native = tvm.target.codegen.target_has_features(FEATURE, target)
    return [DropRegisterRoundTrips, *([NativeBF16Rounding] if native else [])]


register_vector_op(ROUND_OP, lower_round)
