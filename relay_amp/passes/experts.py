"""DenseExpertMatmuls: matmuls of expert weights gathered per row, as one matmul by every expert and a gather.

A mixture-of-experts layer exported with transformers' `batched_mm` experts copies each routed row's expert weight
out of the constant stack, then multiplies the row by its copy. Where the rows are at least as many as the experts,
all the rows are multiplied by all the experts' weights in one matmul the kernels take, and each row keeps its own
expert's outputs. `relay_amp.frontend` does this at import; this pass is for modules imported another way.
"""

import tvm

from .._expert_matmuls import expert_matmuls_dense


@tvm.transform.module_pass(opt_level=0, name="relay_amp.DenseExpertMatmuls")
class DenseExpertMatmuls:
    """Every matmul of a constant weight stack gathered by runtime row indices (one row or column per weight), over
    at least as many rows as experts, as a matmul by all the weights and a gather of each row's expert."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite Relax function `func` of `mod`; the input module is left as it was."""
        return expert_matmuls_dense(mod, self.func)
