"""What `frontend.from_torch` corrects in TVM's importer of torch.export graphs, where it computes other values
than PyTorch or refuses what PyTorch runs: graph rewrites before the import, and converters for some ops."""

import numpy as np
import tvm
from tvm import relax

from .errors import ModelLoadError

# torch dtypes numpy names alike (not bfloat16)
NUMPY_DTYPES = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")


def as_torch_runs_it(graph) -> None:
    """Rewrite an exported graph in place so that TVM's importer takes it as PyTorch runs it: 1-D empty inputs
    dropped from concatenations, views as reshapes, unsorted top-ks sorted, complex values as real pairs."""
    _drop_legacy_empty_cat_inputs(graph)
    _views_as_reshapes(graph)
    _topks_sorted(graph)
    _complex_as_real_pairs(graph)


def _drop_legacy_empty_cat_inputs(graph) -> None:
    """Remove from each aten.cat its 1-D empty inputs, which torch.cat skips whatever the other inputs' rank
    (transformers' key/value caches start as torch.tensor([]) and are concatenated with each layer's keys and
    values); TVM's importer requires every input to have the output's rank."""
    import torch

    dropped = False
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default):
        tensors = node.args[0]
        kept = [tensor for tensor in tensors if not _is_legacy_empty(tensor)]
        if not kept or len(kept) == len(tensors):
            continue
        if len(kept) == 1:
            node.replace_all_uses_with(kept[0])
        else:
            node.update_arg(0, kept)
        dropped = True
    if dropped:  # the empty tensors' producers, and concatenations of one input, are left unread
        graph.eliminate_dead_code()


def _is_legacy_empty(tensor) -> bool:
    """Whether an exported graph's value is a tensor of shape (0,)."""
    value = getattr(tensor, "meta", {}).get("val")
    return value is not None and tuple(value.shape) == (0,)


def _views_as_reshapes(graph) -> None:
    """Make each aten.view an aten.reshape, which is the same view wherever a view is valid. The importer
    decomposes the graph to core ATen first, which may give a tensor other strides than the export saw (GPT-2's
    attention output after the decomposed scaled_dot_product_attention), and a view of it then fails ("Cannot
    view a tensor with shape ... and strides ..."); a reshape copies there instead."""
    import torch

    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default


def _topks_sorted(graph) -> None:
    """Make each aten.topk of sorted=False sorted, which TVM's importer refuses (DeepSeek-V3-style expert routers:
    Dots1, EXAONE-MoE): PyTorch leaves that order unspecified, and sorted is one of its orders."""
    import torch

    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.topk.default):
        if len(node.args) > 4:
            node.args = (*node.args[:4], True)
        node.kwargs = {key: value for key, value in node.kwargs.items() if key != "sorted"}


def _complex_as_real_pairs(graph) -> None:
    """Hold each complex value as its real and imaginary parts on a last axis of 2, which TVM's importer (and Relax)
    lacks a dtype for: rotary embeddings written as complex products (Llama 4, DeepSeek-V2: `torch.polar`,
    `view_as_complex`, a multiply, `view_as_real`). The pairs are what view_as_real gives; a product of two is
    (ar br - ai bi, ar bi + ai br). A complex value reaching another op is a ModelLoadError naming it."""
    import torch

    rewritten = [node for node in graph.nodes
                 if _is_complex(node) or any(_is_complex(arg) for arg in node.all_input_nodes)]
    if not rewritten:
        return
    pairs: set = set()
    for node in rewritten:
        _as_pairs(graph, node, pairs, torch.ops.aten)
    graph.lint()
    graph.owning_module.recompile()


def _is_complex(node) -> bool:
    value = node.meta.get("val")
    return getattr(getattr(value, "dtype", None), "is_complex", False)


def _as_pairs(graph, node, pairs: set, aten) -> None:
    """Replace `node`, which makes or reads complex values, by its computation on real pairs (`pairs`: the nodes
    holding complex values as pairs, to which the replacement of a complex value is added)."""
    if node.target is aten._assert_tensor_metadata.default:
        graph.erase_node(node)
        return
    with graph.inserting_before(node):
        if node.target in (aten.view_as_complex.default, aten.view_as_real.default) or _complex_copy(node, aten):
            replacement = node.args[0]
        elif node.target is aten.polar.default:
            magnitude, angle = node.args
            parts = [graph.call_function(aten.mul.Tensor, (magnitude, graph.call_function(part, (angle,))))
                     for part in (aten.cos.default, aten.sin.default)]
            replacement = graph.call_function(aten.stack.default, (parts, -1))
        elif node.target is aten.unsqueeze.default:
            data, dim = node.args
            replacement = graph.call_function(aten.unsqueeze.default, (data, dim if dim >= 0 else dim - 1))
        elif node.target is aten.mul.Tensor:
            replacement = _pair_product(graph, *node.args, pairs, aten)
        elif node.target in (aten.real.default, aten.imag.default):
            replacement = graph.call_function(aten.select.int, (node.args[0], -1, int(node.target is aten.imag.default)))
        elif node.target is aten.abs.default:
            squares = graph.call_function(aten.mul.Tensor, (node.args[0], node.args[0]))
            replacement = graph.call_function(aten.sqrt.default, (graph.call_function(aten.sum.dim_IntList,
                                                                                       (squares, [-1])),))
        elif _spectral_kind(node) is not None:
            replacement = _spectral(graph, node, pairs, aten)
        else:
            raise ModelLoadError(f"complex values reach {node.target} ({node.name}), which relay_amp does not import "
                                 "(it holds polar, view_as_complex, view_as_real, copies, unsqueeze, multiplies, real, "
                                 "imag, abs and torch.fft's transforms of complex values as real pairs)")
    if _is_complex(node):
        pairs.add(replacement)
        replacement.meta["complex_shape"] = list(node.meta["val"].shape)  # the pairs' own lacks the last axis of 2
        replacement.meta["complex_dtype"] = node.meta["val"].dtype
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


# torch.fft's ops: (kind, how many trailing axes they transform by default: None for every axis)
SPECTRAL = {f"fft_{prefix}{suffix}": (kind, axes) for prefix, kind in
            (("", "forward"), ("i", "inverse"), ("r", "real to half"), ("ir", "half to real"))
            for suffix, axes in (("fft", 1), ("fft2", 2), ("fftn", None))}


def _spectral_kind(node) -> "tuple[str, int | None] | None":
    """(kind, default axes) of a torch.fft transform node, or None."""
    return SPECTRAL.get(getattr(node.target, "__name__", "").removesuffix(".default"))


def _spectral(graph, node, pairs: set, aten):
    """A torch.fft transform (fft, ifft, rfft, irfft and their 2-D and n-D forms) as matmuls of real pairs by the
    cos and sin of its DFT basis along each transformed axis: a forward step takes a + ib to (aC + bS) + i(bC - aS),
    an inverse one to (aC - bS) + i(aS + bC), rfft's last axis keeps its n // 2 + 1 first outputs and irfft's
    counts the others as their conjugates (weights 2, 1 for the first and the middle). Sizes other than the
    input's (zero padding, cropping) are a ModelLoadError."""
    kind, default_axes = _spectral_kind(node)
    options = dict(zip(("size", "dim", "norm"), node.args[1:]))
    options.update({key: node.kwargs[key] for key in ("dim", "norm") if key in node.kwargs})
    data = node.args[0]
    shape = data.meta["complex_shape"] if data in pairs else list(data.meta["val"].shape)
    axes = options.get("dim")
    axes = ([axes] if isinstance(axes, int) else list(axes)) if axes is not None else (
        list(range(len(shape)))[-default_axes:] if default_axes else list(range(len(shape))))
    axes = [axis % len(shape) for axis in axes]
    lengths = _transform_lengths(node, kind, [shape[axis] for axis in axes],
                                 node.kwargs.get("s", node.kwargs.get("n", options.get("size"))))
    parts = [graph.call_function(aten.select.int, (data, -1, index)) for index in (0, 1)] if data in pairs else [
        data, None]
    dtype = data.meta["complex_dtype"] if data in pairs else data.meta["val"].dtype
    wide = str(dtype).removeprefix("torch.") in ("float64", "complex128")  # else float32 (complex64)
    for axis, length, step in _spectral_steps(kind, axes, lengths):
        parts = _spectral_step(graph, parts, axis, length, step, options.get("norm"), wide, aten)
    real, imaginary = parts
    return real if kind == "half to real" else graph.call_function(aten.stack.default, ([real, imaginary], -1))


def _transform_lengths(node, kind: str, extents: list[int], sizes) -> list[int]:
    """The signal length of each transformed axis: its extent, but irfft's last, 2 (m - 1) for m inputs or its
    given size (whose half it must hold: m == n // 2 + 1); other sizes than the input's are a ModelLoadError."""
    sizes = [sizes] if isinstance(sizes, int) else None if sizes is None else [int(size) for size in sizes]
    lengths = list(extents)
    if kind == "half to real":
        lengths[-1] = 2 * (extents[-1] - 1) if sizes is None else sizes[-1]
    if sizes is not None and (sizes != lengths or lengths[-1] // 2 + 1 != extents[-1] and kind == "half to real"):
        raise ModelLoadError(f"{node.target} ({node.name}) of sizes {sizes} other than its input's: relay_amp "
                             "imports transforms without padding or cropping")
    return lengths


def _spectral_steps(kind: str, axes: list[int], lengths: list[int]) -> list[tuple[int, int, str]]:
    """(axis, length, step) in the order a transform takes them: rfft's halving step first, irfft's last."""
    if kind in ("forward", "inverse"):
        return [(axis, length, kind) for axis, length in zip(axes, lengths)]
    if kind == "real to half":
        return [(axes[-1], lengths[-1], kind), *[(a, n, "forward") for a, n in zip(axes[:-1], lengths[:-1])]]
    return [*[(a, n, "inverse") for a, n in zip(axes[:-1], lengths[:-1])], (axes[-1], lengths[-1], kind)]


def _spectral_step(graph, parts: list, axis: int, length: int, step: str, norm, wide: bool, aten) -> list:
    """One axis of a transform: (real, imaginary or None) parts to the transformed parts (imaginary None where
    the result is real), in float64 where `wide`, else float32."""
    real, imaginary = parts
    inputs = length // 2 + 1 if step == "half to real" else length
    outputs = length // 2 + 1 if step == "real to half" else length
    forward = step in ("forward", "real to half")
    scale = length ** -0.5 if norm == "ortho" else 1.0 / length if (norm == "forward") == forward else 1.0
    cosines, sines = _basis(graph, (inputs, outputs, length), scale, step == "half to real", wide, aten)

    def along(tensor, matrix):
        moved = graph.call_function(aten.transpose.int, (tensor, axis, -1))
        return graph.call_function(aten.transpose.int, (graph.call_function(aten.matmul.default, (moved, matrix)),
                                                        axis, -1))

    def combine(first, second, subtract: bool):
        return graph.call_function(aten.sub.Tensor if subtract else aten.add.Tensor, (first, second))

    if imaginary is None:  # a real input: (aC, -aS) forward, (aC, aS) inverse
        turned = along(real, sines)
        return [along(real, cosines), graph.call_function(aten.neg.default, (turned,)) if forward else turned]
    new_real = combine(along(real, cosines), along(imaginary, sines), subtract=not forward)
    if step == "half to real":
        return [new_real, None]
    return [new_real, combine(along(imaginary, cosines), along(real, sines), subtract=forward)]


def _basis(graph, sizes: tuple[int, int, int], scale: float, weighted: bool, wide: bool, aten) -> tuple:
    """The (inputs, outputs) cos and sin of 2 pi j k / length (`sizes`: inputs, outputs, length), times `scale`
    (and, `weighted`, irfft's weight of each input: 1 for the first and, for an even length, the middle, 2 for the
    others), as graph nodes PyTorch's ops compute (folded as constants after the import), in float64 where `wide`.
    j k is reduced modulo the length in integers first."""
    import torch

    inputs, outputs, length = sizes
    dtype = torch.float64 if wide else torch.float32
    rows = graph.call_function(aten.arange.default, (inputs,), {"dtype": torch.int64})
    columns = graph.call_function(aten.arange.default, (outputs,), {"dtype": torch.int64})
    products = graph.call_function(aten.mul.Tensor, (graph.call_function(aten.unsqueeze.default, (rows, 1)),
                                                     graph.call_function(aten.unsqueeze.default, (columns, 0))))
    turns = graph.call_function(aten.remainder.Scalar, (products, length))
    angles = graph.call_function(aten.mul.Tensor, (graph.call_function(
        aten._to_copy.default, (turns,), {"dtype": dtype}), 2 * np.pi / length))
    factor = graph.call_function(aten.full.default, ([inputs, 1], scale), {"dtype": dtype})
    if weighted:
        middle = length // 2 if length % 2 == 0 else -1
        ends = graph.call_function(aten.logical_or.default, (
            graph.call_function(aten.eq.Scalar, (rows, 0)), graph.call_function(aten.eq.Scalar, (rows, middle))))
        doubled = graph.call_function(aten.where.Scalar, (ends, scale, 2 * scale))
        factor = graph.call_function(aten.unsqueeze.default, (doubled, 1))
    return tuple(graph.call_function(aten.mul.Tensor, (graph.call_function(part, (angles,)), factor))
                 for part in (aten.cos.default, aten.sin.default))


def _complex_copy(node, aten) -> bool:
    """Whether `node` copies or moves a complex value to a complex dtype (`.to(device)`): the pairs as they are."""
    copies = (aten.to.dtype_layout, aten.to.dtype, aten.to.device, aten._to_copy.default, aten.clone.default)
    return node.target in copies and _is_complex(node)


def _pair_product(graph, left, right, pairs: set, aten):
    """The node computing left * right, either or both of them complex held as pairs."""
    if left in pairs and right in pairs:
        parts = [[graph.call_function(aten.select.int, (side, -1, index)) for index in (0, 1)]
                 for side in (left, right)]
        (lr, li), (rr, ri) = parts

        def product(a, b):
            return graph.call_function(aten.mul.Tensor, (a, b))
        real = graph.call_function(aten.sub.Tensor, (product(lr, rr), product(li, ri)))
        imaginary = graph.call_function(aten.add.Tensor, (product(lr, ri), product(li, rr)))
        return graph.call_function(aten.stack.default, ([real, imaginary], -1))
    pair, factor = (left, right) if left in pairs else (right, left)
    if hasattr(factor, "op"):  # a real tensor: the same factor for both parts
        factor = graph.call_function(aten.unsqueeze.default, (factor, -1))
    return graph.call_function(aten.mul.Tensor, (pair, factor))


def computed_from_weights(exported, supported) -> dict:
    """Converters for the ops of `exported` that TVM's importer lacks (not in `supported`): each computed by PyTorch
    at import, as a constant, where every input it reads is computed from weights alone (NaFlexViT resizes its
    position embedding by an antialiased bicubic interpolation, aten._upsample_bicubic2d_aa); where one reads a
    runtime tensor, a ModelLoadError naming the op."""
    weights = _weight_values(exported)
    lacking = {node.target.__name__ for node in exported.graph.nodes
               if node.op == "call_function" and node.target.__name__ not in supported}
    return dict.fromkeys(lacking, lambda node, _importer: _computed_by_torch(node, weights))


def _weight_values(exported) -> dict:
    """{placeholder name: tensor} of `exported`'s parameters, buffers and constant tensors."""
    values = {**exported.state_dict, **exported.constants}
    return {spec.arg.name: values[spec.target] for spec in exported.graph_signature.input_specs
            if spec.target in values}


def _computed_by_torch(node, weights: dict) -> relax.Expr:
    """The value of `node`, computed by PyTorch from weights, as a constant (bf16 through fp32, which numpy holds)."""
    import torch

    with torch.no_grad():
        value = _weight_value(node, weights, {})
    if value is _RUNTIME:
        raise ModelLoadError(f"TVM's importer has no converter for {node.target.__name__} (node {node.name!r}), "
                             f"which reads a runtime tensor")
    if value.dtype == torch.bfloat16:
        return relax.op.astype(relax.const(value.float().numpy()), "bfloat16")
    return relax.const(value.contiguous().numpy())


_RUNTIME = object()  # a value computed from the graph's inputs, which PyTorch cannot compute at import


def _weight_value(node, weights: dict, known: dict):
    """`node`'s value computed by PyTorch from the weights (memoized in `known`), or _RUNTIME."""
    import torch

    if node not in known:
        if node.op == "placeholder":
            known[node] = weights.get(node.name, _RUNTIME)
        elif node.op != "call_function":
            known[node] = _RUNTIME
        else:
            read = [_weight_value(arg, weights, known) for arg in node.all_input_nodes]  # known from here on
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), known.get)
            known[node] = _RUNTIME if any(value is _RUNTIME for value in read) else node.target(*args, **kwargs)
    return known[node]


def _nearest_upsample(node, importer) -> relax.Var:
    """aten.upsample_nearest2d (F.interpolate's mode="nearest") as PyTorch computes it: source index
    floor(destination * in / out). TVM's importer took half-pixel centres and rounding (PyTorch's
    "nearest-exact"), which differ where out / in is not whole: GhostNetV2 gates a 7x7 map by its 3x3 pool."""
    size = [int(extent) for extent in node.meta["val"].shape[2:]]
    return importer.block_builder.emit(relax.op.image.resize2d(
        importer.env[node.args[0]], size, layout="NCHW", method="nearest_neighbor",
        coordinate_transformation_mode="asymmetric", rounding_method="floor"))


def _division(node, importer) -> relax.Var:
    """aten.div (true, floor or trunc) and floor_divide with PyTorch's type promotion: both operands in the dtype
    PyTorch gives the result. TVM's importer made a Python int an int32 constant beside a float tensor, which
    Relax refuses (x // 2; EdgeNeXt's positional encoding), and divided int tensors as ints where PyTorch's true
    division gives floats."""
    dtype = str(node.meta["val"].dtype).removeprefix("torch.")
    lhs, rhs = (_operand(importer, arg, dtype) for arg in node.args[:2])
    mode = "floor" if "floor_divide" in str(node.target) else node.kwargs.get(
        "rounding_mode", node.args[2] if len(node.args) > 2 else None)
    if mode == "floor":
        return importer.block_builder.emit(relax.op.floor_divide(lhs, rhs))
    quotient = importer.block_builder.emit(relax.op.divide(lhs, rhs))  # ints: truncated, as TIR divides them
    return importer.block_builder.emit(relax.op.trunc(quotient)) if mode == "trunc" and "float" in dtype else quotient


def _cumulative_sum(node, importer) -> relax.Var:
    """aten.cumsum in the dtype PyTorch gives its result (int64 for bool and integer inputs). TVM's importer summed
    a bool mask as bools, which LLVM cannot compile: transformers' causal masks count a mask's positions so
    (Qwen3-MoE's and other decoders' from torch.export without an attention mask did not build)."""
    dtype = str(node.meta["val"].dtype).removeprefix("torch.")
    axis = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    return importer.block_builder.emit(relax.op.cumsum(_operand(importer, node.args[0], dtype), axis=int(axis)))


def _operand(importer, arg, dtype: str) -> relax.Expr:
    """An operand in `dtype`: a graph value cast where it has another dtype, a Python number a constant."""
    value = importer.env[arg] if hasattr(arg, "op") else arg
    if not isinstance(value, relax.Expr):
        return relax.const(value, dtype)
    if isinstance(value.ty, relax.TensorType) and value.ty.dtype != dtype:
        return importer.block_builder.emit(relax.op.astype(value, dtype))
    return value


def _slice_scatter(node, importer) -> relax.Var:
    """aten.slice_scatter of step 1 over static shapes (DeepSeek-V2's query: its rotary part written back beside the
    rest) as the concatenation of the input's parts around the source. TVM's slice_scatter is a select per element,
    which TVM's lowering of vectorized bf16 failed on ("IntImm can only take scalar, but boolx16 was supplied")."""
    data, source = (importer.env[arg] for arg in node.args[:2])
    shape = [int(dim) if isinstance(dim, int | tvm.tirx.IntImm) else None for dim in data.ty.shape]
    bounds = dict(zip(("dim", "start", "end", "step"), node.args[2:]))
    bounds.update({key: node.kwargs[key] for key in ("dim", "start", "end", "step") if key in node.kwargs})
    axis = bounds.get("dim", 0) % len(shape)
    if bounds.get("step", 1) != 1 or None in shape:
        return importer._slice_scatter(node)
    length = shape[axis]
    start, end = (_bound(bounds.get(key), default, length) for key, default in (("start", 0), ("end", length)))
    parts = [relax.op.strided_slice(data, [axis], [0], [start])] if start > 0 else []
    parts.append(source)
    parts += [relax.op.strided_slice(data, [axis], [end], [length])] if end < length else []
    return importer.block_builder.emit(relax.op.concat(parts, axis) if len(parts) > 1 else source)


def _bound(value, default: int, length: int) -> int:
    """A slice bound as PyTorch reads it: None the default, negative from the end, clamped to [0, length]."""
    value = default if value is None else int(value)
    return min(max(value + length if value < 0 else value, 0), length)


def _full_like(node, importer) -> relax.Expr:
    """aten.full_like (zeros_like after decomposition: Llama 4's attention masks) as a constant of the result's
    static shape and dtype: TVM's full_like without a dtype failed its legalization ("argument of type 'PrimType'
    is not iterable"). Symbolic shapes, tensor fill values and dtypes numpy lacks (bf16) go to TVM's converter."""
    value = node.meta["val"]
    dtype = str(value.dtype).removeprefix("torch.")
    fill = node.args[1]
    static = all(isinstance(dim, int) for dim in value.shape) and isinstance(fill, int | float | bool)
    if not static or dtype not in NUMPY_DTYPES:
        return importer._full_like(node)
    return relax.const(np.full(tuple(value.shape), fill, dtype=dtype))


def _grid_sample(node, importer) -> relax.Var:
    """aten.grid_sampler_2d (F.grid_sample) with its grid moved to the layout TVM's grid_sample reads: (N, 2, H, W)
    where PyTorch's is (N, H, W, 2). TVM's importer passed PyTorch's on, and sampled at the wrong places into an
    output of the wrong shape."""
    data, grid = (importer.env[arg] for arg in node.args[:2])
    interpolation, padding, align_corners = (*node.args[2:], 0, 0, False)[:3]
    return importer.block_builder.emit(relax.op.image.grid_sample(
        data, importer.block_builder.emit(relax.op.permute_dims(grid, [0, 3, 1, 2])),
        method=("bilinear", "nearest", "bicubic")[interpolation], layout="NCHW",
        padding_mode=("zeros", "border", "reflection")[padding], align_corners=bool(align_corners)))


def _advanced_index(node, importer) -> relax.Var:
    """aten.index.Tensor (x[:, :, rows, cols]) with NumPy's rules: the index tensors broadcast together, their
    shape replaces the indexed axes where those are adjacent, else leads. TVM's importer broadcast each sliced
    axis's positions against the index tensors instead, which fails or gathers other elements unless the index
    tensors have one shape (F.unfold's (3, 4, 1, 1) rows and (3, 4) columns failed to import)."""
    data, indices = importer.env[node.args[0]], [importer.env[i] if i is not None else None for i in node.args[1]]
    indexed = [axis for axis, index in enumerate(indices) if index is not None]
    if len(indexed) == 1:
        return importer.block_builder.emit(relax.op.take(data, indices[indexed[0]], axis=indexed[0]))
    emit, rank = importer.block_builder.emit, len(node.meta["val"].shape)
    kept = [axis for axis in range(data.ty.ndim) if axis not in indexed]
    leading = emit(relax.op.permute_dims(data, indexed + kept))
    shape = [int(d) for d in _broadcast_shape(node, indexed)]
    gathered = emit(relax.op.index_tensor(leading, [emit(relax.op.broadcast_to(indices[axis], shape))
                                                    for axis in indexed]))
    if indexed != list(range(indexed[0], indexed[-1] + 1)) or indexed[0] == 0:
        return gathered  # the broadcast shape leads: NumPy's rule for indices apart (or already first)
    before = len([axis for axis in kept if axis < indexed[0]])
    order = [*range(len(shape), len(shape) + before), *range(len(shape)), *range(len(shape) + before, rank)]
    return emit(relax.op.permute_dims(gathered, order))


def _broadcast_shape(node, indexed: list[int]) -> tuple:
    """The shape the index tensors of an aten.index.Tensor at `indexed` broadcast to."""
    import torch

    return tuple(torch.broadcast_shapes(*(tuple(node.args[1][axis].meta["val"].shape) for axis in indexed)))


def _extremum(node, importer) -> relax.Var:
    """aten.amax / aten.amin (x.amax(dim), a numerically stable softmax's or a pooling's max), which TVM's importer
    lacks: relax's max / min over `dim` (every axis where it is empty)."""
    data = importer.env[node.args[0]]
    dims = list(node.args[1]) if len(node.args) > 1 and node.args[1] else None
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    reduce = relax.op.max if "amax" in str(node.target) else relax.op.min
    return importer.block_builder.emit(reduce(data, axis=dims, keepdims=keepdim))


def _unfold(node, importer) -> relax.Var:
    """aten.unfold (Tensor.unfold(dim, size, step): windows sliding along one axis, a new last axis holding each
    window's positions; HaloNet's halo blocks), which TVM's importer lacks: a take of every window's positions
    along `dim` (a constant [windows, size] index), the positions' axis moved last."""
    data = importer.env[node.args[0]]
    dim, size, step = (int(arg) for arg in node.args[1:4])
    rank = data.ty.ndim
    dim %= rank
    windows = node.meta["val"].shape[dim]
    if not isinstance(windows, int):
        raise ModelLoadError(f"aten.unfold over axis {dim} of symbolic length: its windows are not static")
    positions = np.arange(windows)[:, None] * step + np.arange(size)[None, :]
    emit = importer.block_builder.emit
    taken = emit(relax.op.take(data, relax.const(positions, "int64"), axis=dim))
    return emit(relax.op.permute_dims(taken, [*range(dim + 1), *range(dim + 2, rank + 1), dim + 1]))


def _histogram(node, importer) -> relax.Var:
    """aten.histc of static bounds (min < max): the count of the input's values in each of `bins` equal bins, a
    value at `max` in the last, values outside uncounted, in the input's dtype. TVM's importer lacks it:
    transformers' `grouped_mm` experts count each expert's routed rows so."""
    data = importer.env[node.args[0]]
    bins, low, high = (*node.args[1:], 100, 0, 0)[:3]
    bins, low, high = int(node.kwargs.get("bins", bins)), node.kwargs.get("min", low), node.kwargs.get("max", high)
    if not low < high:
        raise ModelLoadError(f"aten.histc with min {low} and max {high}: bounds taken from the data are not static")
    dtype, emit = str(data.ty.dtype), importer.block_builder.emit
    flat = emit(relax.op.reshape(data, [-1]))
    offset = relax.op.multiply(relax.op.subtract(flat, relax.const(low, dtype)), relax.const(bins, dtype))
    scaled = relax.op.floor(relax.op.divide(offset, relax.const(high - low, dtype)))  # in PyTorch's order
    last = relax.op.where(relax.op.equal(flat, relax.const(high, dtype)), relax.const(bins - 1, dtype), scaled)
    inside = relax.op.logical_and(relax.op.greater_equal(flat, relax.const(low, dtype)),
                                  relax.op.less_equal(flat, relax.const(high, dtype)))
    column = relax.op.where(inside, last, relax.const(-1, dtype))  # a bin no value matches
    hits = relax.op.equal(relax.op.expand_dims(column, 1), relax.const(np.arange(bins, dtype=dtype)[None, :]))
    return emit(relax.op.sum(relax.op.astype(hits, dtype), axis=[0]))


def _grouped_matmul(node, importer) -> relax.Var:
    """transformers' grouped_mm_fallback and aten._grouped_mm (its `grouped_mm` experts: rows sorted by expert,
    `offs` each expert's end row) in the form `_expert_matmuls` writes: the (S, K) rows times every expert's
    weight side by side, (K, E * N), and each row's own expert's N outputs taken, that expert counted from
    `offs` (the ends at or before the row). The CPU backend computes only the taken products."""
    data, weight, ends = (importer.env[arg] for arg in node.args[:3])
    rows, depth = (int(extent) for extent in data.ty.shape)
    experts, _, width = (int(extent) for extent in weight.ty.shape)
    emit = importer.block_builder.emit
    every = emit(relax.op.reshape(relax.op.permute_dims(weight, [1, 0, 2]), [depth, experts * width]))
    positions = relax.const(np.arange(rows)[:, None], "int64")
    ended = relax.op.less_equal(relax.op.astype(relax.op.expand_dims(ends, 0), "int64"), positions)
    expert = relax.op.minimum(relax.op.sum(relax.op.astype(ended, "int64"), axis=[1]),
                              relax.const(experts - 1, "int64"))  # rows past the last end: no expert's rows
    own = relax.op.add(relax.const(np.arange(rows) * experts, "int64"), expert)
    products = emit(relax.op.reshape(emit(relax.op.matmul(data, every)), [rows * experts, width]))
    return emit(relax.op.take(products, emit(own), axis=0))


def _arange(node, importer) -> relax.Expr:
    """aten.arange of constant bounds with a negative step as the constant PyTorch computes: TVM's
    relax.arange(64, -64, -1) has 130 values (Funnel's relative positions did not import). Other aranges go to TVM's
    converter: made constants, T5's position buckets failed TVM's type check of a where (int32 against int64)."""
    import torch

    bounds = dict(zip(("start", "end", "step"), node.args if len(node.args) > 1 else (0, *node.args)))
    bounds.update({key: node.kwargs[key] for key in ("start", "end", "step") if key in node.kwargs})
    step = bounds.get("step", 1)
    if any(isinstance(bound, torch.fx.Node) for bound in bounds.values()) or step > 0:
        return importer._arange(node)
    values = torch.arange(bounds["start"], bounds["end"], step, dtype=node.meta["val"].dtype)
    return relax.const(values.numpy())


# converters TVM's importer takes in place of its own (custom_convert_map), by op name
CONVERTERS = {
    **dict.fromkeys(("arange.default", "arange.start", "arange.start_step"), _arange),
    "upsample_nearest2d.vec": _nearest_upsample,
    "grid_sampler_2d.default": _grid_sample,
    "index.Tensor": _advanced_index,
    "amax.default": _extremum,
    "amin.default": _extremum,
    "cumsum.default": _cumulative_sum,
    "unfold.default": _unfold,
    "histc.default": _histogram,
    **dict.fromkeys(("grouped_mm_fallback.default", "_grouped_mm.default"), _grouped_matmul),
    "full_like.default": _full_like,
    "slice_scatter.default": _slice_scatter,
    **dict.fromkeys(("div.Tensor", "div.Scalar", "div.Tensor_mode", "div.Scalar_mode", "floor_divide.default"),
                    _division),
}
