"""SinkTransposes: transposes moved past the ops that have no layout rule, until they cancel.

Relax's ConvertLayout carries a layout only through ops with a layout rule; around any other (relax.nn.pad: the
ONNX Pad of BiT's stem and of TF-ported "same" convs; leakyrelu, all of CSPNet's and DarkNet's activations, and
softplus) it transposes back to the model's layout, and the ops after it run in that layout until the next
convolution transposes again. This pass moves a transpose below each op
that computes the same values on the untransposed tensor with its axes renamed (elementwise ops, pads, group
norms, pools, strided slices, and concats of tensors all transposed alike: tf2onnx's NASNet crops and joins in
NCHW), so that the transpose back and the next one forward meet and cancel. A transpose that permutes nothing, or
only axes of extent one, becomes a view, and so does a transpose of a reshape of a transpose that leaves every
element in its order (a hierarchical ViT's tokens made an image for a conv, which ConvertLayout then transposes
to NHWC, and the image made tokens again: PVT-v2-B0's 86 transposes after layout conversion are 30).
"""

import math

import numpy as np
import tvm
from tvm import relax

from .._dead_code import remove_all_unused
from .._ir import read_counts, tensor_shape, with_attr
from ..ops import bound_call, call_op_name

UNARY = frozenset(f"relax.{name}" for name in (
    "nn.relu", "nn.leakyrelu", "nn.gelu", "nn.gelu_tanh", "nn.silu", "nn.softplus", "sigmoid", "tanh", "exp", "log",
    "erf", "sqrt", "rsqrt", "negative", "abs", "sign", "astype", "floor", "ceil", "round", "clip"))
BINARY = frozenset(f"relax.{name}" for name in (  # elementwise ops of broadcast operands: arithmetic, comparisons
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "greater", "greater_equal", "less",
    "less_equal", "equal", "not_equal", "where"))  # and where (torch.export's PReLU: where(x > 0, x, a * x))
POOLS = frozenset(("relax.nn.max_pool2d", "relax.nn.avg_pool2d"))
MAX_CHECKED_ELEMENTS = 1 << 23  # a transpose, reshape and transpose of more elements are not checked for order
# (the check moves an arange of int32 through them: 32 MB at most; a 256x256 image of 64 channels is 4M elements)


@relax.transform.function_pass(opt_level=0, name="relay_amp.SinkTransposes")
class SinkTransposes:
    """Every transpose (permute_dims) read once, by an op that computes the same on the untransposed tensor, moved
    past it (one read at a time: a transpose with another reader would stay for it, and the tensor be transposed
    twice); two transposes in a row that undo each other dropped; one that permutes nothing, or only axes of
    extent one, a view (`_as_view`). Fold constants first: a constant operand of a binary op is transposed the
    other way."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
        """`func` with its transposes sunk; the input module is left as it was."""
        sunk = _Sinker(mod, read_counts(func)).visit_expr(func)
        return remove_all_unused(sunk)


@relax.expr_functor.mutator
class _Sinker(relax.PyExprMutator):
    in_dataflow = False  # only dataflow blocks: a graph output's transpose stays where the block hands it out

    def __init__(self, mod: tvm.IRModule, reads: dict[relax.Var, int]):
        super().__init__(mod)
        self.reads = reads  # of the function's vars, which keep their names where a transpose moves past them

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        self.in_dataflow = True
        visited = super().visit_dataflow_block_(block)
        self.in_dataflow = False
        return visited

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not self.in_dataflow:
            return call
        name = call_op_name(call)
        if name == "relax.permute_dims":
            return self._cancelled(call)
        joined = name == "relax.concat" and isinstance(call.args[0], relax.Tuple)
        operands = list(call.args[0].fields) if joined else list(call.args)
        sources = [self._transposed(arg) if self.reads.get(arg) == 1 else None for arg in operands]
        found = [source for source in sources if source is not None]
        if not found or any(source[1] != found[0][1] for source in found) or (joined and len(found) < len(sources)):
            return call
        perm = found[0][1]
        moved = _moved(call, name, sources, perm)
        if moved is None:
            return call
        return relax.op.permute_dims(self.builder_.emit(moved), perm)

    def _transposed(self, expr: relax.Expr) -> "tuple[relax.Expr, list[int]] | None":
        """(x, axes) where `expr` is bound to permute_dims(x, axes) with its axes given, else None."""
        value = bound_call(self, expr, "relax.permute_dims")
        if value is None or value.attrs.axes is None:
            return None
        return value.args[0], [int(axis) for axis in value.attrs.axes]

    def _cancelled(self, call: relax.Call) -> relax.Expr:
        """The view of a transpose that permutes nothing or only axes of extent one (`_as_view`), x for
        permute_dims(permute_dims(x, p), q) where q undoes p, else the call."""
        view = _as_view(call)
        if view is not None:
            return view
        reshaped = self._reshape_between_transposes(call)
        if reshaped is not None:
            return reshaped
        inner = self._transposed(call.args[0])
        if inner is None or call.attrs.axes is None:
            return call
        source, first = inner
        second = [int(axis) for axis in call.attrs.axes]
        return source if [first[axis] for axis in second] == list(range(len(second))) else call

    def _reshape_between_transposes(self, call: relax.Call) -> "relax.Expr | None":
        """x reshaped, for permute_dims(reshape(permute_dims(x, p)), q) that keeps x's elements in their order: a
        hierarchical ViT's tokens made an image (PVT's [1, 3136, 32] transposed, split to [1, 32, 56, 56] and, by
        ConvertLayout, transposed to NHWC for its conv) or the image made tokens again, two copies that move
        nothing. None for any other transpose."""
        reshape = bound_call(self, call.args[0], "relax.reshape")
        inner = None if reshape is None else self._transposed(reshape.args[0])
        if inner is None or call.attrs.axes is None:
            return None
        (source, first), middle = inner, tensor_shape(reshape)
        if not (_static(middle) and _static(tensor_shape(source))) or math.prod(middle) > MAX_CHECKED_ELEMENTS:
            return None
        second = [int(axis) for axis in call.attrs.axes]
        order = np.arange(math.prod(middle), dtype="int32").reshape(tensor_shape(source))
        moved = np.transpose(np.transpose(order, first).reshape(middle), second)
        if not np.array_equal(moved.reshape(-1), order.reshape(-1)):
            return None
        return relax.op.reshape(source, moved.shape)


def _static(shape) -> bool:
    """Whether `shape` is known and every extent is an int."""
    return shape is not None and all(isinstance(size, int) for size in shape)


def _as_view(call: relax.Call) -> "relax.Expr | None":
    """The input of a transpose that permutes nothing (ConvertLayout leaves one where an exporter's transpose to NCHW
    meets its own back to NHWC: tf2onnx's Keras exports, 64 in MobileNetV3-Large), or its reshape where the
    transpose moves only axes of extent one (a squeeze-excite's [1, C, 1, 1] to [1, 1, 1, C]): a view, where the
    transpose copies. None for any other transpose."""
    shape = tensor_shape(call.args[0])
    if call.attrs.axes is None or not _static(shape):
        return None
    perm = [int(axis) for axis in call.attrs.axes]
    if perm == list(range(len(perm))):
        return call.args[0]
    moved = [axis for axis in perm if shape[axis] != 1]
    if moved != sorted(moved):
        return None
    return relax.op.reshape(call.args[0], [shape[axis] for axis in perm])


def _moved(call: relax.Call, name: str, sources: list, perm: list[int]) -> relax.Expr | None:
    """`call` on the untransposed tensors (`sources`: (x, perm) per transposed argument, or per operand a concat
    joins; None for the others), its axes renamed, or None where it cannot move."""
    data = sources[0][0] if sources[0] is not None else None
    if name in UNARY and data is not None:
        return relax.Call(call.op, [data, *call.args[1:]], call.attrs, call.ty_args)
    if name in BINARY:
        args = [source[0] if source is not None else _untransposed_constant(arg, perm)
                for arg, source in zip(call.args, sources)]
        return None if any(arg is None for arg in args) else relax.Call(call.op, args, call.attrs, call.ty_args)
    if name == "relax.concat":  # every operand transposed alike (`_Sinker.visit_call_`)
        return relax.op.concat([source[0] for source in sources], axis=perm[int(call.attrs.axis)])
    if data is None or any(source is not None for source in sources[1:]):
        return None
    if name == "relax.strided_slice":
        axes = [perm[int(axis)] for axis in call.args[1]]
        return relax.op.strided_slice(data, axes, *call.args[2:], assume_inbound=call.attrs.assume_inbound)
    if name == "relax.nn.pad":
        widths = [int(width) for width in call.attrs.pad_width]
        moved = [0] * len(widths)
        for axis, source_axis in enumerate(perm):
            moved[2 * source_axis:2 * source_axis + 2] = widths[2 * axis:2 * axis + 2]
        return relax.Call(call.op, [data, *call.args[1:]], with_attr(call.attrs, pad_width=moved), call.ty_args)
    if name == "relax.nn.group_norm":
        attrs = with_attr(call.attrs, channel_axis=perm[int(call.attrs.channel_axis)],
                          axes=[perm[int(axis)] for axis in call.attrs.axes])
        return relax.Call(call.op, [data, *call.args[1:]], attrs, call.ty_args)
    if name in POOLS:
        attrs = with_attr(call.attrs, layout=_renamed(call.attrs.layout, perm),
                          out_layout=_renamed(call.attrs.out_layout, perm))
        return relax.Call(call.op, [data], attrs, call.ty_args)
    return None


def _renamed(layout: str, perm: list[int]) -> str:
    """The layout of the untransposed tensor, for `layout` of its transpose by `perm`."""
    letters = [""] * len(perm)
    for axis, source_axis in enumerate(perm):
        letters[source_axis] = str(layout)[axis]
    return "".join(letters)


def _untransposed_constant(arg: relax.Expr, perm: list[int]) -> relax.Expr | None:
    """A constant operand for the untransposed tensor: a scalar as it is, a full-rank one transposed back."""
    shape = tensor_shape(arg)
    if not isinstance(arg, tvm.ir.expr.Constant) or shape is None:
        return None
    if len(shape) == 0:
        return arg
    if len(shape) != len(perm):
        return None
    inverse = [perm.index(axis) for axis in range(len(perm))]
    return relax.op.permute_dims(arg, inverse)
