"""Recast: force chosen op calls to a low-precision dtype with a wider accumulator."""

from collections.abc import Iterable

import tvm
from tvm import relax

from .._ir import (
    cast_result,
    emit_cast,
    has_attr_field,
    rewrite_function,
    tensor_dtype,
    with_attr,
)
from ..dtypes import check_dtype
from ..ops import canonical_ops
from .layers import layer_bindings, list_layers, resolve_layers

DEFAULT_RECAST_OPS = ("relax.nn.conv2d",)


@relax.expr_functor.mutator
class _RecastMutator(relax.PyExprMutator):
    """Casts the inputs of the chosen calls to `dtype` and their results back."""

    def __init__(self, mod: tvm.IRModule, chosen: set[relax.Call], dtype: str, out_dtype: str):
        super().__init__(mod)
        self.chosen = chosen
        self.dtype = dtype
        self.out_dtype = out_dtype

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if call not in self.chosen:
            return new_call
        args = [self._cast_arg(arg) for arg in new_call.args]
        attrs = new_call.attrs
        if has_attr_field(attrs, "out_dtype"):
            attrs = with_attr(attrs, out_dtype=self.out_dtype)
        low = relax.Call(new_call.op, args, attrs, new_call.ty_args)
        return cast_result(self.builder_, low, tensor_dtype(call))

    def _cast_arg(self, arg: relax.Expr) -> relax.Expr:
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([self._cast_arg(field) for field in arg.fields])
        if tensor_dtype(arg) is None:
            return arg
        return emit_cast(self.builder_, arg, self.dtype)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.Recast")
class Recast:
    """Pass form of `recast`, for use inside tvm.transform.Sequential."""

    def __init__(self, dtype: str, out_dtype: str, ops: Iterable[str] = DEFAULT_RECAST_OPS,
                 skip_layers: Iterable[int | str] | None = None, func: str = "main"):
        self.dtype = check_dtype(dtype, "dtype")
        self.out_dtype = check_dtype(out_dtype, "out_dtype")
        self.ops = canonical_ops(ops)
        self.skip_layers = list(skip_layers or ())
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        skipped = resolve_layers(list_layers(mod, self.ops, self.func), self.skip_layers)
        bindings = layer_bindings(mod, self.ops, self.func)
        chosen = {b.value for i, b in enumerate(bindings) if i not in skipped}
        return rewrite_function(_RecastMutator(mod, chosen, self.dtype, self.out_dtype), mod, self.func)


def recast(mod: tvm.IRModule, dtype: str, out_dtype: str, ops: Iterable[str] = DEFAULT_RECAST_OPS,
           skip_layers: Iterable[int | str] | None = None, func: str = "main") -> tvm.IRModule:
    """Run the chosen ops (conv2d by default) in `dtype` accumulating in `out_dtype`, skipping layers."""
    return Recast(dtype, out_dtype, ops, skip_layers, func)(mod)
