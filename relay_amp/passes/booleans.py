"""Comparisons of boolean tensors as logical ops.

TVM lowers `equal` and `not_equal` of two bool tensors to a floating-point compare, which LLVM refuses once the
loop is vectorized ("Invalid operand types for FCmp instruction": `fcmp oeq <16 x i1>`). The ONNX exporters write
such compares: PyTorch's floor division of ints spelled out by the dynamo exporter tests `Equal(x < 0, True)`
(transformers' own ONNX exporter's mixtures of experts did not build). `BooleanComparisons` writes them as the
logical ops they are: a compare with a constant as the tensor or its negation, two tensors as an exclusive or.
"""

import tvm
from tvm import relax

from .._ir import rewrite_op_calls, tensor_dtype, tensor_shape

BOOL = "bool"
EQUAL, NOT_EQUAL = "relax.equal", "relax.not_equal"


def _logical(call: relax.Call, _builder: relax.BlockBuilder) -> "relax.Expr | None":
    """`call`, an equal or not_equal of two bool tensors, as logical ops; None for other operands."""
    left, right = call.args
    if tensor_dtype(left) != BOOL or tensor_dtype(right) != BOOL:
        return None
    negated = call.op.name == EQUAL  # equal is the negation of an exclusive or
    for tensor, other in ((left, right), (right, left)):
        if isinstance(other, tvm.ir.expr.Constant) and other.value.numpy().size == 1:
            same = bool(other.value.numpy().reshape(-1)[0]) == negated  # x == True, x != False: x itself
            result = tensor if same else relax.op.logical_not(tensor)
            broadcast = tensor_shape(tensor) != tensor_shape(call)  # a constant of more axes than the tensor's
            return relax.op.broadcast_to(result, call.ty.shape) if broadcast else result
    differ = relax.op.logical_xor(left, right)
    return relax.op.logical_not(differ) if negated else differ


@tvm.transform.module_pass(opt_level=0, name="relay_amp.BooleanComparisons")
class BooleanComparisons:
    """equal and not_equal of bool tensors as logical ops (every backend runs it)."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_op_calls(mod, self.func, dict.fromkeys((EQUAL, NOT_EQUAL), _logical))
