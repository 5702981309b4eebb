"""Sorting and arg-reductions of 16-bit floats computed on their fp32 widening.

TVM lowers sort, argsort and topk to library calls that read their input as fp32: on a bf16 tensor, topk and
argsort returned wrong values and indices, and sort wrote past its buffer (the process aborted: "corrupted
double-linked list"). argmax and argmin of bf16 failed to compile (the bf16 legalization of their tuple
reduction: "StructuralEqual(value->ty, var->ty)"). AMP lets these ops follow their input's dtype, so a bf16
detector's score top-k (RT-DETR's query selection) returned garbage. `WidenedSelections` gives each of them the
fp32 widening of a bf16 or fp16 input, which is exact: the same order, indices and ties, and sorted values cast
back to the input's dtype are the values it holds.
"""

import tvm
from tvm import relax

from .._ir import rewrite_op_calls, tensor_dtype

NARROW_FLOATS = ("bfloat16", "float16")
WIDE = "float32"
SELECTIONS = ("relax.sort", "relax.argsort", "relax.topk", "relax.argmax", "relax.argmin")


def _widened(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    """`call` on its input's fp32 widening, its values cast back; None for an input of another dtype."""
    data = call.args[0]
    if tensor_dtype(data) not in NARROW_FLOATS:
        return None
    wide = relax.Call(call.op, [relax.op.astype(data, WIDE), *call.args[1:]], call.attrs)
    if call.op.name == "relax.sort":
        return relax.op.astype(builder.emit(wide), tensor_dtype(data))
    if call.op.name != "relax.topk" or str(call.attrs.ret_type) == "indices":
        return wide
    result = builder.emit(wide)
    if str(call.attrs.ret_type) == "values":
        return relax.op.astype(result, tensor_dtype(data))
    values = builder.emit(relax.op.astype(relax.TupleGetItem(result, 0), tensor_dtype(data)))
    return relax.Tuple([values, builder.emit(relax.TupleGetItem(result, 1))])


@tvm.transform.module_pass(opt_level=0, name="relay_amp.WidenedSelections")
class WidenedSelections:
    """sort, argsort, topk, argmax and argmin of bf16 or fp16 tensors computed on their fp32 widening."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_op_calls(mod, self.func, dict.fromkeys(SELECTIONS, _widened))
