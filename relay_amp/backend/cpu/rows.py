"""rows: softmax rows padded to whole vectors, so that their reductions vectorize.

`schedules.RowReductionRule` sums a row in 16-lane partial sums only when the row is a whole number of vectors:
TVM's `compute_at` drops the tail predicate of a factored reduction. A row of 197 (ViT's tokens) therefore fell
to TVM's scalar reduction (450-560 us per 6 x 197 x 197 softmax on cpu-amx). `PadSoftmaxRows` pads such rows
with the dtype's lowest value, which changes no row's max and adds exp(lowest - max) = 0 to its sum, and slices
the padded columns off the result: the same softmax.
"""

import ml_dtypes
import tvm
from tvm import relax

from ..._ir import pad_after, rewrite_function, tensor_dtype, tensor_shape
from ...dtypes import numpy_dtype
from .schedules import ACCUMULATOR_LANES

SOFTMAX_OPS = ("relax.nn.softmax", "relax.nn.log_softmax")


def lowest(dtype: str) -> float:
    """The most negative finite value of the float `dtype`."""
    return float(ml_dtypes.finfo(numpy_dtype(dtype)).min)


def _row_extra(call: relax.Call) -> int:
    """Columns that make the rows of a last-axis softmax `call` whole vectors; 0 where it needs none or is not one."""
    shape = tensor_shape(call.args[0])
    if shape is None or not isinstance(shape[-1], int) or int(call.attrs.axis) not in (-1, len(shape) - 1):
        return 0
    return -shape[-1] % ACCUMULATOR_LANES if shape[-1] > ACCUMULATOR_LANES else 0


@relax.expr_functor.mutator
class _RowPadder(relax.PyExprMutator):
    """Rewrites softmax(x) over rows off whole vectors into softmax(pad(x, lowest))[..., :n]."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if not isinstance(new_call.op, tvm.ir.Op) or new_call.op.name not in SOFTMAX_OPS:
            return new_call
        extra = _row_extra(new_call)
        if not extra:
            return new_call
        data, shape = new_call.args[0], tensor_shape(new_call.args[0])
        padded = self.builder_.emit(pad_after(data, len(shape), -1, extra, lowest(tensor_dtype(data))))
        rows = self.builder_.emit(relax.Call(new_call.op, [padded], new_call.attrs))
        return relax.op.strided_slice(rows, axes=[len(shape) - 1], begin=[0], end=[shape[-1]])


@tvm.transform.module_pass(opt_level=0, name="relay_amp.PadSoftmaxRows")
class PadSoftmaxRows:
    """Pad the rows of each last-axis softmax and log-softmax to whole 16-lane vectors with the lowest value,
    and slice the result back."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_function(_RowPadder(mod), mod, self.func)
