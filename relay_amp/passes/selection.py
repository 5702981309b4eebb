"""Sorting, selections and arg-reductions of 16-bit floats computed on their fp32 widening.

TVM lowers sort, argsort, topk and non-max suppression to library calls that read their input as fp32: on a bf16
tensor, topk and argsort returned wrong values and indices, non-max suppression kept the wrong boxes, and sort
wrote past its buffer (the process aborted: "corrupted double-linked list"). argmax and argmin of bf16 failed to
compile (the bf16 legalization of their tuple reduction: "StructuralEqual(value->ty, var->ty)"). AMP lets these
ops follow their input's dtype, so a bf16 detector's score top-k (RT-DETR's query selection) returned garbage.
`WidenedSelections` gives each of them the fp32 widening of its bf16 or fp16 operands, which is exact: the same
order, indices and ties, and sorted values cast back to the input's dtype are the values it holds.
"""

import tvm
from tvm import relax

from .._ir import rewrite_op_calls, tensor_dtype

NARROW_FLOATS = ("bfloat16", "float16")
WIDE = "float32"
SELECTIONS = ("relax.sort", "relax.argsort", "relax.topk", "relax.argmax", "relax.argmin",
              "relax.vision.all_class_non_max_suppression")


def _widened(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    """`call` on the fp32 widening of its 16-bit float operands, its 16-bit float results cast back; None where
    it has no such operand."""
    narrow = [tensor_dtype(arg) for arg in call.args if tensor_dtype(arg) in NARROW_FLOATS]
    if not narrow:
        return None
    args = [relax.op.astype(arg, WIDE) if tensor_dtype(arg) in NARROW_FLOATS else arg for arg in call.args]
    result = builder.emit(relax.Call(call.op, args, call.attrs))
    if not isinstance(call.ty, relax.TupleType):
        return relax.op.astype(result, narrow[0]) if tensor_dtype(call) in NARROW_FLOATS else result
    fields = [builder.emit(relax.TupleGetItem(result, index)) for index in range(len(call.ty.fields))]
    return relax.Tuple([builder.emit(relax.op.astype(field, narrow[0])) if str(original.dtype) in NARROW_FLOATS
                        else field for field, original in zip(fields, call.ty.fields)])


@tvm.transform.module_pass(opt_level=0, name="relay_amp.WidenedSelections")
class WidenedSelections:
    """sort, argsort, topk, argmax, argmin and non-max suppression of bf16 or fp16 tensors computed on their fp32
    widening."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_op_calls(mod, self.func, dict.fromkeys(SELECTIONS, _widened))
