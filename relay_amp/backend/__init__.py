"""Backends: what turns a converted Relax module into scheduled, lowered code for one kind of target.

Each backend has a `pipeline.py` with two functions that build and tuning both call:
`prepare_passes(target, fast_math, conv_layout)` (layout, kernel dispatch, legalization, fusion: the tasks
MetaSchedule sees) and
`lowering_passes(target, tuned)` (tuning records, default schedules, lowering to the VM), and
`untuned_schedule(func, target)` (the default schedule of one task, which tuning measures first), and
`candidate_passes(target)` (what a measured candidate gets after its schedule, as a built function does), and
`PASS_CONFIG` (the PassContext options a build for the backend runs under), and
`TIR_PIPELINE` (the name of the TIR lowering pipeline a build for the backend runs).
"""

import tvm

from .cpu import pipeline as cpu_pipeline
from .cuda import pipeline as cuda_pipeline


def pipeline_for(target: tvm.target.Target):
    """The pipeline module (`prepare_passes`, `lowering_passes`) of the backend that compiles for `target`."""
    return cpu_pipeline if target.kind.name == "llvm" else cuda_pipeline
