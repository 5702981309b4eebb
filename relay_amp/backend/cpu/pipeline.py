"""The CPU pipeline: fast math and kernel dispatch, then fusion; after fusion, tuning records, relay_amp's
default schedules and TVM's CPU lowering."""

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

from ..fusion import fusion_passes
from . import amx
from .dispatch import UseDotKernels, target_dtypes
from .fastmath import FastMath
from .kernels import DotKernelRule
from .schedules import default_schedules


def prepare_passes(target: tvm.target.Target, fast_math: bool = True) -> tvm.transform.Pass:
    """Fast math (unless turned off) and dot-product kernel dispatch, then legalization and fusion.

    Dispatched kernels are already tensorized; MetaSchedule tunes their tiles through their own rule.
    """
    dtypes = target_dtypes(target)
    return tvm.transform.Sequential([
        *([FastMath()] if fast_math else []),
        *([UseDotKernels(dtypes, amx_dtypes=amx.target_dtypes(target))] if dtypes else []),
        *fusion_passes(target),
    ], name="relay_amp_cpu_prepare")


def lowering_passes(target: tvm.target.Target, tuned: bool) -> tvm.transform.Pass:
    """For a prepared module: apply tuning records (when `tuned`), default schedules for the rest, lower."""
    return tvm.transform.Sequential([
        *([relax.transform.MetaScheduleApplyDatabase()] if tuned else []),
        default_schedules(DotKernelRule()),
        *cpu_generic.dataflow_lower_passes(target),
        *cpu_generic.finalize_passes(target),
    ], name="relay_amp_cpu_lower")
