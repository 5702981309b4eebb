"""Accuracy-aware conversion: keep the fewest layers out of the low dtype that hold a metric within tolerance.

For float16/bfloat16 the kept layers run in fp32 (AMP's excluded layers); for int8 they run in quantize's
fallback dtype, from one calibration whose plan is re-applied per candidate (realize_prepared).
"""

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import tvm
from tabulate import tabulate
from tqdm import tqdm

from ..compile.build import build
from ..errors import MissingDependencyError, OptionError
from ..passes.amp import PrecisionPlan, precision_plan, to_mixed_precision
from ..passes.layers import DEFAULT_LAYER_OPS, Layer, list_layers
from ..passes.quantize import Quantize, QuantPlan, quant_plan
from ..passes.quantize.realize import FALLBACK, QUANTIZABLE_OPS, prepared, realize_prepared
from ..passes.ranges import as_input_list, check_inputs
from ..runtime import run_executable
from .metrics import agreement_metric

STRATEGIES = ("auto", "sensitivity", "bisect")
INT8 = "int8"


@dataclass
class LayerResult:
    """A layer's sensitivity (the metric with only it kept out of the target dtype) and the dtype it ends in."""

    index: int
    op: str
    name: str
    dtype: str
    sensitivity: float | None = None


@dataclass
class Report:
    """What tune_precision measured and decided."""

    target_dtype: str
    baseline: float
    goal: float
    final: float
    met: bool
    evaluations: int
    wall_time_s: float
    message: str
    layers: list[LayerResult] = field(default_factory=list)
    kept_dtype: str = "float32"  # where a layer kept out of target_dtype runs (int8: quantize's fallback dtype)

    @property
    def kept_layers(self) -> list[LayerResult]:
        """The layers kept out of the target dtype (in kept_dtype)."""
        return [layer for layer in self.layers if layer.dtype == self.kept_dtype]

    def summary(self) -> str:
        """A readable account: metrics, evaluations, and the kept layers with their sensitivity."""
        rows = [(l.index, l.op.removeprefix("relax."), l.name, l.dtype,
                 "" if l.sensitivity is None else f"{l.sensitivity:.4f}") for l in self.layers]
        table = tabulate(rows, headers=("layer", "op", "name", "dtype", f"metric with it alone in {self.kept_dtype}"))
        return (f"{self.message}\nbaseline {self.baseline:.4f}, goal {self.goal:.4f}, final {self.final:.4f}; "
                f"{len(self.kept_layers)} of {len(self.layers)} layers in {self.kept_dtype}; "
                f"{self.evaluations} evaluations in {self.wall_time_s:.1f} s\n{table}")

    def plot(self, path) -> None:
        """Draw per-layer sensitivity, coloured by final dtype, with the baseline and goal lines."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise MissingDependencyError("Report.plot needs matplotlib: pip install 'relay_amp[plot]'") from err
        figure, axes = plt.subplots(figsize=(max(4.0, 0.4 * len(self.layers) + 2), 3.5))
        heights = [l.sensitivity if l.sensitivity is not None else self.final for l in self.layers]
        colours = ["tab:red" if l.dtype == self.kept_dtype else "tab:blue" for l in self.layers]
        axes.bar([l.index for l in self.layers], heights, color=colours)
        axes.axhline(self.baseline, color="black", linestyle="--", label=f"fp32 baseline {self.baseline:.3f}")
        axes.axhline(self.goal, color="tab:orange", linestyle=":", label=f"goal {self.goal:.3f}")
        axes.set_xlabel(f"layer (red: kept in {self.kept_dtype})")
        axes.set_ylabel(f"metric with the layer alone in {self.kept_dtype}")
        axes.set_title(f"{self.target_dtype}: final {self.final:.3f}")
        axes.legend(loc="lower right", fontsize="small")
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)


class _BudgetSpent(Exception):
    """max_trials evaluations were made."""


class _AmpConverter:
    """AMP to the target dtype with the kept layers excluded (they run in fp32)."""

    def __init__(self, mod: tvm.IRModule, target_dtype: str, layer_ops: tuple[str, ...], options: dict):
        self.mod, self.target_dtype, self.options = mod, target_dtype, {"layer_ops": layer_ops, **options}
        self.layers, self.kept_dtype = list_layers(mod, layer_ops), "float32"

    def convert(self, kept: Iterable[int]) -> tvm.IRModule:
        return to_mixed_precision(self.mod, self.target_dtype, excluded_layers=sorted(kept), **self.options)

    def unconverted(self) -> tvm.IRModule:
        return to_mixed_precision(self.mod, self.target_dtype, target_dtype_ops=[])

    def dtype_of(self, layer: Layer, kept: set[int]) -> str:
        return self.kept_dtype if layer.index in kept else self.target_dtype

    @staticmethod
    def plan(converted: tvm.IRModule) -> PrecisionPlan:
        return precision_plan(converted)


class _QuantConverter:
    """quantize, calibrated once: each candidate re-applies that plan with the kept layers in its fallback dtype.
    Layers quantize cannot make int8 are not searched."""

    target_dtype = INT8

    def __init__(self, mod: tvm.IRModule, calibration: list, layer_ops: tuple[str, ...], options: dict):
        self.mod = prepared(mod)  # once, not per candidate
        self.base = Quantize(calibration, ops=layer_ops, **options).plan(self.mod)
        self.kept_dtype = self.base.fallback_dtype
        searched = {entry.index for entry in self.base.entries if entry.quantized}
        self.layers = [layer for layer in list_layers(self.mod, layer_ops) if layer.index in searched]

    def _plan(self, kept: Iterable[int], fallback_dtype: str) -> QuantPlan:
        kept = set(kept)
        entries = [dataclasses.replace(entry, dtype=FALLBACK, threshold=0.0, reason="kept by tune_precision")
                   if entry.index in kept else entry for entry in self.base.entries]
        return dataclasses.replace(self.base, fallback_dtype=fallback_dtype, entries=entries)

    def convert(self, kept: Iterable[int]) -> tvm.IRModule:
        return realize_prepared(self.mod, self._plan(kept, self.kept_dtype))

    def unconverted(self) -> tvm.IRModule:
        return realize_prepared(self.mod, self._plan([entry.index for entry in self.base.entries], "float32"))

    def dtype_of(self, layer: Layer, kept: set[int]) -> str:
        return self.kept_dtype if layer.index in kept else self.base.entries[layer.index].dtype

    @staticmethod
    def plan(converted: tvm.IRModule) -> QuantPlan:
        return quant_plan(converted)


class _Evaluator:
    """Scores sets of kept layers; each set is converted, compiled and run once."""

    def __init__(self, mod, batches, labels, metric, converter, target, max_trials, bar):
        self.mod, self.batches, self.converter, self.target = mod, batches, converter, target
        self.max_trials, self.bar = max_trials, bar
        reference = self._outputs(build(mod, target))
        self.metric = metric or agreement_metric(reference)
        self.truth = reference if metric is None else labels
        self.baseline = self._metric(reference)
        if math.isnan(self.baseline):
            raise OptionError("the metric returned NaN on the fp32 model")
        self.scores: dict[frozenset, float] = {}

    def _outputs(self, executable) -> np.ndarray:
        return np.concatenate([run_executable(executable, inputs)[0] for inputs in self.batches])

    def _metric(self, outputs: np.ndarray) -> float:
        return float(self.metric(outputs, self.truth))

    def score(self, kept: Iterable[int]) -> float:
        key = frozenset(kept)
        if key not in self.scores:
            if len(self.scores) >= self.max_trials:
                raise _BudgetSpent
            value = self._metric(self._outputs(build(self.converter.convert(key), self.target)))
            self.scores[key] = -math.inf if math.isnan(value) else value
            self.bar.update(1)
        return self.scores[key]


class _Search:
    """The fallback strategies over one evaluator and goal."""

    def __init__(self, evaluator: _Evaluator, layers: list[Layer], goal: float):
        self.evaluator, self.layers, self.goal = evaluator, layers, goal
        self.sensitivity: dict[int, float] = {}

    def meets(self, kept) -> bool:
        return self.evaluator.score(kept) >= self.goal

    def by_op_type(self) -> set[int] | None:
        groups = {}
        for layer in self.layers:
            groups.setdefault(layer.op, set()).add(layer.index)
        passing = [group for group in groups.values() if self.meets(group)]
        return min(passing, key=len) if passing else None

    def by_sensitivity(self) -> set[int] | None:
        for layer in self.layers:
            self.sensitivity[layer.index] = self.evaluator.score({layer.index})
        ranked = sorted(self.sensitivity, key=lambda i: -self.sensitivity[i])
        for count in range(1, len(ranked) + 1):
            if self.meets(ranked[:count]):
                return set(ranked[:count])
        return None

    def prune(self, kept: set[int]) -> set[int]:
        """Bisect the kept set, returning every segment to low precision that the goal allows."""
        keep, segments = set(kept), [sorted(kept)]
        while segments:
            segment = segments.pop()
            if self.meets(keep - set(segment)):
                keep -= set(segment)
            elif len(segment) > 1:
                middle = len(segment) // 2
                segments += [segment[middle:], segment[:middle]]
        return keep

    def run(self, strategy: str) -> set[int] | None:
        every = {layer.index for layer in self.layers}
        if strategy == "bisect":
            return self.prune(every) if self.meets(every) else None
        if self.meets(set()):
            return set()
        found = self.by_op_type() if strategy == "auto" else None
        found = found if found is not None else self.by_sensitivity()
        return self.prune(found) if found is not None else None


def _split(dataset: Iterable, labelled: bool) -> tuple[list[list[np.ndarray]], np.ndarray | None]:
    items = list(dataset)
    if not items:
        raise OptionError("the dataset is empty")
    if not labelled:
        return [as_input_list(item) for item in items], None
    if not all(isinstance(item, (tuple, list)) and len(item) == 2 for item in items):
        raise OptionError("with a metric, dataset items must be (inputs, labels) pairs")
    return [as_input_list(x) for x, _ in items], np.concatenate([np.asarray(y) for _, y in items])


def tune_precision(mod: tvm.IRModule, dataset: Iterable, metric: Callable | None = None,
                   target_dtype: str = "float16", tolerance: float = 0.01, relative: bool = True,
                   max_trials: int = 64, strategy: str = "auto", target: str = "cpu", progress: bool = True,
                   layer_ops: Iterable[str] | None = None, calibration: Iterable | None = None, **options
                   ) -> tuple[tvm.IRModule, "PrecisionPlan | QuantPlan", Report]:
    """Convert to `target_dtype` keeping the fewest layers out of it that hold `metric` within tolerance."""
    if strategy not in STRATEGIES:
        raise OptionError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    if not tolerance >= 0:
        raise OptionError(f"tolerance must be >= 0, got {tolerance!r}")
    started = time.perf_counter()
    batches, labels = _split(dataset, metric is not None)
    for inputs in batches:
        check_inputs(mod, inputs)
    converter = _converter(mod, target_dtype, layer_ops, calibration, batches, options)
    with tqdm(total=max_trials, desc="precision search", unit="eval", disable=not progress) as bar:
        evaluator = _Evaluator(mod, batches, labels, metric, converter, target, max_trials, bar)
        goal = evaluator.baseline - tolerance * (abs(evaluator.baseline) if relative else 1.0)
        search = _Search(evaluator, converter.layers, goal)
        try:
            kept, message = search.run(strategy), ""
        except _BudgetSpent:
            kept, message = _best_within(evaluator, goal), f"stopped after max_trials={max_trials}; "
    return _result(evaluator, search, kept, goal, message, started)


def _converter(mod, target_dtype: str, layer_ops, calibration, batches, options) -> "_AmpConverter | _QuantConverter":
    """int8: quantize's plan searched, calibrated on `calibration` or else the dataset's `batches` (options are
    quantize's); otherwise AMP (options are to_mixed_precision's)."""
    if target_dtype == INT8:
        calibration = batches if calibration is None else list(calibration)
        return _QuantConverter(mod, calibration, tuple(layer_ops or QUANTIZABLE_OPS), options)
    if calibration is not None:
        raise OptionError(f"calibration is for target_dtype='int8'; AMP to {target_dtype} calibrates nothing")
    return _AmpConverter(mod, target_dtype, tuple(layer_ops or DEFAULT_LAYER_OPS), options)


def _best_within(evaluator: _Evaluator, goal: float) -> set[int] | None:
    passing = [key for key, value in evaluator.scores.items() if value >= goal]
    return set(min(passing, key=len)) if passing else None


def _result(evaluator, search, kept, goal, message, started):
    converter = evaluator.converter
    if kept is None:
        converted, final, kept_dtype = converter.unconverted(), evaluator.baseline, "float32"
        message += (f"the goal {goal:.4f} cannot be met in {converter.target_dtype} even with every layer "
                    f"in {converter.kept_dtype} that was tried: returning the all-fp32 plan")
        dtypes = {layer.index: kept_dtype for layer in converter.layers}
    else:
        converted, final, kept_dtype = converter.convert(kept), evaluator.scores[frozenset(kept)], converter.kept_dtype
        message += f"goal met with {len(kept)} of {len(converter.layers)} layers in {kept_dtype}"
        dtypes = {layer.index: converter.dtype_of(layer, kept) for layer in converter.layers}
    results = [LayerResult(l.index, l.op, l.name, dtypes[l.index], search.sensitivity.get(l.index))
               for l in converter.layers]
    report = Report(converter.target_dtype, evaluator.baseline, goal, final, kept is not None, len(evaluator.scores),
                    time.perf_counter() - started, message, results, kept_dtype)
    return converted, converter.plan(converted), report
