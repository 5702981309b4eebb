"""SinkTransposes: transposes moved past the ops that have no layout rule, until they cancel.

Relax's ConvertLayout carries a layout only through ops with a layout rule; around any other (relax.nn.pad: the ONNX
Pad of BiT's stem and of TF-ported "same" convs; leakyrelu, all of CSPNet's and DarkNet's activations, and softplus)
it transposes back to the model's layout, and the ops after it run in that layout until the next convolution
transposes again. This pass moves a transpose below each op that computes the same values on the untransposed tensor
with its axes renamed (every elementwise op: audio codecs' Snake, x + sin(a x)^2 / a, too; also of an untransposed
operand whose axes past extent one keep their order, read back as a view: a squeeze-excite's [1, C, 1, 1] gate; pads;
group norms; pools; reductions, the axes one drops renumbered in the transpose left: ResNeSt's sum over its radix;
expand_dims; strided slices; concats of tensors all transposed alike: tf2onnx's NASNet crops and joins in NCHW), so
that the transpose back and the next one forward meet and cancel (HGNetV2's head transposed its last feature map to
NCHW to average it: now the mean's one pixel is transposed). Past a reshape too (a squeeze is one: a 1-D transposed
conv's output, a conv2d of height one, squeezed back to NCW), where it only merges or splits runs of axes that keep
their order (an NHWC conv's heads flattened in NCHW to [heads, channels, pixels]: x is flattened and the runs
transposed), or that merges axes lying together in x in another order, where transposing them in x first copies fewer
elements in all (ShuffleNet's channel shuffle in NCHW between NHWC convs: the shuffle becomes a transpose of the NHWC
tensor's last two axes and the transposes to NCHW and back cancel); past a split of a conv's output back in NCHW
(EfficientViT's heads, CSPNet's halves: each part transposed); past a matmul of two operands transposed in their last
two axes ((B A)^T = A^T B^T), or of one by a column, whose transpose is a view (a GC block's attention pooling: the
map's [C, HW] by softmax weights, as a row times the map), or by a small constant along the transposed axis
(talking-heads attention's mixes across heads, CaiT's and DeBERTa's: CaiT-XXS24 in bf16 16.96 -> 7.22 ms, in fp32
28.68 -> 19.81, Emerald Rapids); and past a broadcast_to (no layout rule either: ECA's and MobileViTv2's gates), whose
result, transposed, is its input transposed and broadcast. Two transposes in a row become one, and a transpose that
permutes nothing, or only axes of extent one, a view. So a hierarchical ViT's tokens made an image for a conv (which
ConvertLayout then transposes to NHWC) and the image made tokens again are reshapes: PVT-v2-B0's 86 transposes after
layout conversion are 30. EfficientViT-M0's 164 (54 at import) are 27."""

import math

import numpy as np
import tvm
from tvm import relax

from .._dead_code import remove_all_unused
from .._ir import is_static_shape, read_counts, tensor_shape, with_attr
from ..ops import bound_call, bound_value, call_op_name, tuple_fields

UNARY = frozenset(f"relax.{name}" for name in (  # every elementwise op of one tensor Relax has
    "nn.relu", "nn.leakyrelu", "nn.gelu", "nn.gelu_tanh", "nn.silu", "nn.selu", "nn.softplus", "sigmoid", "tanh",
    "exp", "log", "erf", "sqrt", "rsqrt", "square", "negative", "abs", "sign", "astype", "floor", "ceil", "round",
    "trunc", "clip", "sin", "cos", "tan", "sinh", "cosh", "asin", "acos", "atan", "asinh", "acosh", "atanh",
    "isfinite", "isinf", "isnan", "logical_not", "bitwise_not"))
BINARY = frozenset(f"relax.{name}" for name in (  # elementwise ops of broadcast operands: arithmetic, comparisons,
    "add", "subtract", "multiply", "divide", "floor_divide", "floor_mod", "mod", "maximum", "minimum", "power",
    "atan2", "greater", "greater_equal", "less", "less_equal", "equal", "not_equal", "logical_and", "logical_or",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
    "where"))  # and where (torch.export's PReLU: where(x > 0, x, a * x))
POOLS = frozenset(("relax.nn.max_pool2d", "relax.nn.avg_pool2d"))
# the most rows and columns of a constant by which a transposed tensor's matmul is computed along its untransposed axis
# instead (_Sinker._mixed_along_axis): below the 16 fp32 lanes of a vector, a dot-product kernel's columns are padding
MIX_WIDTH = 16
REDUCTIONS = frozenset(f"relax.{name}" for name in ("mean", "sum", "max", "min", "prod"))


@relax.transform.function_pass(opt_level=0, name="relay_amp.SinkTransposes")
class SinkTransposes:
    """Every transpose (permute_dims) read once, by an op that computes the same on the untransposed tensor, moved
    past it; two transposes in a row composed, dropped where they undo each other; one that permutes nothing, or
    only axes of extent one, a view (`_as_view`). A transpose read more than once moves below each reader that
    takes it (each result transposed on its own) where that leaves the function copying fewer elements in
    transposes (an EfficientViT head's output, read by the next head's add and by the concat of all heads;
    ConvNeXt's blocks); else it stays for them all. A reshape merging axes out of their order in the untransposed
    tensor takes the transpose the same way, by whether a transpose of those axes first copies fewer elements in
    all. Fold constants first: a constant operand of a binary op is transposed the other way."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
        """`func` with its transposes sunk; the input module is left as it was."""
        reads = read_counts(func)
        sinkers = [_Sinker(mod, reads, shared, reorder=False) for shared in (False, True)]
        sunk = [remove_all_unused(sinker.visit_expr(func)) for sinker in sinkers]
        if any(sinker.reorderable for sinker in sinkers):
            sunk += [remove_all_unused(_Sinker(mod, reads, shared, reorder=True).visit_expr(func))
                     for shared in (False, True)]
        return min(sunk, key=_transposed_elements)


@relax.expr_functor.mutator
class _Sinker(relax.PyExprMutator):
    in_dataflow = False  # only dataflow blocks: a graph output's transpose stays where the block hands it out

    def __init__(self, mod: tvm.IRModule, reads: dict[relax.Var, int], shared: bool, reorder: bool):
        super().__init__(mod)
        self.reads = reads  # of the function's vars, which keep their names where a transpose moves past them
        self.shared = shared  # whether a transpose read more than once moves below each reader that takes it
        self.reorder = reorder  # whether a reshape merging axes out of their order moves the transpose (`_run_order`)
        self.reorderable = False  # whether a reshape met could have, had `reorder` been set

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
        if name in ("relax.split", "relax.reshape", "relax.squeeze", "relax.matmul"):
            return self._through(call, name)
        joined = name == "relax.concat" and isinstance(call.args[0], relax.Tuple)
        operands = list(call.args[0].fields) if joined else list(call.args)
        sources = [self._sinkable(arg) for arg in operands]
        found = [source for source in sources if source is not None]
        if not found or any(source[1] != found[0][1] for source in found) or (joined and len(found) < len(sources)):
            return call
        perm = found[0][1]
        moved = _moved(call, name, sources, perm)
        if moved is None:
            return call
        result_perm = _result_perm(call, name, perm)
        if result_perm == list(range(len(result_perm))):
            return moved
        return relax.op.permute_dims(self.builder_.emit(moved), result_perm)

    def visit_tuple_getitem_(self, item: relax.TupleGetItem) -> relax.Expr:
        item = super().visit_tuple_getitem_(item)
        fields = tuple_fields(self, item.tuple_value) if self.in_dataflow else None
        return item if fields is None else fields[item.index]  # a part of a sunk split: its transpose

    def _transposed(self, expr: relax.Expr) -> "tuple[relax.Expr, list[int]] | None":
        """(x, axes) where `expr` is bound to permute_dims(x, axes) with its axes given (through vars bound to
        vars), else None."""
        while isinstance(bound_value(self, expr), relax.Var):
            expr = bound_value(self, expr)
        value = bound_call(self, expr, "relax.permute_dims")
        if value is None or value.attrs.axes is None:
            return None
        return value.args[0], [int(axis) for axis in value.attrs.axes]

    def _sinkable(self, expr: relax.Expr) -> "tuple[relax.Expr, list[int]] | None":
        """`_transposed(expr)` where the transpose may move below its reader (it has no other, or `shared`), else
        None."""
        return self._transposed(expr) if self.shared or self.reads.get(expr) == 1 else None

    def _through(self, call: relax.Call, name: str) -> relax.Expr:
        """A split, reshape or matmul of transposed operands computed on the untransposed ones, its result
        transposed (`_split`, `_reshaped`, `_swapped_matmul`, `_mixed_along_axis`); `call` where it cannot be."""
        if name == "relax.matmul":
            swapped = self._swapped_matmul(call)
            return self._mixed_along_axis(call) if swapped is call else swapped
        source = self._sinkable(call.args[0])
        if source is None:
            return call
        if name in ("relax.reshape", "relax.squeeze"):  # a squeeze: a reshape dropping axes of extent one
            return self._reshaped(call, *source)
        return self._split(call, *source) if _channels_first(source[1]) else call

    def _split(self, call: relax.Call, data: relax.Expr, perm: list[int]) -> relax.Tuple:
        """The parts of the untransposed `data` split along the renamed axis, each transposed: a conv's NHWC
        output split into heads or halves in NCHW (EfficientViT, CSPNet), the parts' transposes left to meet
        the next conv's."""
        sections = call.attrs.indices_or_sections
        count = int(sections) if isinstance(sections, tvm.tirx.IntImm) else len(sections) + 1
        split = self.builder_.emit(relax.op.split(data, sections, perm[int(call.attrs.axis)]))
        parts = [self.builder_.emit(relax.TupleGetItem(split, index)) for index in range(count)]
        return relax.Tuple([self.builder_.emit(relax.op.permute_dims(part, perm)) for part in parts])

    def _swapped_matmul(self, call: relax.Call) -> relax.Expr:
        """matmul(b, a) transposed, for matmul of a transposed in its last two axes by b transposed alike ((B A)^T =
        A^T B^T: attention's P V as EfficientViT computes it on NCHW heads, V^T P^T) or by a column, whose transpose
        is a view (a GC block's attention pooling, [C, HW] of an NHWC map by softmax weights [HW, 1]: a row times the
        map, its values along the map's rows); `call` for any other matmul. A row times a transposed map stays: as a
        column of products, each a sum across one vector, LambdaResNet-26t's position lambdas ran 1.036x slower."""
        source = self._sinkable(call.args[0])
        if source is None or source[1] != _last_two_swapped(len(source[1])):
            return call
        left, perm = source
        other = self._sinkable(call.args[1])
        right = _column_as_row(call.args[1], perm) if other is None else other[0] if other[1] == perm else None
        if right is None:
            return call  # transposed another way (the same rank: no batch broadcast), or no column
        product = self.builder_.emit(relax.op.matmul(right, left, out_dtype=call.attrs.out_dtype))
        return _viewed(relax.op.permute_dims(product, perm))

    def _mixed_along_axis(self, call: relax.Call) -> relax.Expr:
        """matmul(x transposed to put an axis a last, W) as W^T times x seen as [before a, a, after a], its result
        transposed: where W is a constant of at most MIX_WIDTH rows and no more columns than rows, a mix of x's
        slices along a (talking-heads attention's linear layers across heads, CaiT's and DeBERTa's: [B, N, N, H] by
        [H, H]; a dot-product kernel computed them on a vector of columns for H, after a transpose of the whole map,
        which another one undid). W may be a constant batch of that one matrix (torch.export's). The result's
        transpose, where nothing cancels it, copies no more than x's did. `call` for any other matmul."""
        source = self._sinkable(call.args[0])
        weight = None if source is None else _small_matrix(call.args[1])  # read only behind a transpose
        if weight is None:
            return call
        data, perm = source
        shape, (depth, width) = tensor_shape(data), weight.shape
        axis = perm[-1]
        if (not is_static_shape(shape) or axis == len(perm) - 1 or width > depth
                or tensor_shape(call) != (*tensor_shape(call.args[0])[:-1], width)):  # a weight's batch broadcasting x
            return call
        slices = self.builder_.emit(relax.op.reshape(data, [math.prod(shape[:axis]), depth,
                                                            math.prod(shape[axis + 1:])]))
        mixing = relax.const(weight.T.copy(), str(call.args[1].ty.dtype))
        mixed = self.builder_.emit(relax.op.matmul(mixing, slices, out_dtype=call.attrs.out_dtype))
        unflattened = self.builder_.emit(relax.op.reshape(mixed, [*shape[:axis], width, *shape[axis + 1:]]))
        return relax.op.permute_dims(unflattened, perm)

    def _reshaped(self, call: relax.Call, data: relax.Expr, perm: list[int]) -> relax.Expr:
        """The reshape of the untransposed `data` that `_regrouping` finds, transposed to `call`'s shape (a reshape's
        or a squeeze's); with `reorder`, of `data` transposed first where the reshape merges axes that lie together
        in it in another order (`_run_order`); `call` where there is none."""
        target = _static_result_shape(call)
        regrouped = _regrouping(tensor_shape(data), perm, target)
        order = None if regrouped is not None else _run_order(tensor_shape(data), perm, target)
        self.reorderable |= order is not None
        if order is not None and self.reorder:
            data = self.builder_.emit(relax.op.permute_dims(data, order))
            perm = [order.index(axis) for axis in perm]
            regrouped = _regrouping(tensor_shape(data), perm, target)
        if regrouped is None:
            return call
        shape, moved = regrouped
        transposed = relax.op.permute_dims(self.builder_.emit(relax.op.reshape(data, shape)), moved)
        return _viewed(transposed)

    def _broadcast_transposed(self, broadcast: relax.Call, perm: list[int]) -> relax.Expr:
        """broadcast_to(x, shape) transposed by `perm` as x transposed (a view where x has extent one on the moved
        axes: an ECA or MobileViTv2 gate of one value per channel) broadcast to the transposed shape."""
        shape = _static_shape_of(broadcast.args[1])
        moved = self.builder_.emit(_viewed(relax.op.permute_dims(broadcast.args[0], perm)))
        return relax.op.broadcast_to(moved, [shape[axis] for axis in perm])

    def _cancelled(self, call: relax.Call) -> relax.Expr:
        """The view of a transpose that permutes nothing or only axes of extent one (`_as_view`); for
        permute_dims(permute_dims(x, p), q), x where q undoes p, else one transpose of x; else the call."""
        view = _as_view(call)
        if view is not None:
            return view
        broadcast = bound_call(self, call.args[0], "relax.broadcast_to") if call.attrs.axes is not None else None
        if broadcast is not None and len(_static_shape_of(broadcast.args[1]) or ()) == len(call.attrs.axes):
            return self._broadcast_transposed(broadcast, [int(axis) for axis in call.attrs.axes])
        inner = self._transposed(call.args[0])
        if inner is None or call.attrs.axes is None:
            return call
        source, first = inner
        composed = [first[int(axis)] for axis in call.attrs.axes]
        if composed == list(range(len(composed))):
            return source
        one = relax.op.permute_dims(source, composed)  # one copy instead of two
        return _viewed(one)


def _small_matrix(weight: relax.Expr) -> "np.ndarray | None":
    """The matrix of a constant matmul operand of at most MIX_WIDTH rows and columns: itself where it is 2-D, its
    first where it is a batch of equal ones (torch.export's linear on a 3-D input multiplies by its weight broadcast
    to the batch, folded), else None. A larger operand's values are not read."""
    if not isinstance(weight, tvm.ir.expr.Constant) or len(tensor_shape(weight)) < 2:
        return None
    if max(tensor_shape(weight)[-2:]) > MIX_WIDTH:
        return None
    values = weight.value.numpy()
    matrices = values.reshape(-1, *values.shape[-2:])
    return matrices[0] if (matrices == matrices[0]).all() else None


def _transposed_elements(func: relax.Function) -> int:
    """How many elements the transposes in `func` copy."""
    return sum(math.prod(tensor_shape(binding.var)) for block in func.body.blocks for binding in block.bindings
               if call_op_name(binding.value) == "relax.permute_dims" and is_static_shape(tensor_shape(binding.var)))


def _last_two_swapped(rank: int) -> list[int]:
    """The axes of a transpose of the last two of `rank` axes (the others in place)."""
    return [*range(rank - 2), rank - 1, rank - 2]


def _channels_first(perm: list[int]) -> bool:
    """Whether `perm` moves the last axis to the second and keeps the others in order: the transpose ConvertLayout
    puts after an NHWC conv for an op in NCHW."""
    return perm == [0, len(perm) - 1, *range(1, len(perm) - 1)]


def _regrouping(source: "list | None", perm: list[int], target: "list[int] | None"):
    """(shape, axes) such that permute_dims(reshape(x, shape), axes) is reshape(permute_dims(x, perm), target) for
    x of shape `source`, or None: where the reshape only merges or splits runs of the transposed axes that lie
    in x in the same order (a [4, 48, 7, 7] from NHWC flattened to [4, 48, 49]), x is reshaped instead, with the
    same runs, and the runs transposed. Axes of extent one may sit anywhere: they are left out, and the target's
    put back where it has them."""
    found = _source_runs(source, perm, target)
    if found is None:
        return None
    _, runs, sources = found
    starts = []
    for moved in sources:
        if moved != list(range(moved[0], moved[0] + len(moved))):
            return None
        starts.append(moved[0])
    in_source_order = sorted(range(len(runs)), key=starts.__getitem__)
    shape = [size for run in in_source_order for size in runs[run][1]]
    offsets, offset = {}, 0
    for run in in_source_order:
        offsets[run], offset = offset, offset + len(runs[run][1])
    axes = [offsets[run] + index for run in range(len(runs)) for index in range(len(runs[run][1]))]
    return _with_ones(shape, axes, target)


def _source_runs(source: "list | None", perm: list[int], target: "list[int] | None"):
    """(x's axes of extents other than one, the runs `_runs` cuts a reshape of permute_dims(x, perm) to `target`
    into, each run's axes as indices into those axes of x) for x of shape `source`, or None where the shapes are
    not static or hold different numbers of elements."""
    if not (is_static_shape(source) and target is not None) or 0 in source or math.prod(source) != math.prod(target):
        return None
    kept = [axis for axis in range(len(source)) if source[axis] != 1]
    perm = [kept.index(axis) for axis in perm if source[axis] != 1]
    runs = _runs([source[kept[axis]] for axis in perm], [size for size in target if size != 1])
    return kept, runs, [[perm[axis] for axis in axes] for axes, _ in runs]


def _run_order(source: "list | None", perm: list[int], target: "list[int] | None") -> "list[int] | None":
    """The transpose of x (of shape `source`) that puts the axes each run of a reshape of permute_dims(x, perm) to
    `target` merges in the run's order, where every run's axes lie together in x but some out of that order
    (ShuffleNet's channel shuffle, the channels as [2, C/2] transposed to [C/2, 2] and merged, on an NHWC
    tensor: a transpose of its last two axes, then the channels merged, then the transpose to NCHW that sinks
    on); None where there is no such transpose."""
    found = _source_runs(source, perm, target)
    if found is None:
        return None
    kept, _, sources = found
    order = list(range(len(source)))
    for moved in sources:
        if sorted(moved) != list(range(min(moved), min(moved) + len(moved))):
            return None
        for slot, axis in zip(sorted(moved), moved):
            order[kept[slot]] = kept[axis]
    return None if order == list(range(len(source))) else order


def _with_ones(shape: list[int], axes: list[int], target: list[int]) -> tuple[list[int], list[int]]:
    """`shape` and `axes` (a reshape and transpose to `target` without its extents of one) with those extents put
    back: each at its index in `target`, in the shape and in the transpose's result."""
    ones = [index for index, size in enumerate(target) if size == 1]
    for index in ones:
        shape.insert(index, 1)
    placed = [index for index in range(len(shape)) if index not in ones]  # where each of `shape`'s extents went
    others = iter(axes)
    return shape, [index if index in ones else placed[next(others)] for index in range(len(target))]


def _runs(sizes: list[int], target: list[int]) -> list[tuple[list[int], list[int]]]:
    """`sizes` and `target` (no extent of one in either, the same product) cut into the fewest runs of equal
    products: (the axes of `sizes`, the extents of `target`) per run, in order."""
    runs, axis, index = [], 0, 0
    while axis < len(sizes):
        axes, extents = [axis], [target[index]]
        product, wanted = sizes[axis], target[index]
        axis, index = axis + 1, index + 1
        while product != wanted:
            if product < wanted:
                axes.append(axis)
                product, axis = product * sizes[axis], axis + 1
            else:
                extents.append(target[index])
                wanted, index = wanted * target[index], index + 1
        runs.append((axes, extents))
    return runs


def _static_result_shape(call: relax.Call) -> "list[int] | None":
    """The extents of `call`'s result where they are all ints, else None (a symbolic extent)."""
    shape = tensor_shape(call)
    return list(shape) if is_static_shape(shape) else None


def _static_shape_of(shape: relax.Expr) -> "list[int] | None":
    """The extents of a shape expression that are all ints, else None (a symbolic extent, a shape var)."""
    if not isinstance(shape, relax.ShapeExpr) or not all(isinstance(size, tvm.tirx.IntImm) for size in shape.values):
        return None
    return [int(size) for size in shape.values]


def _as_view(call: relax.Call) -> "relax.Expr | None":
    """The input of a transpose that permutes nothing (ConvertLayout leaves one where an exporter's transpose to NCHW
    meets its own back to NHWC: tf2onnx's Keras exports, 64 in MobileNetV3-Large), or its reshape where the
    transpose moves only axes of extent one (a squeeze-excite's [1, C, 1, 1] to [1, 1, 1, C]): a view, where the
    transpose copies. None for any other transpose."""
    shape = tensor_shape(call.args[0])
    if call.attrs.axes is None or not is_static_shape(shape):
        return None
    perm = [int(axis) for axis in call.attrs.axes]
    if perm == list(range(len(perm))):
        return call.args[0]
    moved = [axis for axis in perm if shape[axis] != 1]
    if moved != sorted(moved):
        return None
    return relax.op.reshape(call.args[0], [shape[axis] for axis in perm])


def _viewed(transpose: relax.Call) -> relax.Expr:
    """`_as_view(transpose)` where the transpose is a view, else `transpose`."""
    view = _as_view(transpose)
    return transpose if view is None else view


def _moved(call: relax.Call, name: str, sources: list, perm: list[int]) -> relax.Expr | None:
    """`call` on the untransposed tensors (`sources`: (x, perm) per transposed argument, or per operand a concat
    joins; None for the others), its axes renamed, or None where it cannot move."""
    data = sources[0][0] if sources[0] is not None else None
    if name in UNARY and data is not None:
        return relax.Call(call.op, [data, *call.args[1:]], call.attrs, call.ty_args)
    if name in BINARY:
        args = [source[0] if source is not None else _untransposed_operand(arg, perm)
                for arg, source in zip(call.args, sources)]
        return None if any(arg is None for arg in args) else relax.Call(call.op, args, call.attrs, call.ty_args)
    if name == "relax.concat":  # every operand transposed alike (`_Sinker.visit_call_`)
        return relax.op.concat([source[0] for source in sources], axis=perm[int(call.attrs.axis)])
    if data is None or any(source is not None for source in sources[1:]):
        return None
    if name == "relax.broadcast_to" and len(_static_shape_of(call.args[1]) or ()) == len(perm):
        return relax.op.broadcast_to(data, _untransposed_shape(_static_shape_of(call.args[1]), perm))
    if name == "relax.strided_slice":
        axes = [perm[int(axis)] for axis in call.args[1]]
        return relax.op.strided_slice(data, axes, *call.args[2:], assume_inbound=call.attrs.assume_inbound)
    if name == "relax.nn.pad":
        widths = [int(width) for width in call.attrs.pad_width]
        pairs = [widths[2 * axis:2 * axis + 2] for axis in range(len(perm))]  # (before, after) per axis
        moved = [width for pair in _untransposed_shape(pairs, perm) for width in pair]
        return relax.Call(call.op, [data, *call.args[1:]], with_attr(call.attrs, pad_width=moved), call.ty_args)
    if name == "relax.nn.group_norm":
        attrs = with_attr(call.attrs, channel_axis=perm[int(call.attrs.channel_axis)],
                          axes=[perm[int(axis)] for axis in call.attrs.axes])
        return relax.Call(call.op, [data, *call.args[1:]], attrs, call.ty_args)
    if name in POOLS:
        attrs = with_attr(call.attrs, layout=_renamed(call.attrs.layout, perm),
                          out_layout=_renamed(call.attrs.out_layout, perm))
        return relax.Call(call.op, [data], attrs, call.ty_args)
    if name in REDUCTIONS and call.attrs.axis is not None:
        axes = [perm[int(axis) % len(perm)] for axis in call.attrs.axis]
        return relax.Call(call.op, [data], with_attr(call.attrs, axis=axes), call.ty_args)
    if name == "relax.expand_dims":
        return relax.op.expand_dims(data, _new_axes(call))
    return None


def _column_as_row(arg: relax.Expr, perm: list[int]) -> "relax.Expr | None":
    """`arg`, a column of `perm`'s rank (its last axis of extent one), as a row: a reshape, a view; else None."""
    shape = tensor_shape(arg)
    if shape is None or len(shape) != len(perm) or not is_static_shape(shape) or int(shape[-1]) != 1:
        return None
    return relax.op.reshape(arg, [int(shape[axis]) for axis in perm])


def _result_perm(call: relax.Call, name: str, perm: list[int]) -> list[int]:
    """The transpose of `call`'s result computed on the untransposed tensor: `perm`, over the axes a reduction
    keeps (`_kept_perm`) or with the axes expand_dims adds in place (`_grown_perm`)."""
    if name == "relax.expand_dims":
        return _grown_perm(perm, _new_axes(call))
    return _kept_perm(perm, _dropped_axes(call, name))


def _new_axes(call: relax.Call) -> list[int]:
    """The axes of expand_dims' result that it adds."""
    rank = len(tensor_shape(call))
    return sorted(int(axis) % rank for axis in call.attrs.axis)


def _grown_perm(perm: list[int], added: list[int]) -> list[int]:
    """The transpose of expand_dims(x, `added`) that gives expand_dims(transpose(x, `perm`), `added`): the added
    axes stay, the others move as `perm` moves x's."""
    kept = [axis for axis in range(len(perm) + len(added)) if axis not in added]
    grown = list(range(len(perm) + len(added)))
    for position, source in zip(kept, perm):
        grown[position] = kept[source]
    return grown


def _dropped_axes(call: relax.Call, name: str) -> list[int]:
    """The axes of its operand a reduction leaves out of its result (none where it keeps them; none for other ops)."""
    if name not in REDUCTIONS or call.attrs.keepdims or call.attrs.axis is None:
        return []
    rank = len(tensor_shape(call.args[0]))
    return sorted(int(axis) % rank for axis in call.attrs.axis)


def _kept_perm(perm: list[int], dropped: list[int]) -> list[int]:
    """The transpose of a result computed on the untransposed tensor, where the op drops `dropped` of the transposed
    tensor's axes (ResNeSt's sum over its radix axis): `perm` over the axes left, numbered among themselves."""
    left = sorted(set(perm) - {perm[axis] for axis in dropped})
    return [left.index(source) for axis, source in enumerate(perm) if axis not in dropped]


def _untransposed_shape(shape: list, perm: list[int]) -> list:
    """The shape (or layout letters, or pad widths per axis) whose transpose by `perm` is `shape`."""
    untransposed = [None] * len(perm)
    for axis, source_axis in enumerate(perm):
        untransposed[source_axis] = shape[axis]
    return untransposed


def _renamed(layout: str, perm: list[int]) -> str:
    """The layout of the untransposed tensor, for `layout` of its transpose by `perm`."""
    return "".join(_untransposed_shape(list(str(layout)), perm))


def _untransposed_operand(arg: relax.Expr, perm: list[int]) -> relax.Expr | None:
    """An untransposed operand's counterpart for the untransposed tensor: a scalar as it is, a full-rank constant
    transposed back, a runtime tensor whose axes past extent one keep their order transposed back (a gate of
    [1, C, 1, 1] broadcast over NCHW, read as [1, 1, 1, C] by NHWC: a squeeze-excite's in a QDQ file) as a reshape
    of it, a view; None for any other."""
    shape = tensor_shape(arg)
    if shape is None:
        return None
    if len(shape) == 0:
        return arg
    if isinstance(arg, tvm.ir.expr.Constant) and len(shape) == len(perm):
        inverse = [perm.index(axis) for axis in range(len(perm))]
        return relax.op.permute_dims(arg, inverse)
    if not is_static_shape(shape) or len(shape) > len(perm):
        return None
    full = [1] * (len(perm) - len(shape)) + [int(extent) for extent in shape]  # broadcast's leading ones
    moved = [perm[axis] for axis, extent in enumerate(full) if extent != 1]
    return relax.op.reshape(arg, _untransposed_shape(full, perm)) if moved == sorted(moved) else None
