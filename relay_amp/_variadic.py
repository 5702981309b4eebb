"""ONNX's variadic Max, Min, Sum and Mean of runtime tensors as chains of binary ops.

TVM's importer writes Max(a, b) (torch.maximum's export, a decoder's position clamp) as both inputs broadcast to
the output's shape, stacked along a new axis and reduced over it. That copies every input, and relax.stack has no
layout inference: ConvertLayout, run by every CPU build, failed on it ("Invalid SLayout"), so such a model did not
build. `variadic_ops_as_binary` writes each as maximum, minimum or add of the inputs in turn (a mean divided by
their count), which broadcast by themselves."""

import tvm
from tvm import relax

from ._dead_code import EliminateDeadCode
from ._ir import rewrite_op_calls
from .ops import bound_call, tuple_fields

BINARY = {"relax.max": relax.op.maximum, "relax.min": relax.op.minimum, "relax.sum": relax.op.add,
          "relax.mean": relax.op.add}


def variadic_ops_as_binary(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` with each reduction over axis 0 of a stack of (broadcast) tensors as binary ops over the tensors."""
    rewritten = rewrite_op_calls(mod, func, dict.fromkeys(BINARY, _as_binary))
    return EliminateDeadCode([func])(rewritten)  # the stacks and broadcasts, now unread


def _as_binary(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    operands = _stacked(call.args[0], builder)
    axes = [int(axis) for axis in call.attrs.axis or ()]
    if operands is None or axes != [0] or call.attrs.keepdims:
        return None
    binary = BINARY[call.op.name]
    total = operands[0]
    for operand in operands[1:]:
        total = builder.emit(binary(total, operand))
    if call.op.name != "relax.mean":
        return total
    return relax.op.divide(total, relax.const(len(operands), call.ty.dtype))


def _stacked(tensor: relax.Expr, builder: relax.BlockBuilder) -> "list[relax.Expr] | None":
    """The tensors stacked along a new first axis into `tensor` (each before its broadcast), or None."""
    stack = bound_call(builder, tensor, "relax.stack")
    fields = None if stack is None or int(stack.attrs.axis) != 0 else tuple_fields(builder, stack.args[0])
    return None if fields is None else [_unbroadcast(operand, builder) for operand in fields]


def _unbroadcast(tensor: relax.Expr, builder: relax.BlockBuilder) -> relax.Expr:
    broadcast = bound_call(builder, tensor, "relax.broadcast_to")
    return tensor if broadcast is None else broadcast.args[0]
