"""affine: runs of fp32 scales, biases, clamps and floors by constants folded into a multiply-add, floor and clamp.

A quantized model's layers end in a requantize: the dequantizing scale, the layer's bias, its ReLU6, the next
layer's 1/step and +0.5, then floor and the clamp to the codes: nine fp32 ops, about eleven vector ops for each
16 values with the casts, where a 1x1 conv over 24 channels spends 6 `vpdpbusd` and a 3x3 depthwise conv 9 FMAs.
A clamp commutes with a multiply by a positive constant the same for every channel (its bounds are multiplied
too) and with an add of such a constant (its bounds move), and moves after a floor as the floor of its bounds, so
`FoldAffineClamps` (before kernel dispatch: the kernels' epilogues and the depthwise convs' fused functions both
gain) makes that run one multiply, one add (a fused multiply-add), floor and one clamp. Values differ from the
unfolded run's by fp32 rounding. `folded` is the algebra, over epilogue steps (`kernels.Step`) with numpy
operands.

Where such a run ends in the floor and a clamp to whole, non-negative bounds (uint8 codes) and only a cast to an
integer dtype reads it, the cast's truncation is the floor: the clamp goes before it (`truncated`), exactly, and
the floor (`vrndscaleps`, two ops on Intel's cores) goes. MobileNetV2's 1x1 expansions over 16 and 24 channels
spend 4 and 6 `vpdpbusd` on each 16 codes, their requantize about ten ops.

A run goes on through a round trip of its value to a 16-bit float and back where nothing else reads either cast
(`_carried_through_rounding`), and drops that rounding, as relay_amp.backend.cpu.bf16_round drops one held in
registers. Quantize's depthwise convs have one: AMP's bf16 fallback computes their bias and ReLU6 and the next
layer's quantize reads fp32. MobileNetV2 int8q on Emerald Rapids: its depthwise convs' write-back went from two
multiply-adds and two clamps to one of each, their calls 0.726 -> 0.617 ms in one process.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from ..._dead_code import EliminateDeadCode
from ..._folding import fold_constants
from ..._ir import (batch_norm_as_affine, clamped, get_function, read_counts, rewrite_function, rewrite_op_calls,
                     tensor_dtype, tensor_shape)
from ...dtypes import LOW_FLOAT_DTYPES
from ...ops import call_op_name
from . import formula, kernels

FLOOR = ("floor", formula.X)  # the one MAP a run folds over: a quantize's rounding
CLAMPS = ("relax.maximum", "relax.minimum")
CHAIN_OPS = ("relax.multiply", "relax.add", "relax.floor", "relax.nn.relu", *CLAMPS)


@dataclass
class _Run:
    """x * scale + bias, clamped to [low, high]: the steps seen since the last one that could not merge."""
    scale: "np.ndarray | None" = None
    bias: "np.ndarray | None" = None
    low: float = -math.inf
    high: float = math.inf

    def affine(self) -> list[tuple[kernels.Step, "np.ndarray | None"]]:
        """The run's multiply-add as steps with their operands."""
        steps = []
        if self.scale is not None:
            steps.append((kernels.Step(kernels.SCALE), self.scale))
        if self.bias is not None:
            steps.append((kernels.Step(kernels.BIAS), self.bias))
        return steps

    def clamp(self) -> list[tuple[kernels.Step, None]]:
        """The run's clamp as a step, or none."""
        if self.low == -math.inf and self.high == math.inf:
            return []
        return [(kernels.Step(kernels.CLIP, self.low, self.high), None)]


def folded(steps: list, operands: list) -> tuple[list, list]:
    """`steps` and their `operands` (arrays of values for SCALE and BIAS) with every run of scales, biases and
    clamps merged into a multiply-add and one clamp, the clamp moved after a floor."""
    pending = iter(operands)
    out: list[tuple[kernels.Step, "np.ndarray | None"]] = []
    run = _Run()
    for step in steps:
        operand = next(pending) if step.kind in kernels.TAKES_OPERAND else None
        if _merged(run, step, operand):
            continue
        if step.kind == kernels.MAP and step.formula == FLOOR:  # floor(clamp(y, lo, hi)) = clamp(floor(y), ...)
            out.extend([*run.affine(), (step, None)])
            run = _Run(low=float(np.floor(run.low)), high=float(np.floor(run.high)))
            continue
        out.extend(run.affine() + run.clamp())
        run = _Run()
        if not _merged(run, step, operand):
            out.append((step, operand))
    out.extend(run.affine() + run.clamp())
    return [step for step, _ in out], [operand for _, operand in out if operand is not None]


def truncated(steps: list) -> list:
    """`steps` without their floor where they end in it and a clamp to whole bounds of which the lower is not
    negative: on values clamped there, the truncation of a cast to an integer dtype is the floor."""
    if len(steps) < 2 or steps[-2].kind != kernels.MAP or steps[-2].formula != FLOOR:
        return steps
    clamp = steps[-1]
    whole = all(math.isfinite(bound) and float(bound).is_integer() for bound in (clamp.low, clamp.high))
    return [*steps[:-2], clamp] if clamp.kind == kernels.CLIP and whole and clamp.low >= 0 else steps


def _uniform(values: np.ndarray) -> bool:
    """Whether every channel has the same value."""
    return bool(np.all(values == values.flat[0]))


def _merged(run: _Run, step: kernels.Step, operand: "np.ndarray | None") -> bool:
    """Merge `step` into `run` where that is exact; False (run unchanged) where it is not."""
    if step.kind == kernels.CLIP:
        low, high = max(run.low, step.low), min(run.high, step.high)
        if low > high:
            return False
        run.low, run.high = low, high
        return True
    if step.kind not in (kernels.SCALE, kernels.BIAS):
        return False
    values = np.asarray(operand, "float64")
    clamped_run = run.low > -math.inf or run.high < math.inf
    if step.kind == kernels.SCALE:
        if clamped_run and not (_uniform(values) and values.flat[0] > 0):
            return False
        run.scale = values if run.scale is None else run.scale * values
        run.bias = None if run.bias is None else run.bias * values
        if clamped_run:
            run.low, run.high = run.low * values.flat[0], run.high * values.flat[0]
        return True
    if clamped_run and not _uniform(values):
        return False
    run.bias = values if run.bias is None else run.bias + values
    if clamped_run:
        run.low, run.high = run.low + values.flat[0], run.high + values.flat[0]
    return True


@dataclass
class _OpRun:
    """A run of single-use fp32 ops that fold: the value it starts from, its steps and their bindings."""
    source: relax.Expr
    steps: list = field(default_factory=list)  # (kernels.Step, operand values or None)
    vars: list = field(default_factory=list)  # the vars the run binds, the last one its result
    axis: "int | None" = None  # the axis of its per-channel operands

    def folded(self, cast_to_integer: bool) -> tuple[list, list]:
        """The run's steps and operands, folded, and `truncated` where only a cast to an integer dtype reads it."""
        operands = [values for _, values in self.steps if values is not None]
        steps, operands = folded([step for step, _ in self.steps], operands)
        return (truncated(steps) if cast_to_integer else steps), operands


def _channel_operand(expr: relax.Expr, shape: tuple) -> "tuple[np.ndarray, int | None] | None":
    """An fp32 constant that broadcasts to `shape` along at most one axis: its values and that axis (None for a
    scalar), else None."""
    if not isinstance(expr, tvm.ir.expr.Constant) or tensor_dtype(expr) != kernels.WIDE:
        return None
    values = expr.value.numpy()
    if values.ndim > len(shape):
        return None
    aligned = (1,) * (len(shape) - values.ndim) + values.shape
    axes = [axis for axis, size in enumerate(aligned) if size != 1]
    if not axes:
        return values.reshape(1), None
    if len(axes) > 1 or aligned[axes[0]] != shape[axes[0]]:
        return None
    return values.reshape(-1), axes[0]


def _as_step(call: relax.Expr, shape: tuple) -> "tuple | None":
    """((step, operand values or None, their axis), data) for an fp32 op a run folds: a multiply or add by a
    constant along at most one axis, maximum or minimum by a scalar, ReLU, floor. None for any other."""
    name = call_op_name(call)
    if name not in CHAIN_OPS or tensor_dtype(call) != kernels.WIDE:
        return None
    if name in ("relax.floor", "relax.nn.relu"):
        step = kernels.Step(kernels.MAP, formula=FLOOR) if name == "relax.floor" else kernels.Step(kernels.CLIP, 0.0)
        return (step, None, None), call.args[0]
    data, other = call.args
    if isinstance(data, tvm.ir.expr.Constant):
        data, other = other, data
    operand = _channel_operand(other, shape)
    if operand is None or (name in CLAMPS and operand[1] is not None):
        return None
    values, axis = operand
    if name == "relax.maximum":
        return (kernels.Step(kernels.CLIP, low=float(values[0])), None, None), data
    if name == "relax.minimum":
        return (kernels.Step(kernels.CLIP, high=float(values[0])), None, None), data
    return (kernels.Step(kernels.SCALE if name == "relax.multiply" else kernels.BIAS), values, axis), data


def _chains(func: relax.Function) -> list[tuple[_OpRun, tuple[list, list]]]:
    """The runs of single-use fp32 ops of `func` that fold to fewer ops, each with its folded steps and operands,
    in binding order."""
    uses = read_counts(func)
    open_runs: dict[relax.Var, _OpRun] = {}  # the run each var ends, while nothing else has read it
    narrowed: dict[relax.Var, _OpRun] = {}  # a run's result cast to a 16-bit float, while nothing has read it
    runs = []
    for block in func.body.blocks:
        for binding in block.bindings:
            if _carried_through_rounding(binding, open_runs, narrowed, uses):
                continue
            shape = tensor_shape(binding.var)
            found = None if shape is None else _as_step(binding.value, shape)
            if found is None:
                continue
            (step, values, axis), data = found
            run = open_runs.pop(data, None) if isinstance(data, relax.DataflowVar) and uses.get(data) == 1 else None
            if run is None or (None not in (axis, run.axis) and axis != run.axis):  # one channel axis per run
                run = _OpRun(data)
                runs.append(run)
            run.steps.append((step, values))
            run.vars.append(binding.var)
            run.axis = run.axis if axis is None else axis
            open_runs[binding.var] = run
    cast = _cast_to_integer(func, uses)
    with_folds = [(run, run.folded(run.vars[-1] in cast)) for run in runs]
    return [(run, fold) for run, fold in with_folds if 0 < len(fold[0]) < len(run.steps)]


def _carried_through_rounding(binding: relax.VarBinding, open_runs: dict, narrowed: dict, uses: dict) -> bool:
    """Carry an open run through `binding` where it is half of a round trip of the run's result through a 16-bit
    float, each cast read once (AMP's fallback ops between two int8 layers): the fold drops that rounding, as
    relay_amp.backend.cpu.bf16_round drops a round trip held in registers. False where `binding` is no such half."""
    value = binding.value
    if call_op_name(value) != "relax.astype" or not all(
            isinstance(var, relax.DataflowVar) and uses.get(var) == 1 for var in (value.args[0], binding.var)):
        return False
    source, dtype = value.args[0], str(value.attrs.dtype)
    if dtype in LOW_FLOAT_DTYPES and source in open_runs:
        narrowed[binding.var] = open_runs.pop(source)
        return True
    if dtype == kernels.WIDE and source in narrowed:
        run = narrowed.pop(source)
        run.vars.extend([source, binding.var])
        open_runs[binding.var] = run
        return True
    return False


def _cast_to_integer(func: relax.Function, uses: dict) -> set:
    """The vars of `func` whose only reader is a cast to an integer dtype."""
    return {binding.value.args[0] for block in func.body.blocks for binding in block.bindings
            if call_op_name(binding.value) == "relax.astype" and isinstance(binding.value.args[0], relax.Var)
            and uses.get(binding.value.args[0]) == 1 and tvm.DataType(str(binding.value.attrs.dtype)).type_code
            in (tvm.DataTypeCode.INT, tvm.DataTypeCode.UINT)}


def _emitted(builder: relax.BlockBuilder, value: relax.Expr, run: _OpRun, fold: tuple[list, list],
             leaves_block: bool) -> relax.Var:
    """Emit the `fold` of `run` from `value`; the var of its result (an output of the block where `leaves_block`)."""
    steps, operands = fold
    rank, operands = len(tensor_shape(run.vars[-1])), iter(operands)
    expr = value
    for number, step in enumerate(steps):
        data = builder.emit(expr) if number else expr
        if step.kind == kernels.MAP:
            expr = relax.op.floor(data)
        elif step.kind == kernels.CLIP:
            expr = clamped(builder, data, step.low, step.high)
        else:
            op = relax.op.multiply if step.kind == kernels.SCALE else relax.op.add
            expr = op(data, _broadcast(next(operands), run.axis, rank))
    return builder.emit_output(expr) if leaves_block else builder.emit(expr)


def _broadcast(values: np.ndarray, axis: "int | None", rank: int) -> relax.Expr:
    """Per-channel `values` as a constant that broadcasts along `axis` of a rank-`rank` tensor; a scalar where they
    are all one value."""
    if _uniform(values):
        return relax.const(float(values.flat[0]), kernels.WIDE)
    shape = [1] * rank
    shape[axis] = -1
    return relax.const(values.astype(kernels.WIDE).reshape(shape))


@relax.expr_functor.mutator
class _Folder(relax.PyExprMutator):
    """Binds each folding run's result to its folded ops and drops the run's other bindings."""

    def __init__(self, mod: tvm.IRModule, runs: list[tuple[_OpRun, tuple[list, list]]]):
        super().__init__(mod)
        self.run_of = {run.vars[-1]: (run, fold) for run, fold in runs}
        self.dropped = {var for run, _ in runs for var in run.vars[:-1]}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.dropped:
            return
        if binding.var not in self.run_of:
            super().visit_var_binding_(binding)
            return
        run, fold = self.run_of[binding.var]
        leaves_block = self.builder_.current_block_is_dataflow() and not isinstance(binding.var, relax.DataflowVar)
        self.set_var_remap(binding.var, _emitted(self.builder_, self.visit_expr(run.source), run, fold, leaves_block))


@tvm.transform.module_pass(opt_level=0, name="relay_amp.BatchNormsAsAffine")
class BatchNormsAsAffine:
    """Each inference batch norm left unfolded (no conv before it: DenseNet's after its concats, a pre-activation
    net's, a QDQ file's after a dequantize) as x * scale + shift (`batch_norm_scale_shift`), so that it joins the
    runs FoldAffineClamps folds, where TVM's legalization divides every value by sqrt(var + eps)."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        rewritten = rewrite_op_calls(mod, self.func, {"relax.nn.batch_norm": _as_affine})
        return EliminateDeadCode([self.func])(relax.transform.CanonicalizeBindings()(rewritten))


def _as_affine(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    """`batch_norm_as_affine(call)` where it normalizes a static rank tensor by constant statistics; else None."""
    data, *stats = call.args
    if call.attrs.training or tensor_shape(data) is None or not all(isinstance(s, tvm.ir.expr.Constant) for s in stats):
        return None
    return batch_norm_as_affine(call)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.FoldAffineClamps")
class FoldAffineClamps:
    """Fold each run of fp32 scales, biases, clamps and floors by constants into a multiply-add, floor and clamp."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod` (constants behind layout changes folded first); the input module is left as it
        was."""
        mod = fold_constants(mod)
        runs = _chains(get_function(mod, self.func))
        return rewrite_function(_Folder(mod, runs), mod, self.func) if runs else mod
