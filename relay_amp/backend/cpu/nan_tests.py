"""nan_tests: NaN tests in scheduled CPU functions as integer tests of the bits, which stay vectors.

TVM scalarizes a vector loop whose Select is conditioned on `isnan` (ONNX's `Where(IsNaN(p), 0, p)`: the NaN
guard the dynamo exporter writes after the softmax of torch's scaled_dot_product_attention): each lane then runs
on its own, a compare and a branch per element. A self-comparison cannot replace it: TVM's simplifier folds
x == x to true, and its code generator's x != x is an ordered compare, false for NaN. An fp32 is NaN exactly when
its bits less the sign exceed +inf's (all exponent bits and a mantissa), two integer operations on a vector.
`NanTestsAsBitTests` rewrites every `isnan` of an fp32 value that way, before TVM's lowering; with it a guarded
softmax computes its guard in registers (DINOv2's rows of 1376 at 518x518: 2.3 -> 1.4 ms a layer).
"""

import tvm
import tvm_ffi
from tvm import tirx

_ISNAN = tvm.ir.Op.get("tirx.isnan")
MAGNITUDE = 0x7FFFFFFF  # an fp32's bits less its sign
INFINITY_BITS = 0x7F800000  # +inf's bits: a NaN's magnitude is above them (all exponent bits, a mantissa)


def _as_bit_test(call: tvm.ir.expr.Call) -> tvm.ir.Expr:
    if not call.op.same_as(_ISNAN) or str(call.args[0].ty) != "float32":
        return call
    bits = tirx.reinterpret("int32", call.args[0])
    return tirx.GT(tirx.BitwiseAnd(bits, tirx.const(MAGNITUDE, "int32")), tirx.const(INFINITY_BITS, "int32"))


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="NanTestsAsBitTests")
def NanTestsAsBitTests(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx) -> tirx.PrimFunc:  # noqa: N802
    """Every `isnan(x)` of an fp32 `x` in `func` as a test of its bits."""
    body = tvm_ffi.structural_map(func.body, [(tvm.ir.expr.Call, _as_bit_test)])
    return func if body.same_as(func.body) else func.with_body(body)
