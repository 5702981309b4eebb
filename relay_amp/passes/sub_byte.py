"""Sub-byte values held in bytes: int4/uint4 tensors become int8/uint8 tensors holding the same values.

TVM 0.27 can neither allocate a sub-byte tensor nor compile one (a constant folded into one corrupts the heap;
the CUDA codegen has no type for its vectors). A `recast(..., "int4")` module holds int4 values only as the
results of casts, so each cast to int4 becomes a cast to int8 of its operand clamped to int4's range: the
values, and the int32 results of matmuls and convolutions over them, are exactly int4 arithmetic's, computed
by the int8 kernels. A cast's operand outside the range saturates (TVM's cast would wrap).
"""

import tvm
from tvm import relax

from .._ir import rewrite_function, tensor_dtype
from ..errors import DTypeError

HOLDERS = {"int4": ("int8", -8, 7), "uint4": ("uint8", 0, 15)}  # sub-byte dtype: (byte dtype, range)
_ASTYPE = tvm.ir.Op.get("relax.astype")


@relax.expr_functor.mutator
class _HoldInBytes(relax.PyExprMutator):
    """Casts to a sub-byte dtype become clamped casts to its byte holder; every reader follows the new dtype."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        dtype = tensor_dtype(call)
        if dtype not in HOLDERS:
            return new_call
        if not new_call.op.same_as(_ASTYPE):
            if tensor_dtype(new_call) in HOLDERS:  # not a reader of a held value: it makes a sub-byte tensor itself
                raise DTypeError(f"{call.op.name} makes a {dtype} tensor, which relay_amp can only hold as the "
                                 f"result of a cast (astype)")
            return new_call
        holder, low, high = HOLDERS[dtype]
        operand = new_call.args[0]
        clamped = self.builder_.emit(relax.op.clip(operand, low, high))
        return relax.op.astype(clamped, holder)


def _check_signature(func: relax.Function, name: str) -> None:
    for param in func.params:
        if tensor_dtype(param) in HOLDERS:
            raise DTypeError(f"{name} takes {param.name} as a {tensor_dtype(param)} tensor, which TVM 0.27 "
                             "cannot allocate: pass it as a wider dtype and cast it inside")


@tvm.transform.module_pass(opt_level=0, name="relay_amp.HoldSubByteInBytes")
class HoldSubByteInBytes:
    """Pass form of `hold_sub_byte_in_bytes`, for use inside tvm.transform.Sequential."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                _check_signature(func, gvar.name_hint)
                mod = rewrite_function(_HoldInBytes(mod), mod, gvar.name_hint)
        return mod


def hold_sub_byte_in_bytes(mod: tvm.IRModule) -> tvm.IRModule:
    """int4/uint4 values (results of casts) held in int8/uint8 tensors, clamped to their range, so TVM builds them."""
    return HoldSubByteInBytes()(mod)
