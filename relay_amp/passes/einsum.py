"""EinsumsAsMatmuls: einsums of two tensors as transposes and reshapes around one matmul, which the kernels take.

TVM computes an einsum by topi.einsum, a loop nest no kernel takes (and its ONNX importer writes an Einsum node as
a call of that TE function, which AMP cannot lower). `relay_amp.frontend` does this at import; this pass is for
modules imported another way.
"""

import tvm

from .._einsum import einsums_as_matmuls


@tvm.transform.module_pass(opt_level=0, name="relay_amp.EinsumsAsMatmuls")
class EinsumsAsMatmuls:
    """Every einsum of two tensors of static shapes (relax.einsum, or a call of a TE einsum) as a matmul."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite Relax function `func` of `mod`; the input module is left as it was."""
        return einsums_as_matmuls(mod, self.func)
