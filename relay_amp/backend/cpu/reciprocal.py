"""reciprocal: fast math's quotients (SiLU's x / (1 + e^-x), sigmoid's 1 / (1 + e^-x), the ratios of polynomials
of erf and tanh) on AVX-512's reciprocal estimate instead of a division.

A `vdivps` of 16 lanes occupies the divider for several cycles: EfficientNet-B0's SiLUs spent a tenth of its bf16
time dividing (2.27 ms against 2.02 with the quotients left out, Sapphire Rapids). `formula` writes those
quotients as the ops `relay_amp.fast_divide` (a result kept in fp32, or requantized to 8-bit codes, whose rounding
the estimate alone moved) and `relay_amp.narrow_divide` (a result rounded to bfloat16 or float16), which TVM's
vectorizer widens to a loop's lanes and which lower to an exact `a / b` by default. On targets with AVX-512
`ReciprocalEstimates` rewrites them in vectorized loops, before TVM's lowering: a narrow quotient as `a` times
`vrcp14ps`'s estimate of 1 / b (within 2^-14 relative, below bf16's and fp16's half ulp), any other with a Newton
step after the estimate (r (2 - b r): within about an ulp). The estimate's lowering calls the instruction on 16
lanes at a time (relay_amp.backend.cpu.bf16_round's chunks). Quotients in loops TVM leaves scalar divide.
"""

import tvm
import tvm_ffi

from .bf16_round import CHUNK, as_chunks, lanes_of, register_vector_op, shuffle

FAST_DIVIDE = "relay_amp.fast_divide"  # a / b, to be computed within about an ulp
NARROW_DIVIDE = "relay_amp.narrow_divide"  # a / b for a result rounded to a narrow float: within 2^-14 will do
ESTIMATE = "relay_amp.reciprocal_estimate"  # 1 / b within 2^-14 relative: vrcp14ps
FEATURE = "avx512f"
_LLVM_INTRINSIC = "llvm.x86.avx512.rcp14.ps.512"
_ALL_LANES = -1  # the instruction's mask: every lane computed


def divide(numerator: tvm.ir.Expr, denominator: tvm.ir.Expr, narrow: bool) -> tvm.ir.Expr:
    """The fp32 quotient as fast math computes it: `relay_amp.narrow_divide` where `narrow` (its result is rounded
    to a narrow float), else `relay_amp.fast_divide`."""
    return tvm.tirx.call_intrin("float32", NARROW_DIVIDE if narrow else FAST_DIVIDE, numerator, denominator)


def _quotient(call: tvm.ir.Expr) -> tvm.ir.Expr:
    """The exact quotient: a divide op's lowering wherever ReciprocalEstimates left it."""
    numerator, denominator = call.args
    return numerator / denominator


def lower_estimate(call: tvm.ir.Expr) -> tvm.ir.Expr:
    """The LLVM form of one `relay_amp.reciprocal_estimate` call: `vrcp14ps` on each 16 lanes of its operand."""
    value = call.args[0]
    mask = tvm.tirx.const(_ALL_LANES, "int16")
    estimates = [tvm.tirx.call_llvm_pure_intrin(f"float32x{CHUNK}", _LLVM_INTRINSIC, chunk, chunk, mask)
                 for chunk in as_chunks(value)]
    lanes = lanes_of(value)
    return estimates[0] if lanes == CHUNK else shuffle(estimates, range(lanes))


def _estimated(call: tvm.ir.Expr) -> tvm.ir.Expr:
    if not isinstance(call.op, tvm.ir.Op) or call.op.name not in (FAST_DIVIDE, NARROW_DIVIDE):
        return call
    numerator, denominator = call.args
    estimate = tvm.tirx.call_intrin("float32", ESTIMATE, denominator)
    if call.op.name == FAST_DIVIDE:  # one Newton step: the estimate's 2^-14 error squared
        estimate = estimate * (tvm.tirx.const(2.0, "float32") - denominator * estimate)
    return numerator * estimate


def _estimated_vector_loop(loop: tvm.tirx.For) -> tvm.tirx.For:
    if loop.kind != tvm.tirx.ForKind.VECTORIZED:
        return loop
    return tvm_ffi.structural_map(loop, [(tvm.ir.expr.Call, _estimated)])


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="ReciprocalEstimates")
def ReciprocalEstimates(func: tvm.tirx.PrimFunc, _mod: tvm.IRModule, _ctx) -> tvm.tirx.PrimFunc:  # noqa: N802
    """Every fast-math quotient in a vectorized loop of `func` as its numerator times the reciprocal estimate of its
    denominator (after a Newton step, where its result stays fp32); quotients in other loops divide."""
    body = tvm_ffi.structural_map(func.body, [(tvm.tirx.For, _estimated_vector_loop)])
    return func if body.same_as(func.body) else func.with_body(body)


def reciprocal_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """For an LLVM target with AVX-512: ReciprocalEstimates; else none."""
    if target.kind.name != "llvm" or not tvm.target.codegen.target_has_features(FEATURE, target):
        return []
    return [ReciprocalEstimates]


def _register_ops() -> None:
    for name, lowering in ((FAST_DIVIDE, _quotient), (NARROW_DIVIDE, _quotient), (ESTIMATE, lower_estimate)):
        register_vector_op(name, lowering)


_register_ops()
