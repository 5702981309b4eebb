"""Accuracy-aware conversion: keep the fewest layers in fp32 that hold a metric within tolerance."""

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
from ..passes.ranges import as_input_list, check_inputs
from ..runtime import run_executable
from .metrics import agreement_metric

STRATEGIES = ("auto", "sensitivity", "bisect")


@dataclass
class LayerResult:
    """A layer's sensitivity (the metric with only it in fp32) and the dtype it ends in."""

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

    @property
    def fp32_layers(self) -> list[LayerResult]:
        """The layers kept in fp32."""
        return [layer for layer in self.layers if layer.dtype == "float32"]

    def summary(self) -> str:
        """A readable account: metrics, evaluations, and the fp32 layers with their sensitivity."""
        rows = [(l.index, l.op.removeprefix("relax."), l.name, l.dtype,
                 "" if l.sensitivity is None else f"{l.sensitivity:.4f}") for l in self.layers]
        table = tabulate(rows, headers=("layer", "op", "name", "dtype", "metric with it alone in fp32"))
        return (f"{self.message}\nbaseline {self.baseline:.4f}, goal {self.goal:.4f}, final {self.final:.4f}; "
                f"{len(self.fp32_layers)} of {len(self.layers)} layers in fp32; "
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
        colours = ["tab:red" if l.dtype == "float32" else "tab:blue" for l in self.layers]
        axes.bar([l.index for l in self.layers], heights, color=colours)
        axes.axhline(self.baseline, color="black", linestyle="--", label=f"fp32 baseline {self.baseline:.3f}")
        axes.axhline(self.goal, color="tab:orange", linestyle=":", label=f"goal {self.goal:.3f}")
        axes.set_xlabel("layer (red: kept in fp32)")
        axes.set_ylabel("metric with the layer alone in fp32")
        axes.set_title(f"{self.target_dtype}: final {self.final:.3f}")
        axes.legend(loc="lower right", fontsize="small")
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)


class _BudgetSpent(Exception):
    """max_trials evaluations were made."""


class _Evaluator:
    """Scores sets of fp32 layers; each set is compiled and run once."""

    def __init__(self, mod, batches, labels, metric, target_dtype, target, amp_options, max_trials, bar):
        self.mod, self.batches, self.target_dtype, self.target = mod, batches, target_dtype, target
        self.amp_options, self.max_trials, self.bar = amp_options, max_trials, bar
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

    def convert(self, fp32_layers: Iterable[int]) -> tvm.IRModule:
        return to_mixed_precision(self.mod, self.target_dtype, excluded_layers=sorted(fp32_layers),
                                  **self.amp_options)

    def score(self, fp32_layers: Iterable[int]) -> float:
        key = frozenset(fp32_layers)
        if key not in self.scores:
            if len(self.scores) >= self.max_trials:
                raise _BudgetSpent
            value = self._metric(self._outputs(build(self.convert(key), self.target)))
            self.scores[key] = -math.inf if math.isnan(value) else value
            self.bar.update(1)
        return self.scores[key]


class _Search:
    """The fallback strategies over one evaluator and goal."""

    def __init__(self, evaluator: _Evaluator, layers: list[Layer], goal: float):
        self.evaluator, self.layers, self.goal = evaluator, layers, goal
        self.sensitivity: dict[int, float] = {}

    def meets(self, fp32_layers) -> bool:
        return self.evaluator.score(fp32_layers) >= self.goal

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

    def prune(self, fp32_layers: set[int]) -> set[int]:
        """Bisect the fp32 set, returning every segment to low precision that the goal allows."""
        keep, segments = set(fp32_layers), [sorted(fp32_layers)]
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
                   layer_ops: Iterable[str] = DEFAULT_LAYER_OPS, **amp_options
                   ) -> tuple[tvm.IRModule, PrecisionPlan, Report]:
    """Convert to `target_dtype` keeping the fewest layers in fp32 that hold `metric` within tolerance."""
    if strategy not in STRATEGIES:
        raise OptionError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    if not tolerance >= 0:
        raise OptionError(f"tolerance must be >= 0, got {tolerance!r}")
    started = time.perf_counter()
    batches, labels = _split(dataset, metric is not None)
    for inputs in batches:
        check_inputs(mod, inputs)
    layers = list_layers(mod, layer_ops)
    with tqdm(total=max_trials, desc="precision search", unit="eval", disable=not progress) as bar:
        evaluator = _Evaluator(mod, batches, labels, metric, target_dtype, target,
                               {"layer_ops": tuple(layer_ops), **amp_options}, max_trials, bar)
        goal = evaluator.baseline - tolerance * (abs(evaluator.baseline) if relative else 1.0)
        search = _Search(evaluator, layers, goal)
        try:
            fp32_layers, message = search.run(strategy), ""
        except _BudgetSpent:
            fp32_layers, message = _best_within(evaluator, goal), f"stopped after max_trials={max_trials}; "
    return _result(evaluator, search, layers, fp32_layers, goal, message, started)


def _best_within(evaluator: _Evaluator, goal: float) -> set[int] | None:
    passing = [key for key, value in evaluator.scores.items() if value >= goal]
    return set(min(passing, key=len)) if passing else None


def _result(evaluator, search, layers, fp32_layers, goal, message, started):
    if fp32_layers is None:
        converted = to_mixed_precision(evaluator.mod, evaluator.target_dtype, target_dtype_ops=[])
        final = evaluator.baseline
        message += (f"the goal {goal:.4f} cannot be met in {evaluator.target_dtype} even with every layer "
                    "in fp32 that was tried: returning the all-fp32 plan")
        fp32_layers, met = {layer.index for layer in layers}, False
    else:
        converted = evaluator.convert(fp32_layers)
        final = evaluator.scores[frozenset(fp32_layers)]
        message += f"goal met with {len(fp32_layers)} of {len(layers)} layers in fp32"
        met = True
    results = [LayerResult(l.index, l.op, l.name, "float32" if l.index in fp32_layers else evaluator.target_dtype,
                           search.sensitivity.get(l.index)) for l in layers]
    report = Report(evaluator.target_dtype, evaluator.baseline, goal, final, met, len(evaluator.scores),
                    time.perf_counter() - started, message, results)
    return converted, precision_plan(converted), report
