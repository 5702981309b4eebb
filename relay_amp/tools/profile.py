"""profile: the time of every fused function and kernel call of a build, dtype variants side by side.

The Relax VM calls a hook before and after each call (`VirtualMachine.set_instrument`); the time between the
two is the call's. Calls are grouped by the ops their function computes, with casts, pads, slices, reshapes and
TVM's numbering dropped (`fused_reshape7_cast4_add5_erf` and `fused_add1_erf_reshape3` are both `add_erf`; a
bf16 build's `conv2d_add_pad`, whose pad for the next AMX kernel fusion put there, lines up with fp32's
`conv2d_add`, its time included, and LeViT's `add_add_strided_slice`, whose slice trims bf16 attention scores
computed over whole pairs of column blocks, with fp32's `add_add` (the zoo bench had flagged it a bf16 slow
path); GPT-2's query-key-value split, `reshape_reshape_split` in fp32 and `reshape_split` in bf16, is `split` in
both), so the same work lines up across dtypes; rows are sorted by how much slower the last
variant is than the first. The variants' runs alternate in one process, as the benchmarks' runners do.
That is how a slow path shows itself: a row whose bf16 time is many times its fp32 time.

The hook's own time (a call into Python, the call's arguments converted for it) falls inside each call's: 0.4-2 us
a call, most of what the `vm.builtin` rows show (LeViT-128S in bf16: 0.52 ms over 500 builtin calls, its whole run
1.74 ms against 1.78 summed over its kernels alone). `profile` also times each variant's whole run without the hook
(the WHOLE_RUN row, apart from the total): the build's real time.
"""

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import tvm
from tabulate import tabulate
from tvm import relax

from ..backend.fusion import AUTO
from ..compile.build import build
from ..errors import OptionError
from ..runtime import virtual_machine
from .bench import BASELINE, relay_runner, variant
from .models import example_inputs
from .peers import rotating_medians

# casts, a backend's padding and the slices that trim it, and reshapes (free views that fusion puts on either side
# of a function) join the ops
DROPPED_TOKENS = frozenset({"fused", "astype", "cast", "pad", "strided", "slice", "reshape", ""})
# a function of those only: one that pads is a pad, whatever it trims first (RegNetY's bf16 crops its channel-padded
# results and pads them for the grouped conv in one function, where its fp32 pads alone)
ALONE = (("pad", "pad"), ("slice", "strided_slice"), ("reshape", "reshape"))
KEEP_GOING = 0  # VMInstrumentReturnKind.NO_OP: run the call as usual
WHOLE_RUN = "whole run, no hook"  # the group of `main` timed as a whole on a VM without the hook
WHOLE_RUN_BLOCK = 3  # runs per block of the whole-run timing


def call_group(symbol: str) -> str:
    """The ops a VM call computes, without casts, pads, slices, reshapes and numbering: the key that lines variants
    up."""
    tokens = [token.rstrip("0123456789") for token in symbol.split("_")]
    kept = "_".join(token for token in tokens if token not in DROPPED_TOKENS)
    return kept or next((op for token, op in ALONE if token in tokens), "cast")


def call_key(symbol: str, call_args: Sequence) -> str:
    """A compiled function's call group and the shape of the result it writes (its last argument: the kernels of a
    model, one group, split by their output shapes, which both dtypes share); a VM builtin's group alone."""
    result = next((arg for arg in reversed(call_args) if hasattr(arg, "shape")), None)
    if symbol.startswith("vm.") or result is None:
        return call_group(symbol)
    return f"{call_group(symbol)} -> {tuple(int(extent) for extent in result.shape)}"


def call_times(executables: dict[str, relax.VMExecutable], inputs: Sequence[np.ndarray], repeat: int = 5,
               warmup: int = 2, by_shape: bool = False,
               whole_runs: bool = False) -> dict[str, dict[str, tuple[int, float]]]:
    """Per variant, per call group: (calls per run, median ms per run over `repeat` runs) of `main` on `inputs`.
    The variants run in turn, one run each, the first of each round rotating, so that the machine's drift (20-50%
    within minutes on a shared VM) falls on all of them alike rather than on whichever ran last. `by_shape` splits
    each group of compiled functions by the shape of the result they write (`call_key`); `whole_runs` adds the
    group WHOLE_RUN: `main` timed as a whole without the hook, in rotating blocks too."""
    _check_repeat(repeat)
    timers = {name: _CallTimer(executable, inputs, warmup, by_shape) for name, executable in executables.items()}
    order = list(timers)
    for round_index in range(repeat):
        shift = round_index % len(order)
        for name in order[shift:] + order[:shift]:
            timers[name].run()
    times = {name: timer.times() for name, timer in timers.items()}
    if whole_runs:
        runs = {name: relay_runner(executable, inputs) for name, executable in executables.items()}
        for name, ms in rotating_medians(runs, repeat, WHOLE_RUN_BLOCK).items():
            times[name][WHOLE_RUN] = (1, ms)
    return times


def _check_repeat(repeat: int) -> None:
    if repeat < 1:
        raise OptionError(f"repeat must be at least 1, got {repeat}")


class _CallTimer:
    """One executable's VM, warmed up, with a hook that records each call's time under its call group."""

    def __init__(self, executable: relax.VMExecutable, inputs: Sequence[np.ndarray], warmup: int, by_shape: bool):
        self.by_shape = by_shape
        self.vm = virtual_machine(executable)
        self.args = [tvm.runtime.tensor(np.ascontiguousarray(x)) for x in inputs]
        for _ in range(warmup):
            self.vm["main"](*self.args)
        self.runs: list[dict[str, list[float]]] = []
        self.started: list[float] = []
        self.vm.set_instrument(self._instrument)

    def _instrument(self, func, symbol, before_run, ret_value, *call_args) -> int:
        if before_run:
            self.started.append(time.perf_counter())
        else:
            elapsed = time.perf_counter() - self.started.pop()  # before the key, which is not the call's time
            key = call_key(symbol, call_args) if self.by_shape else call_group(symbol)
            self.runs[-1][key].append(elapsed)
        return KEEP_GOING

    def run(self) -> None:
        """One timed run of `main`."""
        self.runs.append(defaultdict(list))
        self.vm["main"](*self.args)

    def times(self) -> dict[str, tuple[int, float]]:
        """Per call group: calls per run and median ms per run."""
        groups = {group for run in self.runs for group in run}
        return {group: (len(self.runs[0][group]), statistics.median(sum(run[group]) for run in self.runs) * 1e3)
                for group in groups}


@dataclass(frozen=True)
class ProfileRow:
    """One call group: how often it runs per inference and its ms per inference in each variant."""

    group: str
    calls: dict[str, int]
    ms: dict[str, float]

    def penalty(self, first: str, last: str) -> float:
        """ms in `last` minus ms in `first` (a group missing from a variant counts 0 there)."""
        return self.ms.get(last, 0.0) - self.ms.get(first, 0.0)


def profile(mod: tvm.IRModule, dtypes: Sequence[str] = (BASELINE, "bfloat16"), target: str = "cpu",
            repeat: int = 5, *, conv_layout: "str | list[str] | None" = AUTO, fast_math: bool = True,
            by_shape: bool = False, inputs: "Sequence[np.ndarray] | None" = None,
            calibration: "Sequence | None" = None) -> list[ProfileRow]:
    """Build every dtype variant of `mod` (as relay-amp bench does; int8q calibrated on `calibration`, random
    batches by default) and time each call group on `inputs` (random ones by default), split by output shape with
    `by_shape`, worst penalty first, and each variant's whole run without the hook (WHOLE_RUN)."""
    if not dtypes:
        raise OptionError("profile needs at least one dtype")
    _check_repeat(repeat)  # before anything is built
    executables = {dtype: build(variant(mod, dtype, calibration), target, fast_math=fast_math,
                                conv_layout=conv_layout) for dtype in dtypes}
    inputs = example_inputs(mod) if inputs is None else inputs
    return profile_rows(call_times(executables, inputs, repeat, by_shape=by_shape, whole_runs=True))


def profile_rows(measured: dict[str, dict[str, tuple[int, float]]]) -> list[ProfileRow]:
    """call_times of several variants (variant -> group -> times) lined up, worst penalty of the last first."""
    variants = list(measured)
    groups = sorted({group for times in measured.values() for group in times})
    rows = [ProfileRow(group, {v: t[group][0] for v, t in measured.items() if group in t},
                       {v: t[group][1] for v, t in measured.items() if group in t}) for group in groups]
    return sorted(rows, key=lambda row: -row.penalty(variants[0], variants[-1]))


def format_profile(rows: Sequence[ProfileRow], dtypes: Sequence[str], top: int | None = None) -> str:
    """A printable table: per call group its calls and ms per variant, and the last variant's ratio to the first;
    the total of the groups, then any WHOLE_RUN row (the whole runs without the hook), which the total leaves out."""
    whole = [row for row in rows if row.group == WHOLE_RUN]
    calls = [row for row in rows if row.group != WHOLE_RUN]
    table = [_table_row(row, dtypes) for row in calls[:top]]
    totals = ["total", *(f"{sum(r.ms.get(d, 0.0) for r in calls):.3f}" for d in dtypes), ""]
    headers = ["call group", *(f"{d} ms (calls)" for d in dtypes), f"{dtypes[-1]} / {dtypes[0]}"]
    return tabulate([*table, totals, *(_table_row(row, dtypes) for row in whole)], headers=headers)


def _table_row(row: ProfileRow, dtypes: Sequence[str]) -> list:
    first, last = dtypes[0], dtypes[-1]
    ratio = row.ms.get(last, 0.0) / row.ms[first] if row.ms.get(first) else float("inf")
    return [_label(row.group), *(f"{row.ms[d]:.3f} ({row.calls[d]})" if d in row.ms else "-" for d in dtypes),
            f"{ratio:.2f}x"]


def _label(group: str, width: int = 70) -> str:
    """`group` cut to `width` characters, an output shape (`call_key`) kept whole."""
    ops, arrow, shape = group.partition(" -> ")
    return f"{ops[:max(width - len(arrow + shape), 20)]}{arrow}{shape}"


def profile_to_json(rows: Sequence[ProfileRow], **context) -> str:
    """Profile rows and their context (model, target, ...) as JSON."""
    return json.dumps({**context, "rows": [asdict(row) for row in rows]}, indent=1)
