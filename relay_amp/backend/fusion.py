"""The legalization and fusion passes every backend runs after its own graph rewrites (as MetaSchedule's
compile_relax does them), so tuning, record matching and building see the same fused tasks."""

import tvm
from tvm import relax

from ..passes.pooling import GlobalPoolWindows

AUTO = "auto"  # a conv_layout that lets the backend pick the layout its kernels take


def fusion_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """Global pooling windows as reductions, then library dispatch, legalization, op-pattern annotation, constant
    folding and fusion for `target`."""
    return [
        GlobalPoolWindows(),
        *relax.pipeline.library_dispatch_passes(target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
