"""Frontends: ONNX and PyTorch models to Relax IRModules with weights bound as constants."""

import contextlib
import logging
import math
import os
import warnings
from collections.abc import Mapping, Sequence

import tvm

from ._einsum import einsums_as_matmuls
from ._expert_matmuls import expert_matmuls_dense
from ._group_norm import group_norms_as_ops
from ._importer_errors import naming_failed_node
from ._layer_norm import layer_norms_as_ops
from ._ir import checked_dims, clamps_as_max_min, fold_weights
from ._onnx_graph import (constant_values, held_value, importing_file, importing_model, inferred_values, node_label,
                          rename_values, subgraphs, tensor_value, weights_as_inputs, writable)
from ._pads import pads_as_ops
from ._parallel_convs import merge_parallel_convs
from ._split_convs import split_convs_grouped
from ._torch_export import CONVERTERS, as_torch_runs_it, computed_from_weights
from ._variadic import variadic_ops_as_binary
from ._zero_addends import zero_addends_dropped
from .errors import MissingDependencyError, ModelLoadError
from .onnx_attention import attentions_as_matmuls
from .onnx_col2im import col2ims_as_onnx
from .onnx_contrib import contrib_ops_as_onnx
from .onnx_decoder import decoder_ops_as_onnx
from .onnx_grouped_experts import grouped_matmuls_dense
from .onnx_legacy import (UPSAMPLE_CHECK_WARNING, has_upsamples, nearest_upsamples_rounded_down, topks_sorted,
                          unit_tiles_as_expands, upsamples_with_attribute_scales)
from .onnx_moe import moe_ops_as_onnx
from .onnx_multihead import multihead_attentions_as_onnx
from .onnx_nbits import low_bit_dequantizes_folded, nbits_gathers_as_onnx, nbits_matmuls_as_onnx
from .onnx_quantized import as_qdq, constant_dequantizes_folded
from .onnx_recurrent import recurrences_unrolled
from .onnx_spectral import dfts_as_matmuls, stfts_as_convs
from .packed_int4 import with_dequantize_kernel

FOLD_ROUNDS = 4  # rounds of onnxscript's constant folding and optimization an ONNX import runs at most
# initializers of more values reach the simplifier and TVM's importer as inputs and are bound after (onnxscript folds
# no node with an input above 8192 values but a Transpose, which relay_amp._ir.fold_weights folds after binding)
WEIGHT_INPUT_VALUES = 4096
WEIGHT_PREFIX = "relay_amp_weight_"  # those inputs' names
VALUE_SIZED_OPS = ("NonZero", "NonMaxSuppression", "Unique", "Compress")  # outputs sized by the input's values
TINY_ADDEND = 1e-8  # onnxscript's no-op rules drop `x + c` and `x - c` for a scalar constant c this close to 0


def _load_onnx(model):
    """A ModelProto from a ModelProto or a path, or ModelLoadError. A file's large weights in external data stay on
    disk (importing_file reads each when it is needed)."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise ModelLoadError(f"ONNX model file not found: {path}")
    try:
        proto = onnx.load(path, load_external_data=False)
        _small_external_data_loaded(proto, os.path.dirname(path))
    except Exception as err:  # protobuf raises DecodeError, onnx raises its own types
        raise ModelLoadError(f"cannot parse ONNX model {path}: {err}") from err
    return proto


def _small_external_data_loaded(proto, model_dir: str) -> None:
    """Reads the external data of every tensor of `proto` but its large initializers (more than WEIGHT_INPUT_VALUES
    values), which reach TVM's importer as inputs: the simplifier and the importer read the rest."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    for tensor in _tensors(proto.graph, top=True):
        if uses_external_data(tensor):
            load_external_data_for_tensor(tensor, model_dir)
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]


def _tensors(graph, top: bool = False):
    """The tensors of `graph` and its subgraphs (initializers, node attributes), less the top graph's large
    initializers."""
    for tensor in graph.initializer:
        if not top or math.prod(tensor.dims) <= WEIGHT_INPUT_VALUES:
            yield tensor
    for node in graph.node:
        for attribute in node.attribute:
            yield from ([attribute.t] if attribute.HasField("t") else []) + list(attribute.tensors)
        for subgraph in subgraphs(node):
            yield from _tensors(subgraph)


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Silence a library's logger below ERROR (onnxscript logs every node it cannot evaluate ahead of time)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _rules_of_one_output():
    """onnxscript's default rewrite rules, less those whose pattern ends in several nodes (SlicesSplit), while the
    block runs. Its matcher tries such a rule at each candidate node by listing every node of the graph, so the
    rule cost time quadratic in the graph's size: 90 of 96 s importing a one-block-per-stage Sequencer2D (LSTMs
    over rows and columns), Sequencer2D-S 434 -> 66 s, Swin-T 6.7 -> 2.5 s. The graph TVM imported was the same
    without it on the 16 zoo and timm models compared (the rule's check rejects most pairs of slices)."""
    from onnxscript import rewriter
    rules = rewriter._DEFAULT_REWRITE_RULES  # read by optimize_ir at each call: no argument selects rules
    rewriter._DEFAULT_REWRITE_RULES = tuple(rule for rule in rules if len(rule._target_pattern.output_nodes) == 1)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def simplify_onnx(proto):
    """`proto` with its constant subgraphs folded by onnxscript's optimizer, ConstantOfShape included.

    Exporters compute masks and shapes from constants (the TorchScript exporter writes ConstantOfShape of an
    empty shape for a scalar, which TVM's importer cannot take); folding them leaves TVM plain constants. The
    passes repeat until the graph stops shrinking (at most FOLD_ROUNDS): one round left a ConstantOfShape whose
    shape the optimizer folded after it, so Swin's window pads stayed computed ("Dynamic pads are not supported").
    """
    from onnxscript import ir
    from onnxscript.optimizer import fold_constants_ir, optimize_ir

    model = ir.serde.deserialize_model(_tiny_addends_kept(proto))
    nodes = None
    with _quiet("onnxscript"), _rules_of_one_output():
        for _ in range(FOLD_ROUNDS):
            fold_constants_ir(model, should_fold=lambda node: True if node.op_type == "ConstantOfShape" else None)
            optimize_ir(model)
            _register_orphan_constants(model.graph)
            nodes, before = len(list(model.graph)), nodes
            if nodes == before:
                break
    return ir.serde.serialize_model(model)


def _tiny_addends_kept(proto):
    """`proto` with each nonzero scalar constant of at most TINY_ADDEND that an Add or Sub applies to a tensor of
    rank one or more given shape [1] (the same sum), which onnxscript's no-op rules leave alone: they took BERT's
    layer norm `variance + 1e-12` in exports before opset 17 for `variance`, and a row of zero variance then
    normalized to NaN instead of 0. Operands of unknown rank keep their scalar (a [1] would add an axis to a
    scalar)."""
    import onnx
    from onnx import numpy_helper

    tiny = _tiny_scalars(proto.graph)
    if not tiny:
        return proto
    ranks = {name: len(dims) for name, (dims, _) in inferred_values(proto).items()}
    kept = onnx.ModelProto()
    kept.CopyFrom(proto)
    names = {tensor.name for tensor in kept.graph.initializer}
    for node in kept.graph.node:
        if node.op_type not in ("Add", "Sub") or len(node.input) != 2:
            continue
        for index, name in enumerate(node.input):
            if name in tiny and ranks.get(node.input[1 - index], 0) >= 1:
                node.input[index] = f"{name}_as_1d"
                if node.input[index] not in names:
                    names.add(node.input[index])
                    kept.graph.initializer.append(numpy_helper.from_array(tiny[name].reshape(1), node.input[index]))
    return kept


def _tiny_scalars(graph) -> dict:
    """Name -> value of the graph's scalar float constants (initializers, Constant nodes) of magnitude at most
    TINY_ADDEND, zero excepted."""
    return {name: value for name, value in constant_values(graph).items()
            if value.ndim == 0 and value.dtype.kind == "f" and 0 < abs(float(value)) <= TINY_ADDEND}


def _register_orphan_constants(graph) -> None:
    """Make initializers of the constants that nodes of `graph` read but nothing defines.

    onnxscript's reshape rewrites give each new shape the name of the shape they replace. Two reshapes that shared
    one shape then leave one of the new shapes unregistered, under a renamed name (onnxscript issue 2945): DETR's
    encoder and decoder flatten the same mask, and TVM's importer failed with a KeyError on that name.
    """
    for node in graph:
        for value in node.inputs:
            if value is None or value.producer() is not None or value.const_value is None:
                continue
            if not value.is_initializer() and not value.is_graph_input():
                while value.name in graph.initializers:
                    value.name = f"{value.name}_orphan"
                graph.register_initializer(value)


def _simplified(proto):
    """simplify_onnx(proto), or proto itself (with a warning) where onnxscript fails."""
    try:
        return simplify_onnx(proto)
    except Exception as err:  # an optimizer failure must not stop an import that TVM may manage alone
        warnings.warn(f"ONNX simplification skipped for {proto.graph.name!r}: {err}", stacklevel=3)
        return proto


def onnx_symbolic_dims(proto) -> list[str]:
    """The names of the symbolic dims (dim_param) of an ONNX model's inputs, in order of first appearance."""
    names = [dim.dim_param for tensor in proto.graph.input for dim in tensor.type.tensor_type.shape.dim]
    return list(dict.fromkeys(name for name in names if name))


def _with_dims(proto, dims: Mapping[str, int]):
    """`proto` (`writable`'s copy) whose symbolic dims named in `dims` have those sizes: in its inputs, and in the
    outputs and value infos an exporter wrote with the same names (GenAI's builder: ["batch_size",
    "sequence_length", 384])."""
    sizes = checked_dims(dims, onnx_symbolic_dims(proto))
    bound = writable(proto)
    for tensor in [*bound.graph.input, *bound.graph.value_info, *bound.graph.output]:
        for dim in tensor.type.tensor_type.shape.dim:
            if dim.dim_param in sizes:
                dim.dim_value = sizes[dim.dim_param]
    return bound


def from_onnx(model, shape_dict: dict[str, Sequence[int]] | None = None,
              dims: Mapping[str, int] | None = None) -> tvm.IRModule:
    """Import an ONNX model (a path or a ModelProto) into Relax, constant shapes folded, weights bound as constants
    (and those the graph computes from constants folded: relay_amp._ir.fold_weights), batch norms the
    exporter left after convs and linear layers folded into their weights, parallel conv branches of one input
    summed (RepVGG, MobileOne) as one conv, group norms as one op, clamps (ReLU6) as
    maximum and minimum, pads as relax.nn.pad, QOperator and integer ops as QDQ pairs around float ops, dequantized
    scalar constants as float constants, LSTM, GRU and RNN nodes unrolled over their static sequence length,
    STFT and DFT nodes as a conv and a matmul by their DFT basis, opset 23's Attention as its matmuls and softmax,
    ONNX Runtime's fused norms, matmuls and activations (its transformer optimizer's), its MultiHeadAttention, and
    its GroupQueryAttention and RotaryEmbedding (GenAI's model builder's) as ONNX ops, MatMulNBits as a MatMul by
    its weights (4-bit ones held packed: relay_amp.packed_int4), dequantizes of 2- and 4-bit constants folded,
    opset-9 Upsample nodes' scales read as opset 7's attribute. `dims` sizes the inputs' symbolic dims by name
    ({"batch": 1}: an export's dynamic axes), before shapes are folded."""
    import onnx

    proto = _load_onnx(model)
    owned = proto is not model  # read from a file: rewritten in place, its large weights read when bound
    with importing_file(os.path.dirname(os.fspath(model))) if owned else importing_model():
        proto = _with_dims(proto, dims) if dims else proto
        try:
            proto = _as_onnx_ops(proto)  # first: the checker refuses ONNX Runtime's ops in ONNX's own domain
            onnx.checker.check_model(weights_as_inputs(proto, WEIGHT_INPUT_VALUES))  # over 2 GB: not serializable
            with warnings.catch_warnings():  # TVM's importer checks the graph again: opset 7's Upsample in a later one
                warnings.filterwarnings("ignore", message=UPSAMPLE_CHECK_WARNING)
                shapes = {**_empty_inputs(proto), **(shape_dict or {})}
                proto = _as_tvm_reads(proto)
                imported = _imported_with_weights(proto, shapes)
        except Exception as err:  # the checker and the importer raise many error types
            raise ModelLoadError(f"cannot import ONNX model {proto.graph.name!r}: {err}{_sizing_hint(proto)}"
                                 f"{_value_sizes_hint(proto)}") from err
    if has_upsamples(proto):
        imported = nearest_upsamples_rounded_down(imported)
    return _canonical(imported)


def _imported_with_weights(proto, shapes: dict) -> tvm.IRModule:
    """TVM's import of `proto` with its large weights apart: the graph, simplified (then its recurrences unrolled,
    relay_amp.onnx_recurrent), reaches TVM's importer with them as typed inputs (named as TVM keeps names, without a
    warning each), and each is bound as a constant after: one copy of the weights at a time, and no serialization of
    a model over protobuf's 2 GB."""
    from tvm.relax.frontend.onnx import from_onnx as relax_from_onnx

    lean = weights_as_inputs(proto, WEIGHT_INPUT_VALUES)
    constants = {tensor.name for tensor in lean.graph.initializer}  # before IR 4 these are listed as inputs too
    weights = {tensor.name: tensor for tensor in proto.graph.initializer if tensor.name not in constants}
    names = {value.name: f"{WEIGHT_PREFIX}{index}" for index, value in enumerate(lean.graph.input)
             if value.name in weights}
    rename_values(lean.graph, names)
    graph = upsamples_with_attribute_scales(recurrences_unrolled(_simplified(lean)))
    with naming_failed_node():
        imported = relax_from_onnx(graph, shape_dict=shapes, keep_params_in_input=False)
    params = imported["main"].params
    inputs = [value.name for value in graph.graph.input if value.name not in constants]
    if len(inputs) != len(params):
        raise ModelLoadError(f"TVM's importer made {len(params)} parameters of {len(inputs)} graph inputs")
    originals = {name: original for original, name in names.items()}
    bound = {param: weights[originals[name]] for param, name in zip(params, inputs) if name in originals}
    if not bound:
        return imported
    imported, values = _bound_values(imported, bound)
    main = imported["main"].bind_params(values)  # TVM's importer counted the weights among the inputs
    imported["main"] = main.with_attr("num_input", len(main.params)) if "num_input" in main.attrs else main
    return imported


def _bound_values(mod: tvm.IRModule, tensors: dict) -> tuple[tvm.IRModule, dict]:
    """`mod` with the dequantization PrimFuncs of the weights held packed, and {param: the value it is bound to}:
    a constant, or a call of such a PrimFunc on a packed weight's constants (an int4 file's bytes, not fp32)."""
    values = {}
    for param, tensor in tensors.items():
        held = held_value(tensor)
        if held is None:
            values[param] = _tensor(tensor)
        else:
            mod, kernel = with_dequantize_kernel(mod, held.spec)
            values[param] = held.call(kernel)
    return mod, values


def _tensor(tensor) -> tvm.runtime.Tensor:
    """An ONNX initializer's value as a TVM tensor, as TVM's importer makes one."""
    return tvm.runtime.tensor(tensor_value(tensor).reshape(tuple(tensor.dims)))


def _as_onnx_ops(proto):
    """`proto` with ONNX Runtime's ops and the low-bit weights TVM cannot hold written as ONNX ops it reads."""
    for rewrite in (nbits_gathers_as_onnx, contrib_ops_as_onnx, multihead_attentions_as_onnx, moe_ops_as_onnx,
                    decoder_ops_as_onnx, nbits_matmuls_as_onnx, low_bit_dequantizes_folded):
        proto = rewrite(proto)
    return proto


def _empty_inputs(proto) -> dict[str, list[int]]:
    """The static shapes of the inputs with a dim of 0 (an empty key/value cache), which TVM's importer would read
    as symbolic dims (it takes a dim of 0 for one without a value)."""
    shapes = {}
    for value in proto.graph.input:
        dims = value.type.tensor_type.shape.dim
        if any(dim.HasField("dim_value") and dim.dim_value == 0 for dim in dims) and all(
                dim.HasField("dim_value") for dim in dims):
            shapes[value.name] = [dim.dim_value for dim in dims]
    return shapes


def _as_tvm_reads(proto):
    """`proto` with the ops TVM's importer lacks or misreads written as ops it reads (those that read the weights'
    values; simplification, then the recurrences' unrolling and Upsample's scales, follow on the graph without its
    large weights)."""
    dequantized = constant_dequantizes_folded(as_qdq(proto))
    return grouped_matmuls_dense(unit_tiles_as_expands(topks_sorted(col2ims_as_onnx(dfts_as_matmuls(stfts_as_convs(
        attentions_as_matmuls(dequantized)))))))


def _sizing_hint(proto) -> str:
    """Where `proto` still has symbolic input dims, how to size them: TVM's importer fails on some shape
    computations over them (a dynamic LLaMA export's causal mask: "shape_of expects a tensor input") that fold
    away once they are sized."""
    names = onnx_symbolic_dims(proto)
    if not names:
        return ""
    example = ", ".join(f'"{name}": ...' for name in names)
    return (f" (its inputs have symbolic dims {names}; where the importer fails on shapes computed from them, "
            f"size them at import: from_onnx(..., dims={{{example}}}), or --dim on the command line)")


def _value_sizes_hint(proto) -> str:
    """Where `proto` sizes tensors by their values (a detector's post-processing: boxes above a score threshold,
    the best k of them, NMS), what to do: TVM's importer fails on the shapes computed from such sizes ("cannot
    handle ShapeExpr inputs", "TopK k must be a constant")."""
    found = _value_sized_nodes(proto.graph)
    if not found:
        return ""
    named = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
    return (f" (its graph sizes tensors by their values: {named}, as a detector's post-processing does; where the "
            f"importer fails there, import the part before it: export the model without it (a torchvision "
            f"detector's backbone and head), or cut the file with onnx.utils.extract_model, and run the rest in "
            f"its framework)")


def _value_sized_nodes(graph) -> "list[str]":
    """How errors name (node_label) each node of `graph` and its subgraphs whose outputs are sized by values:
    VALUE_SIZED_OPS, and TopK of a k the graph computes."""
    constants = constant_values(graph)
    found = []
    for node in graph.node:
        if node.op_type in VALUE_SIZED_OPS or (node.op_type == "TopK" and node.input[1:2] and
                                               node.input[1] not in constants):
            found.append(node_label(node))
        for subgraph in subgraphs(node):
            found.extend(_value_sized_nodes(subgraph))
    return found


def from_torch(module, example_inputs: Sequence) -> tvm.IRModule:
    """Import a torch.nn.Module through torch.export in eval mode (a module in training mode is put back in it),
    weights bound as constants (and those computed from constants folded; ops TVM's importer lacks that read
    weights alone computed by PyTorch), batch norms folded into convs and linear layers, parallel conv branches as
    one conv, clamps (ReLU6, hardtanh) as maximum and minimum."""
    try:
        import torch
        from tvm.relax.frontend.torch import from_exported_program
        from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter
    except ImportError as err:
        raise MissingDependencyError(
            "from_torch needs PyTorch: pip install 'relay_amp[torch]'"
        ) from err
    inputs = tuple(torch.as_tensor(x) for x in example_inputs)
    name, training = type(module).__name__, getattr(module, "training", False)
    try:
        with torch.no_grad():
            exported = torch.export.export(module.eval(), inputs)
        as_torch_runs_it(exported.graph)
        decomposed = exported.run_decompositions()  # as TVM's importer would: the ops it converts
        converters = {**computed_from_weights(decomposed, {*ExportedProgramImporter().convert_map, *CONVERTERS}),
                      **CONVERTERS}
        with naming_failed_node():
            imported = from_exported_program(decomposed, unwrap_unit_return_tuple=True,
                                             custom_convert_map=converters, run_ep_decomposition=False)
    except Exception as err:  # torch.export and TVM's importer raise many error types
        raise ModelLoadError(f"cannot import torch module {name}: {type(err).__name__}: {err}") from err
    finally:
        if training:
            module.train()  # the caller's module as it came: exported in eval mode, returned in training mode
    return _canonical(imported)


def _canonical(imported: tvm.IRModule) -> tvm.IRModule:
    """An imported module in the form relay_amp's passes match: einsums of two tensors as matmuls, values computed
    from constants folded (batch norms into weights), the matmuls of expert weights gathered per row (a mixture of
    experts over at least as many rows as experts) as one matmul by every expert, parallel conv branches merged, the
    convs of a split's parts concatenated as one grouped conv, the exporters' group norm spellings as
    relax.nn.group_norm and their layer norms before opset 17 as relax.nn.layer_norm, clamps as maximum and minimum,
    ONNX pads as relax.nn.pad, variadic Max, Min, Sum and Mean as binary ops, adds of constant zeros (an exported
    attention's empty mask) dropped."""
    folded = expert_matmuls_dense(fold_weights(einsums_as_matmuls(imported)))
    merged = split_convs_grouped(merge_parallel_convs(folded))
    normalized = pads_as_ops(clamps_as_max_min(layer_norms_as_ops(group_norms_as_ops(merged))))
    return zero_addends_dropped(variadic_ops_as_binary(normalized))
