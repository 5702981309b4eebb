"""affine: an epilogue's scales and biases merged into one multiply-add, its clamps moved after them.

A quantized model's conv ends in a requantize: the dequantizing scale, the layer's bias, its ReLU6, the next
layer's 1/step and +0.5, then floor and the clamp to the codes (SCALE, BIAS, CLIP, CLIP, SCALE, BIAS, MAP), about
eleven vector ops for each 16 values with the casts, where a 1x1 conv over 24 channels spends 6 `vpdpbusd`. A
clamp commutes with a multiply by a positive constant the same for every channel (its bounds are multiplied too)
and with an add of such a constant (its bounds move), and a monotone MAP (floor, then a clamp to the codes) takes
it as a clamp of its bounds' images, which the MAP's own clamp makes redundant. So that chain becomes SCALE,
BIAS, MAP: one fused multiply-add, floor, two clamps. Values differ from the unfolded chain's by fp32 rounding.
"""

import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from . import kernels

MONOTONE = ("floor", "maximum", "minimum")  # a MAP of these over x and constants never decreases


@dataclass
class _Run:
    """x * scale + bias, clamped to [low, high]: the steps seen since the last one that could not merge."""
    scale: "np.ndarray | None" = None
    bias: "np.ndarray | None" = None
    low: float = -math.inf
    high: float = math.inf

    def affine(self) -> list[tuple[kernels.Step, "relax.Expr | None"]]:
        """The run's multiply-add as steps with their operands."""
        steps = []
        if self.scale is not None:
            steps.append((kernels.Step(kernels.SCALE), relax.const(self.scale.astype("float32"))))
        if self.bias is not None:
            steps.append((kernels.Step(kernels.BIAS), relax.const(self.bias.astype("float32"))))
        return steps

    def clamp(self) -> list[tuple[kernels.Step, None]]:
        """The run's clamp as a step, or none."""
        if self.low == -math.inf and self.high == math.inf:
            return []
        return [(kernels.Step(kernels.CLIP, self.low, self.high), None)]


def folded(steps: list, operands: list) -> tuple[list, list]:
    """`steps` and their `operands` (constants for SCALE and BIAS) with every run of scales, biases and clamps
    merged into a multiply-add and one clamp, the clamp moved into a monotone MAP after it where it can."""
    pending = iter(operands)
    out: list[tuple[kernels.Step, "relax.Expr | None"]] = []
    run = _Run()
    for step in steps:
        operand = next(pending) if step.kind in kernels.TAKES_OPERAND else None
        if _merged(run, step, operand):
            continue
        if step.kind == kernels.MAP and _monotone(step.formula):
            out.extend([*run.affine(), (step, None)])
            run = _mapped_clamp(run, step.formula)
            continue
        out.extend(run.affine() + run.clamp())
        run = _Run()
        if not _merged(run, step, operand):
            out.append((step, operand))
    out.extend(run.affine() + run.clamp())
    return [step for step, _ in out], [operand for _, operand in out if operand is not None]


def _merged(run: _Run, step: kernels.Step, operand: "relax.Expr | None") -> bool:
    """Merge `step` into `run` where that is exact; False (run unchanged) where it is not."""
    if step.kind == kernels.CLIP:
        low, high = max(run.low, step.low), min(run.high, step.high)
        if low > high:
            return False
        run.low, run.high = low, high
        return True
    if step.kind not in (kernels.SCALE, kernels.BIAS) or not isinstance(operand, tvm.ir.expr.Constant):
        return False
    values = operand.value.numpy().astype("float64")
    clamped = run.low > -math.inf or run.high < math.inf
    uniform = bool(np.all(values == values.flat[0]))
    if step.kind == kernels.SCALE:
        if clamped and not (uniform and values.flat[0] > 0):
            return False
        run.scale = values if run.scale is None else run.scale * values
        run.bias = None if run.bias is None else run.bias * values
        if clamped:
            run.low, run.high = run.low * values.flat[0], run.high * values.flat[0]
        return True
    if clamped and not uniform:
        return False
    run.bias = values if run.bias is None else run.bias + values
    if clamped:
        run.low, run.high = run.low + values.flat[0], run.high + values.flat[0]
    return True


def _monotone(formula: tuple) -> bool:
    """Whether `formula` is floor, maximum and minimum over x and constants: nondecreasing in x."""
    kind, *operands = formula
    if kind in ("x", "const"):
        return True
    return kind in MONOTONE and all(_monotone(operand) for operand in operands)


def _mapped_clamp(run: _Run, formula: tuple) -> _Run:
    """The clamp of `run` after the monotone `formula`: f(clamp(y, lo, hi)) = clamp(f(y), f(lo), f(hi)), none
    where f's own range is no wider."""
    low, high = _value(formula, run.low), _value(formula, run.high)
    if low <= _value(formula, -math.inf) and high >= _value(formula, math.inf):
        return _Run()
    return _Run(low=low, high=high)


def _value(formula: tuple, x: float) -> float:
    """`formula` at x (floor, maximum, minimum over x and constants)."""
    kind, *operands = formula
    if kind == "x":
        return x
    if kind == "const":
        return operands[0]
    values = [_value(operand, x) for operand in operands]
    if kind == "floor":
        return float(np.floor(values[0]))
    return max(values) if kind == "maximum" else min(values)
