"""ONNX operators of old opsets, and attributes TVM's Relax importer refuses, written the way it reads them.

Upsample (opsets 7-9, replaced by Resize in opset 10) took its scales as an attribute in opset 7 and as an input
from opset 9. TVM's importer reads the attribute only, so every Upsample of an opset-9 file (an older exporter's
nearest or bilinear upsampling: the TorchScript exporter at opset 9, keras2onnx, tf2onnx) failed to import.
`upsamples_with_attribute_scales` moves constant scales into the attribute. The importer writes an Upsample as
`resize2d` with asymmetric coordinates (ONNX's), but rounds a nearest-neighbour source index to the nearest
integer where ONNX rounds it down: a 2x upsampling of [a, b, c, d] read [a, a, b, b, c, c, d, d] in ONNX Runtime
and [a, a, b, c, c, c, d, d] once imported. `nearest_upsamples_rounded_down` rounds those down. TVM's Resize
converter never rounds to nearest (ONNX's Resize names its rounding), so only an Upsample's resize2d has that
rounding.

TVM's importer refuses a TopK of `sorted=0` (Dots1's and GLM-4-MoE's expert routers, exported by the dynamo
exporter from `torch.topk(..., sorted=False)`). ONNX leaves such a TopK's output order unspecified, so sorted output
is one of its readings: `topks_sorted` drops the attribute (its default is sorted).

TVM's importer writes a Tile of constant repeats as a call of topi's tile PrimFunc, which relay_amp's passes cannot
read through. A token repeated once per routed expert (transformers' batched_mm experts through the TorchScript
exporter: Unsqueeze, then Tile) hid the repeat from relay_amp._expert_matmuls, so each token's row was copied k
times, and quantize's per-row codes computed k times (the zoo's Qwen3-MoE: 1024 rows for 128 tokens). A Tile that
repeats only axes of extent 1 is an Expand to its repeats: `unit_tiles_as_expands` writes it so (Relax's
broadcast_to) where the input's shape is static (TVM's Expand fails on symbolic dims; size them at import).
"""

import numpy as np
import tvm
from tvm import relax

from ._ir import rewrite_op_calls
from ._onnx_graph import Writer, constant_values, inferred_values, node_attributes, rewrite_nodes, writable
from .errors import ModelLoadError

UPSAMPLED_AXES = 2  # TVM's importer upsamples the last two axes of a 4-D (NCHW) tensor
UPSAMPLE_CHECK_WARNING = r"(?s).*OpType: Upsample"  # ONNX's checker on an opset-7 Upsample in a later opset


def upsamples_with_attribute_scales(proto):
    """`proto` (`writable`'s copy, where it has any Upsample) with each Upsample's constant scales input (opset 9)
    as its `scales` attribute (opset 7), the scales checked to be what TVM's importer takes."""
    import onnx

    if not has_upsamples(proto):
        return proto
    constants, values = constant_values(proto.graph), inferred_values(proto)
    rewritten = writable(proto)
    for node in rewritten.graph.node:
        if node.op_type != "Upsample":
            continue
        scales, mode = _checked(node, _scales(node, constants), values.get(node.input[0])), _mode(node)
        del node.input[1:]
        del node.attribute[:]  # the scales, and the mode (default: nearest), written again
        node.attribute.extend([onnx.helper.make_attribute("scales", scales),
                               onnx.helper.make_attribute("mode", mode)])
    return rewritten


def topks_sorted(proto):
    """`proto` (`writable`'s copy, where it has any) with each TopK of sorted=0 sorted: its order is unspecified."""
    unsorted = [index for index, node in enumerate(proto.graph.node)
                if node.op_type == "TopK" and _attribute(node, "sorted") == 0]
    if not unsorted:
        return proto
    rewritten = writable(proto)
    for index in unsorted:
        node = rewritten.graph.node[index]
        kept = [attribute for attribute in node.attribute if attribute.name != "sorted"]
        del node.attribute[:]
        node.attribute.extend(kept)
    return rewritten


def unit_tiles_as_expands(proto):
    """`proto` (`writable`'s copy, where it has any Tile) with each Tile of constant repeats that repeats only axes of
    extent 1 of a static shape an Expand to its repeats."""
    if not any(node.op_type == "Tile" for node in proto.graph.node):
        return proto
    constants, values = constant_values(proto.graph), inferred_values(proto)
    return rewrite_nodes(proto, ["Tile"], lambda node, writer: _unit_tile(node, writer, constants, values))


def _unit_tile(node, writer: Writer, constants, values: dict) -> None:
    """An Expand of the Tile `node`'s input to its repeats where that input's shape is static and each axis it
    repeats has extent 1 (TVM's Expand fails on symbolic dims); else the node itself."""
    dims = values.get(node.input[0], (None, None))[0]
    repeats = constants[node.input[1]].tolist() if node.input[1] in constants else None
    if dims is None or None in dims or repeats is None or any(
            repeat != 1 and dim != 1 for dim, repeat in zip(dims, repeats)):
        writer.nodes.append(node)
        return
    writer.op("Expand", node.input[0], writer.const(repeats), out=node.output[0])


def _attribute(node, name: str):
    return node_attributes(node).get(name)


def _mode(node) -> str:
    mode = _attribute(node, "mode")
    return "nearest" if mode is None else mode.decode()


def _scales(node, constants: dict[str, np.ndarray]) -> list[float]:
    """An Upsample node's scales: its attribute (opset 7) or its constant input (opset 9)."""
    if len(node.input) < 2:
        return [float(s) for s in _attribute(node, "scales") or []]
    if node.input[1] not in constants:
        raise ModelLoadError(f"Upsample node {node.name!r}: its scales ({node.input[1]!r}) are computed at run time; "
                             "relay_amp imports constant scales only")
    return [float(s) for s in constants[node.input[1]].reshape(-1)]


def _checked(node, scales: list[float], value: tuple | None) -> list[float]:
    """`scales`, where TVM's importer computes them as ONNX does: the last two axes of a 4-D tensor, each to a
    whole multiple of its size (the importer resizes by output size over input size, ONNX by the scale)."""
    if len(scales) != 2 + UPSAMPLED_AXES or scales[:2] != [1.0, 1.0]:
        raise ModelLoadError(f"Upsample node {node.name!r}: scales {scales}; relay_amp imports upsampling of the last "
                             f"two axes of a 4-D tensor (scales [1, 1, h, w])")
    dims = value[0] if value else [None] * len(scales)
    if any(dim is not None and dim * scale != int(dim * scale) for dim, scale in zip(dims, scales)):
        raise ModelLoadError(f"Upsample node {node.name!r}: scales {scales} of a tensor of shape {dims} give "
                             "outputs of fractional size, which relay_amp does not import")
    return scales


def nearest_upsamples_rounded_down(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` with each nearest-neighbour resize2d in asymmetric coordinates that rounds to nearest (TVM's import of
    an ONNX Upsample) rounding down, as ONNX's Upsample does."""
    return rewrite_op_calls(mod, func, {"relax.image.resize2d": _rounded_down})


def _rounded_down(call: relax.Call, _builder) -> relax.Expr | None:
    attrs = call.attrs
    if (attrs.method, attrs.coordinate_transformation_mode, attrs.rounding_method) != (
            "nearest_neighbor", "asymmetric", "round"):
        return None
    return relax.op.image.resize2d(call.args[0], call.args[1], list(attrs.roi), attrs.layout, attrs.method,
                                   attrs.coordinate_transformation_mode, "floor", attrs.cubic_alpha,
                                   attrs.cubic_exclude, attrs.extrapolation_value, attrs.out_dtype)


def has_upsamples(proto) -> bool:
    """Whether the ONNX model has Upsample nodes (opsets 7-9)."""
    return any(node.op_type == "Upsample" for node in proto.graph.node)
