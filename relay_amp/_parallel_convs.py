"""Parallel convolutions of one tensor, summed, as one convolution: structural reparameterization at import.

Models trained with parallel branches (RepVGG, MobileOne, FastViT, RepViT, RepGhost: a kxk conv, a 1x1 conv, a
batch norm of the input itself, their sum) are meant to be merged into one conv before inference; exported
without that step, each branch is a conv of its own. The sum of constant-weight convs of one input (with one
stride and one grouping, their windows aligned), per-channel scales and shifts of them, and the input itself
(an identity kernel) is one conv whose kernel is the branches' kernels added in place.
"""

from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import relax

from ._ir import (batch_norm_scale_shift, channel_values, read_counts, rewrite_each_function, tensor_dtype,
                  tensor_shape)
from .ops import call_op_name


@dataclass(frozen=True)
class Window:
    """One spatial axis of a conv: the padding before, the kernel's extent, the padding after."""

    before: int
    extent: int
    after: int

    @property
    def end(self) -> int:
        """Where the window ends past its first output's input position, less one: equal for aligned windows."""
        return self.after - self.extent + self.before


IDENTITY_WINDOW = Window(0, 1, 0)


@dataclass(frozen=True)
class Branches:
    """A tensor as `weight` convolved with `source` (None: no conv yet) plus `diagonal` times `source` (None: no
    identity term) plus `bias`, per output channel; `terms` counts the convs and identities summed."""

    source: relax.Var
    weight: "np.ndarray | None"  # [O, I / groups, kh, kw], float64
    diagonal: "np.ndarray | None"  # [C]
    bias: np.ndarray  # [O]
    groups: int = 1
    strides: tuple = (1, 1)
    windows: tuple = (IDENTITY_WINDOW, IDENTITY_WINDOW)
    terms: int = 1

    def scaled(self, scale: np.ndarray) -> "Branches":
        """These branches times a per-output-channel `scale`."""
        weight = None if self.weight is None else self.weight * scale[:, None, None, None]
        diagonal = None if self.diagonal is None else self.diagonal * scale
        return replace(self, weight=weight, diagonal=diagonal, bias=self.bias * scale)

    def shifted(self, shift: np.ndarray) -> "Branches":
        """These branches plus a per-output-channel `shift`."""
        return replace(self, bias=self.bias + shift)


def merge_parallel_convs(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with every sum of two or more fp32 NCHW convs of one tensor by constant weights (and per-channel scales,
    shifts and inference batch norms of them or of the tensor itself) as one conv and a bias add."""
    return rewrite_each_function(mod, _BranchMerger)


@relax.expr_functor.mutator
class _BranchMerger(relax.PyExprMutator):
    """Rewrites each binding whose value is two or more merged branches as one conv plus its bias."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        super().__init__(mod)
        self.reads = read_counts(func)
        self.value_of = relax.analysis.get_var2val(func)
        self.readings: dict[relax.Var, list[Branches]] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        readings = []
        if tensor_dtype(binding.var) == "float32" and tensor_shape(binding.var) is not None:
            readings = _readings_of(binding.value, self._operand, self.value_of)
        self.readings[binding.var] = readings
        merged = next((b for b in readings if b.terms > 1 and b.weight is not None), None)
        if merged is None:
            super().visit_var_binding_(binding)
            return
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(self._merged(merged)))

    def _operand(self, expr: relax.Expr) -> list[Branches]:
        """The readings of an operand as branches: its own where only this consumer reads it or they have no conv
        (a scale and shift of their source costs nothing merged into a conv), then the operand itself as an
        identity branch of a 4-d fp32 tensor."""
        if not isinstance(expr, relax.Var):
            return []
        own = [b for b in self.readings.get(expr, []) if self.reads.get(expr, 0) == 1 or b.weight is None]
        channels = _channels(expr)
        return own if channels is None else own + [Branches(expr, None, np.ones(channels), np.zeros(channels))]

    def _merged(self, branches: Branches) -> relax.Expr:
        """One conv of the branches' source and its bias add, emitted but the add."""
        weight = _with_diagonal(branches)
        (top, height), (left, width) = ((w.before, w.after) for w in branches.windows)
        conv = self.builder_.emit(relax.op.nn.conv2d(
            self.visit_expr(branches.source), relax.const(weight.astype("float32")), strides=branches.strides,
            padding=[top, left, height, width], groups=branches.groups))
        return relax.op.add(conv, relax.const(branches.bias.reshape(1, -1, 1, 1).astype("float32")))


def _readings_of(value: relax.Expr, operand, value_of: dict) -> list[Branches]:
    """The ways `value` is branches of one source (at most one a source), from its operands' readings (`operand`
    of an expression): a tensor that is a scale of another is an identity branch of either."""
    if isinstance(value, relax.TupleGetItem):
        return _batch_norm_readings(value, operand, value_of)
    if not isinstance(value, relax.Call):
        return []
    name = call_op_name(value)
    if name == "relax.nn.conv2d":
        conv = _conv_branches(value)
        return [] if conv is None else [conv]
    if name in ("relax.add", "relax.subtract"):
        return _sum_readings(value, operand, negate=name == "relax.subtract")
    if name in ("relax.multiply", "relax.divide"):
        return _scaled_readings(value, operand, invert=name == "relax.divide")
    return []


def _conv_branches(call: relax.Call) -> "Branches | None":
    """An fp32 NCHW/OIHW conv of a variable by a constant weight, undilated, as one branch."""
    data, weight = call.args
    attrs = call.attrs
    if (not isinstance(data, relax.Var) or not isinstance(weight, tvm.ir.expr.Constant)
            or tensor_dtype(data) != "float32" or weight.value.dtype != "float32"
            or attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW" or attrs.out_layout != "NCHW"
            or any(int(d) != 1 for d in attrs.dilation)):
        return None
    kernel = weight.value.numpy().astype("float64")
    top, left, bottom, right = (int(p) for p in attrs.padding)
    windows = (Window(top, kernel.shape[2], bottom), Window(left, kernel.shape[3], right))
    return Branches(data, kernel, None, np.zeros(kernel.shape[0]), int(attrs.groups),
                    tuple(int(s) for s in attrs.strides), windows)


def _batch_norm_readings(item: relax.TupleGetItem, operand, value_of: dict) -> list[Branches]:
    """The normalized output of an inference batch norm over axis 1 with constant parameters, as its input's
    readings scaled and shifted per channel."""
    norm = value_of.get(item.tuple_value)
    if item.index != 0 or call_op_name(norm) != "relax.nn.batch_norm" or int(norm.attrs.axis) != 1 \
            or getattr(norm.attrs, "training", False):
        return []
    stats = [_constant(arg) for arg in norm.args[1:]]
    if any(stat is None or stat.ndim != 1 for stat in stats):
        return []
    scale, shift = batch_norm_scale_shift(norm.attrs, *stats)
    return [data.scaled(scale).shifted(shift) for data in operand(norm.args[0])]


def _sum_readings(call: relax.Call, operand, negate: bool) -> list[Branches]:
    """a + b or a - b: two readings of one source merged (the first pair that merges, for each source), or a
    reading shifted by a per-channel constant."""
    first, second = call.args
    sign = -1.0 if negate else 1.0
    channels = _channels(call)
    if channels is None:
        return []
    for branch_arg, const_arg, const_sign in ((first, second, sign), (second, first, 1.0)):
        shift = _per_channel(const_arg, channels)
        if shift is not None:
            flip = np.ones(channels) if branch_arg is first else np.full(channels, sign)
            return [b.scaled(flip).shifted(const_sign * shift) for b in operand(branch_arg)]
    if tensor_shape(first) != tensor_shape(second):
        return []  # a broadcast
    merged: dict[relax.Var, Branches] = {}
    for left in operand(first):
        for right in operand(second):
            total = _added(left, right.scaled(np.full(channels, sign)))
            if total is not None and total.source not in merged:
                merged[total.source] = total
    return list(merged.values())


def _scaled_readings(call: relax.Call, operand, invert: bool) -> list[Branches]:
    """a * c, c * a or a / c with a per-channel constant c."""
    channels = _channels(call)
    if channels is None:
        return []
    pairs = [(call.args[0], call.args[1])] if invert else [(call.args[0], call.args[1]), (call.args[1], call.args[0])]
    for branch_arg, const_arg in pairs:
        scale = _per_channel(const_arg, channels)
        if scale is not None and (not invert or np.all(scale != 0)):
            return [b.scaled(1.0 / scale if invert else scale) for b in operand(branch_arg)]
    return []


def _added(left: Branches, right: Branches) -> "Branches | None":
    """The sum of two branch sets of one source, or None where their convs cannot be one conv."""
    if not left.source.same_as(right.source):
        return None
    convs = [b for b in (left, right) if b.weight is not None]
    if len({(b.groups, b.strides, b.weight.shape[0]) for b in convs}) > 1:
        return None
    if convs and any(b.diagonal is not None for b in (left, right)) and convs[0].strides != (1, 1):
        return None
    windows = tuple(_merged_window(left.windows[axis], right.windows[axis]) for axis in (0, 1))
    if None in windows or not _smaller(windows, left, right):
        return None
    diagonal = _sum_or_none(left.diagonal, right.diagonal)
    base = convs[0] if convs else left
    merged = replace(base, weight=None, diagonal=diagonal, bias=left.bias + right.bias, windows=windows,
                     terms=left.terms + right.terms)
    weight = None
    for branches in convs:
        weight = _placed(branches, merged, weight)
    return replace(merged, weight=weight)


def _merged_window(first: Window, second: Window) -> "Window | None":
    """The window covering two aligned windows of one axis, or None where they end apart (different outputs)."""
    if first.end != second.end:
        return None
    before = max(first.before, second.before)
    past = max(first.extent - first.before, second.extent - second.before)
    return Window(before, before + past, first.end + past)


def _smaller(windows: tuple, left: Branches, right: Branches) -> bool:
    """Whether one kernel over `windows` reads no more taps than the two branch sets' kernels together."""
    def taps(b: Branches) -> int:
        return b.windows[0].extent * b.windows[1].extent
    return windows[0].extent * windows[1].extent <= taps(left) + taps(right)


def _placed(branches: Branches, merged: Branches, weight: "np.ndarray | None") -> np.ndarray:
    """`weight` (zeros of the merged kernel's shape when None) plus `branches`' kernel at its offset in it."""
    kernel = branches.weight
    if weight is None:
        weight = np.zeros(kernel.shape[:2] + tuple(w.extent for w in merged.windows))
    rows = merged.windows[0].before - branches.windows[0].before
    cols = merged.windows[1].before - branches.windows[1].before
    weight[:, :, rows:rows + kernel.shape[2], cols:cols + kernel.shape[3]] += kernel
    return weight


def _with_diagonal(branches: Branches) -> np.ndarray:
    """The branches' kernel with their identity term added at its centre tap (grouped as the kernel is)."""
    weight = branches.weight.copy()
    if branches.diagonal is not None:
        per_group = weight.shape[1]
        channels = np.arange(weight.shape[0])
        weight[channels, channels % per_group, branches.windows[0].before, branches.windows[1].before] += \
            branches.diagonal
    return weight


def _sum_or_none(first: "np.ndarray | None", second: "np.ndarray | None") -> "np.ndarray | None":
    """The sum of two optional arrays (None where both are None)."""
    if first is None or second is None:
        return second if first is None else first
    return first + second


def _channels(expr: relax.Expr) -> "int | None":
    """The channel count of a 4-d fp32 NCHW tensor expression, None for any other."""
    shape = tensor_shape(expr)
    if tensor_dtype(expr) != "float32" or shape is None or len(shape) != 4 or not isinstance(shape[1], int):
        return None
    return shape[1]


def _per_channel(expr: relax.Expr, channels: int) -> "np.ndarray | None":
    """A constant broadcast over [1, channels, H, W] one value per channel, as [channels] float64, else None."""
    value = _constant(expr)
    return None if value is None else channel_values(value, (1, channels, 1, 1))


def _constant(expr: relax.Expr) -> "np.ndarray | None":
    """A float32 constant's values as float64, else None."""
    if not isinstance(expr, tvm.ir.expr.Constant) or expr.value.dtype != "float32":
        return None
    return expr.value.numpy().astype("float64")
