"""The CUDA pipeline: fusion; after fusion, tuning records, the tensor-core rule ahead of TVM's dlight rules,
and TVM's CUDA lowering."""

import tvm
from tvm import relax
from tvm.relax.backend.cuda import pipeline as cuda_lowering

from ..fusion import fusion_passes
from .tensorcore import gpu_schedules


def prepare_passes(target: tvm.target.Target, fast_math: bool = True) -> tvm.transform.Pass:
    """Legalization and fusion (`fast_math` is a CPU option; CUDA's exact functions are already fast)."""
    return tvm.transform.Sequential(fusion_passes(target), name="relay_amp_cuda_prepare")


def lowering_passes(target: tvm.target.Target, tuned: bool) -> tvm.transform.Pass:
    """For a prepared module: apply tuning records (when `tuned`), tensor cores and dlight, lower."""
    return tvm.transform.Sequential([
        *([relax.transform.MetaScheduleApplyDatabase()] if tuned else []),
        gpu_schedules(),
        *cuda_lowering.dataflow_lower_passes(target),
        *cuda_lowering.finalize_passes(target),
    ], name="relay_amp_cuda_lower")
