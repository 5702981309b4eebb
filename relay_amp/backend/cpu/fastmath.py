"""fastmath: vectorizable approximations of erf, exp, tanh, softmax and GELU for CPU builds.

LLVM compiles TVM's `erf`/`exp` to scalar libm calls, which left GELU as half of the BERT-style encoder's
time. `FastMath` rewrites `relax.nn.gelu` as x/2 * (1 + erf(x/sqrt 2)) with TVM's polynomial `fast_erf`, then
runs TVM's own `FastMathTransform` (fast_exp, fast_erf, fast_tanh, fast_softmax). The approximations stay
within about 1e-6 relative of the exact functions in fp32.
"""

import math

import tvm
from tvm import relax, topi

from ..._ir import rewrite_function

FAST_DTYPES = ("float32", "float16", "bfloat16")  # GELU in these is computed through fp32 fast_erf


def _fast_gelu(x: tvm.te.Tensor) -> tvm.te.Tensor:
    """GELU through fast_erf, computed in fp32 (fast_erf's only fast dtype) and returned in x's dtype."""
    wide = topi.cast(x, "float32") if x.dtype != "float32" else x
    scaled = topi.fast_erf(topi.multiply(wide, tvm.tirx.const(1.0 / math.sqrt(2.0), "float32")))
    gelu = topi.multiply(topi.multiply(wide, tvm.tirx.const(0.5, "float32")),
                         topi.add(scaled, tvm.tirx.const(1.0, "float32")))
    return topi.cast(gelu, x.dtype) if x.dtype != "float32" else gelu


@relax.expr_functor.mutator
class _GeluRewriter(relax.PyExprMutator):
    """Replaces relax.nn.gelu calls on floats by the fast_erf formulation."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if isinstance(new_call.op, tvm.ir.Op) and new_call.op.name == "relax.nn.gelu" \
                and str(new_call.args[0].ty.dtype) in FAST_DTYPES:
            return self.builder_.call_te(_fast_gelu, new_call.args[0], primfunc_name_hint="fast_gelu")
        return new_call


@tvm.transform.module_pass(opt_level=0, name="relay_amp.FastMath")
class FastMath:
    """Rewrite GELU, erf, exp, tanh and softmax into TVM's vectorizable fast approximations."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return relax.transform.FastMathTransform()(rewrite_function(_GeluRewriter(mod), mod, self.func))
