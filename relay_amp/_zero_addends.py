"""Adds and subtracts of all-zero constants dropped.

An exported attention can add a constant mask of zeros to its scores: Hugging Face's DINOv2 exported through the
dynamo exporter adds a [1, 1, 1370, 1370] constant of zeros at 518x518 in each layer. Nothing folds it (onnxscript's
no-op rules take scalar zeros only), so each layer read the 7.5 MB constant and wrote its scores once more: 26 of a
bf16 run's 164 ms. `zero_addends_dropped` replaces x + 0 and x - 0 by x where the zeros broadcast into x's shape
and dtype (x keeps its shape); the only value that changes is -0.0, which becomes itself instead of +0.0.
"""

import numpy as np
import tvm
from tvm import relax

from ._dead_code import EliminateDeadCode
from ._ir import rewrite_op_calls, tensor_dtype, tensor_shape


def zero_addends_dropped(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` with each add or subtract of an all-zero constant that keeps its other operand's shape and dtype
    replaced by that operand."""
    dropped = []  # the calls replaced by an operand

    def drop(call: relax.Call, _builder: relax.BlockBuilder) -> "relax.Expr | None":
        kept = _kept_operand(call)
        dropped.extend([call] if kept is not None else [])
        return kept

    rewritten = rewrite_op_calls(mod, func, {"relax.add": drop, "relax.subtract": drop})
    if not dropped:
        return mod
    # the rewritten bindings are now aliases (y = x): readers read x
    return EliminateDeadCode([func])(relax.transform.CanonicalizeBindings()(rewritten))


def _kept_operand(call: relax.Call) -> "relax.Expr | None":
    """The operand `call` adds zeros to (or subtracts them from), or None."""
    first, second = call.args
    candidates = [(first, second)] + ([(second, first)] if call.op.name == "relax.add" else [])
    return next((kept for kept, zeros in candidates if _all_zeros(zeros) and _same_tensor_type(kept, call)), None)


def _all_zeros(expr: relax.Expr) -> bool:
    return isinstance(expr, tvm.ir.expr.Constant) and not np.any(expr.value.numpy())


def _same_tensor_type(operand: relax.Expr, call: relax.Call) -> bool:
    shape = tensor_shape(operand)
    return shape is not None and shape == tensor_shape(call) and tensor_dtype(operand) == tensor_dtype(call)
