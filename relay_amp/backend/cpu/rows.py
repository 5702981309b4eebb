"""rows: softmax rows padded to whole vectors, so that their reductions vectorize.

`schedules.RowReductionRule` sums a row in 16-lane partial sums only when the row is a whole number of vectors:
TVM's `compute_at` drops the tail predicate of a factored reduction. A row of 197 (ViT's tokens) therefore fell
to TVM's scalar reduction (450-560 us per 6 x 197 x 197 softmax on cpu-amx). `PadSoftmaxRows` pads such rows
with the dtype's lowest value, which changes no row's max and adds exp(lowest - max) = 0 to its sum, and slices
the padded columns off the result: the same softmax.

A matmul that reads the sliced result (attention's P.V, through AMP's cast or not) takes the padded rows instead,
and its second operand as many zero rows: the padded columns meet zeros, so the products are the same, and the
softmax's function stores whole vectors (a row of 197 sliced, or 198 padded again for bf16 pairs, is stored one
element at a time). A NaN guard between them (where(isnan(p), 0, p), as exporters spell torch's
scaled_dot_product_attention) runs on the padded rows, before the slice.
"""

import ml_dtypes
import tvm
from tvm import relax

from ..._ir import pad_after, rewrite_function, tensor_dtype, tensor_shape
from ...dtypes import numpy_dtype
from ...ops import bound_call, call_op_name, sliced_by_binding
from .formula import scalar
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


def _leading_columns(rows: relax.Expr, columns: int) -> relax.Expr:
    """The slice of `rows`' first `columns` along the last axis: the padded columns off."""
    return relax.op.strided_slice(rows, axes=[len(tensor_shape(rows)) - 1], begin=[0], end=[columns])


@relax.expr_functor.mutator
class _RowPadder(relax.PyExprMutator):
    """Rewrites softmax(x) over rows off whole vectors into softmax(pad(x, lowest))[..., :n], and matmuls of such
    a slice into matmuls of the padded rows."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.padded_rows: set[relax.Var] = set()  # the padded softmaxes bound so far

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if call_op_name(new_call) == "relax.matmul":
            return self._matmul_of_padded_rows(new_call)
        if call_op_name(new_call) == "relax.where":
            return self._guard_of_padded_rows(new_call)
        if not isinstance(new_call.op, tvm.ir.Op) or new_call.op.name not in SOFTMAX_OPS:
            return new_call
        extra = _row_extra(new_call)
        if not extra:
            return new_call
        data, shape = new_call.args[0], tensor_shape(new_call.args[0])
        padded = self.builder_.emit(pad_after(data, len(shape), -1, extra, lowest(tensor_dtype(data))))
        rows = self.builder_.emit(relax.Call(new_call.op, [padded], new_call.attrs))
        if new_call.op.name == "relax.nn.softmax":  # log-softmax's padded columns are not zeros
            self.padded_rows.add(rows)
        return _leading_columns(rows, shape[-1])

    def _guard_of_padded_rows(self, call: relax.Call) -> relax.Expr:
        """`call`, a NaN guard of a padded softmax's slice (where(isnan(p), 0, p): attention as exporters spell
        torch's scaled_dot_product_attention), as the slice of the guard of the padded rows, which are themselves
        padded rows: a matmul of it reads them. A padded column is 0, which the guard keeps; else `call`."""
        condition, constant, value = call.args
        rows = sliced_by_binding(self, value)
        test = bound_call(self, condition, "relax.isnan")
        if rows not in self.padded_rows or test is None or not test.args[0].same_as(value) or scalar(constant) != 0.0:
            return call  # a zero: a fully masked row is NaN unpadded, 0 padded, and the guard makes both 0
        guarded = self.builder_.emit(relax.op.where(relax.op.isnan(rows), constant, rows))
        self.padded_rows.add(guarded)
        return _leading_columns(guarded, tensor_shape(value)[-1])

    def _matmul_of_padded_rows(self, call: relax.Call) -> relax.Expr:
        """`call` (a matmul) on the padded softmax rows its first operand slices, through a cast or not, with as
        many zero rows added to its second operand; else `call`."""
        data, operand = call.args
        cast = bound_call(self, data, "relax.astype")
        sliced = data if cast is None else cast.args[0]
        rows = sliced_by_binding(self, sliced)
        if rows not in self.padded_rows:  # its one slice is this pass's: the leading columns, the softmax's own
            return call
        columns, width, operand_shape = tensor_shape(sliced)[-1], tensor_shape(rows)[-1], tensor_shape(operand)
        if operand_shape is None or len(operand_shape) < 2 or operand_shape[-2] != columns:
            return call
        wide = rows if sliced is data else relax.op.astype(rows, tensor_dtype(data))
        zero_rows = pad_after(operand, len(operand_shape), -2, width - columns)
        return relax.Call(call.op, [self.builder_.emit(wide), self.builder_.emit(zero_rows)], call.attrs)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.PadSoftmaxRows")
class PadSoftmaxRows:
    """Pad the rows of each last-axis softmax and log-softmax to whole 16-lane vectors with the lowest value,
    and slice the result back; a matmul of the slice reads the padded softmax rows and zero rows of its second
    operand instead."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_function(_RowPadder(mod), mod, self.func)
