"""MergeParallelConvs: the sum of parallel convs of one tensor (RepVGG, MobileOne, FastViT branches) as one conv;
GroupSplitConvs: the concatenated convs of a split's parts (timm's MixedConv2d) as one grouped conv.

Models trained with summed parallel branches are meant to be reparameterized before inference; an export without
that step runs every branch. A split convolved part by part runs a kernel per part. `relay_amp.frontend` merges
both at import; these passes are for modules imported another way.
"""

import tvm

from .._parallel_convs import merge_parallel_convs
from .._split_convs import split_convs_grouped


@tvm.transform.module_pass(opt_level=0, name="relay_amp.MergeParallelConvs")
class MergeParallelConvs:
    """Every sum of constant-weight convs of one tensor (and scales, shifts and batch norms of them or of the tensor
    itself) as one conv and a bias add."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function of `mod`; the input module is left as it was."""
        return merge_parallel_convs(mod)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.GroupSplitConvs")
class GroupSplitConvs:
    """Every concatenation of alike convs (and per-channel bias adds) of a split's equal parts, in order, as one
    grouped conv of the split's input and a bias add."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function of `mod`; the input module is left as it was."""
        return split_convs_grouped(mod)
