"""The passes every backend runs: deduplication before its own graph rewrites, and legalization and fusion after
them (as MetaSchedule's compile_relax does them), so tuning, record matching and building see the same fused
tasks."""

import tvm
from tvm import relax

from .._dead_code import EliminateDeadCode
from .._folding import FoldConstants
from ..passes.booleans import BooleanComparisons
from ..passes.pooling import GlobalPoolWindows, SeparableMaxPools
from ..passes.selection import WidenedSelections
from ..passes.splits import SplitsAsSlices
from .cast_copies import CastsPerReader

AUTO = "auto"  # a conv_layout that lets the backend pick the layout its kernels take


def deduplication_passes() -> list[tvm.transform.Pass]:
    """Identical bindings computed once (a quantizer's or an exporter's copy per reader), then the aliases that
    leaves folded away."""
    return [relax.transform.EliminateCommonSubexpr(), relax.transform.CanonicalizeBindings(),
            EliminateDeadCode()]


def fusion_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """Global pooling windows as reductions, large max-pool windows as rows then columns, 16-bit sorts and
    arg-reductions on fp32 (relay_amp.passes.selection), compares of bool tensors as logical ops
    (relay_amp.passes.booleans) and splits read part by part as slices
    (relay_amp.passes.splits), then library dispatch, legalization, op-pattern annotation, constant folding, a copy
    of each cast for each of its fusible readers (relay_amp.backend.cast_copies) and fusion for `target`."""
    return [
        GlobalPoolWindows(),
        SeparableMaxPools(),
        WidenedSelections(),
        BooleanComparisons(),
        SplitsAsSlices(),
        *relax.pipeline.library_dispatch_passes(target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        FoldConstants,
        CastsPerReader(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
