"""operand_scales: a matmul of operands scaled by constants as the matmul of the operands, its product scaled.

Exporters scale attention's query and key before their product: the dynamo exporter's scaled-dot-product
attention multiplies each by d^-1/4 (GPT-2: `matmul(q * 0.354, kᵀ * 0.354)`), others the query by d^-1/2, and
DeBERTa divides its key by sqrt(3d) (AMP widens it for the division and rounds it back: DeBERTa-v3's bf16 packing of
the divided keys ran 1.9x its fp32 on a 2-core Sapphire Rapids). Each
multiply is an elementwise pass of its own over an operand, and the key's joins its run-time packing: a gathered
transpose that cannot vectorize in bf16 (GPT-2's bf16 packing ran 1.49x its fp32). A product is linear in each
operand, so `ScalesAfterMatmuls` multiplies the product by the scales' product instead: a scalar step in the
kernel's epilogue, computed on the fp32 accumulator (in bf16 more exactly than on the rounded operands).
"""

import numpy as np
import tvm
from tvm import relax

from ..._dead_code import EliminateDeadCode
from ..._ir import get_function, read_counts, rewrite_function, tensor_dtype, tensor_shape
from ...dtypes import MODEL_FLOAT_DTYPES
from ...ops import bound_value, call_op_name
from .formula import scalar

PASSED = ("relax.astype", "relax.permute_dims", "relax.reshape")  # ops a scale commutes with


@relax.expr_functor.mutator
class _ScaleMover(relax.PyExprMutator):
    """Rewrites matmul(x * s, y * t) as matmul(x, y) * (s * t), casts, transposes and reshapes between a multiply
    and the matmul applied to the unscaled operand instead."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        super().__init__(mod)
        self.uses = read_counts(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if not isinstance(new_call.op, tvm.ir.Op) or new_call.op.name != "relax.matmul":
            return new_call
        if tensor_dtype(new_call) not in MODEL_FLOAT_DTYPES:
            return new_call
        unscaled = [self._unscaled(operand) for operand in new_call.args]
        if all(scale == 1.0 for _, scale in unscaled):
            return new_call
        product = self.builder_.emit(relax.Call(new_call.op, [operand for operand, _ in unscaled], new_call.attrs))
        scale = float(np.prod([scale for _, scale in unscaled]))
        return relax.op.multiply(product, relax.const(scale, tensor_dtype(new_call)))

    def _unscaled(self, operand: relax.Expr) -> "tuple[relax.Expr, float]":
        """`operand` computed from the input of its multiply by (or division by) a scalar constant, and the scale;
        (`operand`, 1.0) where it has none, or the casts and moves between them have other readers."""
        moves, source = [], operand
        while self.uses.get(source, 0) == 1 and call_op_name(bound := bound_value(self, source)) in PASSED:
            moves.append(bound)
            source = bound.args[0]
        data, scale = _scaled(bound_value(self, source))
        if data is None:
            return operand, 1.0
        same = tensor_shape(data) == tensor_shape(source) and tensor_dtype(data) == tensor_dtype(source)
        if scale is None or not same:  # a scalar tensor times a constant, or a broadcast
            return operand, 1.0
        for move in reversed(moves):
            data = self.builder_.emit(relax.Call(move.op, [data, *move.args[1:]], move.attrs))
        return data, scale


def _scaled(value: "relax.Expr | None") -> "tuple[relax.Expr | None, float | None]":
    """(x, s) where `value` is a float x times or divided by a constant scalar (s the factor, or 1 / the divisor;
    None where the other operand is no scalar constant); (None, None) for anything else."""
    name = call_op_name(value)
    if name not in ("relax.multiply", "relax.divide") or tensor_dtype(value) not in MODEL_FLOAT_DTYPES:
        return None, None
    data, factor = value.args
    if name == "relax.divide":
        divisor = scalar(factor)
        return data, None if not divisor else 1.0 / divisor
    if scalar(data) is not None:
        data, factor = factor, data
    return data, scalar(factor)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.ScalesAfterMatmuls")
class ScalesAfterMatmuls:
    """Rewrite each float matmul whose operands are multiplied or divided by scalar constants (before casts,
    transposes and reshapes that nothing else reads) as the matmul of the unscaled operands times the scales'
    product; multiplies and divisions nothing else reads are dropped."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        moved = rewrite_function(_ScaleMover(mod, get_function(mod, self.func)), mod, self.func)
        return EliminateDeadCode()(moved)
