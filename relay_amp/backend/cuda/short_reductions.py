"""short_reductions: reductions over a few values each (the windows of depthwise convs and pools) scheduled one
output a thread.

dlight's reduction rules give every output of such a function a block of threads that reduce it together: a
depthwise 3x3 conv got 256 threads an output, 9 of them busy, then a shuffle tree over all 256 (MobileNetV3-Large's
four widest depthwise convs took 0.16-0.19 ms each on an H200, half the model's time). Where every reduction is
short, `ShortReductionRule` hands the function to dlight's Fallback instead: the outputs spread over the threads,
each thread adding its window's few products serially.
"""

import math

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func

SHORT_REDUCTION = 64  # values one output reduces, at most (a depthwise 7x7 window: 49)


class ShortReductionRule(dl.ScheduleRule):
    """Functions whose every reduction covers at most SHORT_REDUCTION values, scheduled one output a thread."""

    def is_target_available(self, target) -> bool:
        """Whether `target` is a CUDA target."""
        return target.kind.name == "cuda"

    def apply(self, func: tirx.PrimFunc, target, tunable: bool) -> s_tir.Schedule | None:
        """dlight's Fallback schedule of `func` where its reductions are all short, else None."""
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        if not _reductions_are_short(func):
            return None
        return dl.gpu.Fallback().apply(func, target, tunable)


def _reductions_are_short(func: tirx.PrimFunc) -> bool:
    """Whether `func` has a reduction and each of its reductions covers at most SHORT_REDUCTION values, with
    static extents."""
    blocks = normalize_prim_func(s_tir.Schedule(func))
    if not blocks:
        return False
    sizes = [_reduced_values(block) for block in blocks if block.is_reduction()]
    return bool(sizes) and all(size is not None and size <= SHORT_REDUCTION for size in sizes)


def _reduced_values(block) -> int | None:
    """How many values one output of `block` reduces, None where an extent is not static."""
    extents = [iter_info.dom for iter_info in block.iters if iter_info.kind == "R"]
    if not all(isinstance(extent, (int, tirx.IntImm)) for extent in extents):
        return None
    return math.prod(int(extent) for extent in extents)
