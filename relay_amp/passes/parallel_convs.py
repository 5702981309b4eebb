"""MergeParallelConvs: the sum of parallel convs of one tensor (RepVGG, MobileOne, FastViT branches) as one conv.

Such models are trained with parallel branches and meant to be reparameterized before inference; an export
without that step runs every branch. `relay_amp.frontend` merges them at import; this pass is for modules
imported another way.
"""

import tvm

from .._parallel_convs import merge_parallel_convs


@tvm.transform.module_pass(opt_level=0, name="relay_amp.MergeParallelConvs")
class MergeParallelConvs:
    """Every sum of constant-weight convs of one tensor (and scales, shifts and batch norms of them or of the tensor
    itself) as one conv and a bias add."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function of `mod`; the input module is left as it was."""
        return merge_parallel_convs(mod)
