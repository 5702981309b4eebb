"""Convolutions of a split's parts, concatenated back in order, as one grouped convolution.

timm's MixedConv2d (MixNet's grouped pointwise layers) splits a tensor's channels into equal parts, convolves each
part by a weight of its own and concatenates the results: one convolution with a group per part computes the
same. Run as written, it is a split, one kernel per part (each quantizing its own part, in int8) and a
concatenation; as one grouped convolution, one kernel reads the tensor once and writes the result whole.
Branches with different kernels (MixNet's depthwise layers: 3x3, 5x5 and 7x7 parts) stay as they are.
"""

from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ._ir import channel_values, read_counts, rewrite_each_function, tensor_shape, with_attr
from .ops import call_op_name

CONVOLUTIONS = ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d")


@dataclass(frozen=True)
class Branch:
    """One part's convolution and the per-channel constant added to its result (None: no bias)."""

    conv: relax.Call
    bias: "np.ndarray | None"


def split_convs_grouped(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with every concatenation of convolutions of a split's parts, in order (each with an optional bias add,
    one kernel shape and one set of attributes), as one grouped convolution of the split's input and a bias add."""
    return rewrite_each_function(mod, _SplitConvGrouper)


@relax.expr_functor.mutator
class _SplitConvGrouper(relax.PyExprMutator):
    """Rewrites each concatenation of a split's convolved parts as one grouped convolution and its bias add."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        super().__init__(mod)
        self.reads = read_counts(func)
        self.value_of = relax.analysis.get_var2val(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        found = self._grouped(binding.value) if call_op_name(binding.value) == "relax.concat" else None
        if found is None:
            super().visit_var_binding_(binding)
            return
        source, branches = found
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(self._grouped_conv(source, branches)))

    def _grouped(self, concat: relax.Call) -> "tuple[relax.Expr, list[Branch]] | None":
        """The split's input and the branches a concatenation joins, where they are one grouped convolution."""
        parts = concat.args[0]
        if not isinstance(parts, relax.Tuple) or len(parts.fields) < 2:
            return None
        branches = [self._branch(part) for part in parts.fields]
        if None in branches or not _alike([branch.conv for branch in branches]):
            return None
        items = [self._split_item(branch.conv.args[0]) for branch in branches]
        if None in items:
            return None
        split_var = items[0][0]
        in_order = all(var.same_as(split_var) and index == position for position, (var, index) in enumerate(items))
        split = self.value_of[split_var]
        if not in_order or len(split.ty.fields) != len(branches) or self.reads.get(split_var, 0) != len(branches):
            return None
        return (split.args[0], branches) if _joins_channels(split, concat, branches[0].conv) else None

    def _branch(self, part: relax.Expr) -> "Branch | None":
        """A concatenated part as a convolution by a constant weight with its optional per-channel bias, where
        nothing else reads the convolution or the sum."""
        value, bias = self._only_read_value(part), None
        if call_op_name(value) == "relax.add":
            first, second = value.args
            conv_arg, bias = (first, second) if isinstance(second, tvm.ir.expr.Constant) else (second, first)
            value = self._only_read_value(conv_arg)
        if call_op_name(value) not in CONVOLUTIONS or not isinstance(value.args[1], tvm.ir.expr.Constant):
            return None
        if bias is None:
            return Branch(value, None)
        per_channel = _per_channel(bias, value)
        return None if per_channel is None else Branch(value, per_channel)

    def _only_read_value(self, expr: relax.Expr) -> "relax.Expr | None":
        """The value bound to a var read once (by the expression being matched), else None."""
        if not isinstance(expr, relax.Var) or self.reads.get(expr, 0) != 1:
            return None
        return self.value_of.get(expr)

    def _split_item(self, data: relax.Expr) -> "tuple[relax.Var, int] | None":
        """(split var, index) where a convolution's input is a part of a split that only it reads."""
        item = self._only_read_value(data)
        if not isinstance(item, relax.TupleGetItem) or not isinstance(item.tuple_value, relax.Var):
            return None
        if call_op_name(self.value_of.get(item.tuple_value)) != "relax.split":
            return None
        return item.tuple_value, int(item.index)

    def _grouped_conv(self, source: relax.Expr, branches: list[Branch]) -> relax.Expr:
        """One convolution with each branch's groups in turn, and its branches' biases added, emitted but the add."""
        first = branches[0].conv
        out_axis = str(first.attrs.kernel_layout).index("O")
        weight = np.concatenate([b.conv.args[1].value.numpy() for b in branches], axis=out_axis)
        attrs = with_attr(first.attrs, groups=int(first.attrs.groups) * len(branches))
        conv = relax.Call(first.op, [self.visit_expr(source), relax.const(weight)], attrs)
        if all(b.bias is None for b in branches):
            return conv
        out_channels = weight.shape[out_axis] // len(branches)
        bias = np.concatenate([np.zeros(out_channels, weight.dtype) if b.bias is None else b.bias for b in branches])
        shape = [1] * len(tensor_shape(first))
        shape[_channel_axis(first)] = -1
        return relax.op.add(self.builder_.emit(conv), relax.const(bias.reshape(shape).astype(weight.dtype)))


def _channel_axis(conv: relax.Call) -> int:
    """The channel axis of a convolution's result."""
    return str(conv.attrs.out_layout or conv.attrs.data_layout).index("C")


def _alike(convs: list[relax.Call]) -> bool:
    """Whether convolutions have one op, one set of attributes and one weight shape."""
    first = convs[0]
    return all(conv.op.same_as(first.op) and tvm_ffi.structural_equal(conv.attrs, first.attrs)
               and tensor_shape(conv.args[1]) == tensor_shape(first.args[1]) for conv in convs)


def _joins_channels(split: relax.Call, concat: relax.Call, conv: relax.Call) -> bool:
    """Whether the split cuts its input's channels and the concatenation joins the results' channels, in plain
    (unblocked) layouts. (Alike convolutions read parts of one width: the split's parts are equal.)"""
    layouts = [str(conv.attrs.data_layout), str(conv.attrs.out_layout or conv.attrs.data_layout)]
    rank = len(tensor_shape(conv))
    return (all(layout.isupper() for layout in layouts) and int(split.attrs.axis) % rank == layouts[0].index("C")
            and int(concat.attrs.axis) % rank == layouts[1].index("C"))


def _per_channel(bias: relax.Expr, conv: relax.Call) -> "np.ndarray | None":
    """A constant added to a convolution's result as one value per output channel, else None (a constant that
    varies along another axis, or broadcasts the result)."""
    if not isinstance(bias, tvm.ir.expr.Constant):
        return None
    target = [1] * len(tensor_shape(conv))
    target[_channel_axis(conv)] = tensor_shape(conv)[_channel_axis(conv)]
    return channel_values(bias.value.numpy(), target)
