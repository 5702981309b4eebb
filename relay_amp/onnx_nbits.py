"""Weights of a few bits (ONNX Runtime's MatMulNBits, ONNX's int4 DequantizeLinear) at import.

ONNX Runtime GenAI's model builder (`-p int4`) and ONNX Runtime's MatMulNBitsQuantizer write each linear layer of
an LLM as one com.microsoft MatMulNBits node: B [N, blocks, block_size x bits / 8] packs the codes of the
transposed weight (the low bits of each byte first), one scale per block of `block_size` codes along K and output
column, zero points packed the same way (or as floats; by default the middle code, 2^(bits - 1)). TVM's importer
has no such op. `nbits_matmuls_as_onnx` writes each as MatMul(A, W) (+ bias) with W[k, n] = (code - zero point) x
scale: the weights ONNX Runtime's kernels compute with. Within an import, W is bound when the importer reads it:
4-bit codes in whole blocks of a multiple of 8 rows, 16-column blocks and fp32 scales (GenAI's and ONNX Runtime's
CPU files) are held packed (relay_amp.packed_int4: the codes repacked as they are, zero points kept), so the module
holds the file's bytes, not 8x them in fp32; a backend computes W in the dtype it is read in (AMP's bf16), and
`int4w` (quantize_weights) takes the codes themselves. Other weights are computed in fp32 as each is bound.

GenAI's int4 files of models whose embeddings are tied to the LM head (LLaMA 3.2, Qwen, Gemma, LFM2) look each token
up in the head's codes with a com.microsoft GatherBlockQuantized: the rows of a uint8 table of packed codes, a
scale per block of `block_size` along each row (zero points packed the same way, or the middle code). TVM's
importer has no such op either. `nbits_gathers_as_onnx` writes each as a Gather of the packed rows and of their
scales, the codes unpacked by shifts and masks and dequantized in the graph: the table stays in bytes.

ONNX's own int4 weights (a DequantizeLinear of an INT4 or UINT4 constant, per tensor, per axis or in blocks:
opset 21's QDQ form, which ONNX Runtime's quantizer writes with `quant_format=QDQ`) failed to import too: TVM
cannot hold a 4-bit tensor ("TensorCopyFromBytes: size mismatch"). `low_bit_dequantizes_folded` replaces each
such node by the constant it computes.
"""

import numpy as np

from ._onnx_graph import (Writer, constant_values, inferred_values, known_dims, named_inputs, node_attributes,
                          node_label, rewrite_nodes)
from .errors import ModelLoadError
from .packed_int4 import COLUMNS, ROWS_PER_WORD, ZERO_POINT, PackedWeight, pack_nibbles

CONTRIB = "com.microsoft"
LOW_BIT_TYPES = (21, 22, 25, 26)  # onnx.TensorProto's UINT4, INT4, UINT2, INT2: element types TVM cannot hold
INPUTS = ("A", "B", "scales", "zero_points", "g_idx", "bias")
BITS = (2, 4, 8)  # code widths that divide a byte
GATHER_INPUTS = ("data", "indices", "scales", "zero_points")
FLOAT = 1  # onnx.TensorProto.FLOAT


def nbits_matmuls_as_onnx(proto):
    """`proto` with each MatMulNBits node a MatMul by its dequantized weights (a copy; `proto` is unchanged), or
    ModelLoadError naming a node it cannot dequantize."""
    if not any(node.op_type == "MatMulNBits" and node.domain == CONTRIB for node in proto.graph.node):
        return proto
    constants = constant_values(proto.graph)
    return rewrite_nodes(proto, ["MatMulNBits"], lambda node, writer: _matmul(node, writer, constants), [CONTRIB])


def _matmul(node, writer: Writer, constants: dict) -> None:
    label = node_label(node)
    named = named_inputs(node, INPUTS)
    missing = [name for name in ("B", "scales", "zero_points") if named[name] and named[name] not in constants]
    if missing or named["g_idx"]:
        reason = f"non-constant {', '.join(missing)}" if missing else "g_idx (act-order)"
        raise ModelLoadError(f"{label}: relay_amp dequantizes MatMulNBits weights that are constants, without "
                             f"g_idx; this one has {reason}")
    attributes = node_attributes(node)
    if attributes.get("bits", 4) not in BITS:
        raise ModelLoadError(f"{label}: relay_amp unpacks codes of {', '.join(map(str, BITS))} bits, not "
                             f"{attributes['bits']}")
    scales = constants[named["scales"]]
    weight = writer.computed_const(
        lambda: np.ascontiguousarray(
            dequantized(constants[named["B"]], scales, constants.get(named["zero_points"]), attributes).T),
        [attributes["K"], attributes["N"]], scales.dtype,
        held=lambda: held_packed(constants[named["B"]], scales, constants.get(named["zero_points"]), attributes)
        if packable(attributes, scales.dtype) else None)
    product = writer.op("MatMul", named["A"], weight)
    if named["bias"]:
        writer.op("Add", product, named["bias"], out=node.output[0])
    else:
        writer.op("Identity", product, out=node.output[0])


def dequantized(packed: np.ndarray, scales: np.ndarray, zero_points: "np.ndarray | None",
                attributes: dict) -> np.ndarray:
    """The [N, K] weight a MatMulNBits node's packed codes, scales and zero points hold."""
    bits, block, depth, columns = (attributes.get("bits", 4), attributes["block_size"], attributes["K"],
                                   attributes["N"])
    blocks = -(-depth // block)
    codes = unpacked(packed, bits).astype("float32").reshape(columns, blocks * block)
    if zero_points is None:
        points = np.full((columns, blocks), 2 ** (bits - 1), "float32")
    elif np.issubdtype(zero_points.dtype, np.floating):
        points = zero_points.reshape(columns, blocks).astype("float32")
    else:
        points = unpacked(zero_points, bits).reshape(columns, -1)[:, :blocks].astype("float32")
    steps = scales.reshape(columns, blocks).astype("float32")
    values = codes.reshape(columns, blocks, block)
    values -= points[..., None]  # in place: an LLM's output projection is hundreds of megabytes
    values *= steps[..., None]
    return values.reshape(columns, blocks * block)[:, :depth]


def packable(attributes: dict, dtype) -> bool:
    """Whether a MatMulNBits weight keeps its codes packed through import (relay_amp.packed_int4's layout): 4-bit
    codes in whole blocks of a multiple of 8 rows, columns in blocks of 16, fp32 scales."""
    depth, block = attributes["K"], attributes["block_size"]
    return (attributes.get("bits", 4) == 4 and depth % block == 0 and block % ROWS_PER_WORD == 0
            and attributes["N"] % COLUMNS == 0 and np.dtype(dtype) == np.float32)


def held_packed(packed: np.ndarray, scales: np.ndarray, zero_points: "np.ndarray | None",
                attributes: dict) -> PackedWeight:
    """A packable MatMulNBits weight as a PackedWeight: its codes repacked, scales and zero points transposed
    (integer zero points all 8, the default, read as symmetric codes)."""
    blocks, columns = attributes["K"] // attributes["block_size"], attributes["N"]
    nibbles = unpacked(packed, 4).reshape(columns, -1)
    steps = np.ascontiguousarray(scales.reshape(columns, blocks).T, dtype="float32")
    if zero_points is None:
        points = None
    elif np.issubdtype(zero_points.dtype, np.floating):
        points = zero_points.reshape(columns, blocks).T.astype("float32")
    else:
        points = unpacked(zero_points, 4).reshape(columns, -1)[:, :blocks].T.astype("float32")
    if points is not None and (points == ZERO_POINT).all():
        points = None
    return PackedWeight(pack_nibbles(nibbles.T), steps, None if points is None else np.ascontiguousarray(points))


def unpacked(packed: np.ndarray, bits: int) -> np.ndarray:
    """The codes of `bits` bits each packed in bytes, lowest bits first, as uint8 (the last axis widened)."""
    shifts = np.arange(0, 8, bits, dtype="uint8")
    codes = (packed.astype("uint8")[..., None] >> shifts) & np.uint8(2 ** bits - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def nbits_gathers_as_onnx(proto):
    """`proto` with each GatherBlockQuantized node a Gather of its packed rows, unpacked and dequantized (a copy;
    `proto` is unchanged), or ModelLoadError naming a node it does not unpack."""
    if not any(node.op_type == "GatherBlockQuantized" and node.domain == CONTRIB for node in proto.graph.node):
        return proto
    values = inferred_values(proto)
    return rewrite_nodes(proto, ["GatherBlockQuantized"], lambda node, writer: _gather(node, writer, values),
                         [CONTRIB])


def _gather(node, writer: Writer, values: dict) -> None:
    """Rows of a (rows, packed codes) uint8 table by the indices, each block of `block_size` codes (code - zero
    point) x its scale, shaped as the indices and the row's codes."""
    label, attributes, named = node_label(node), node_attributes(node), named_inputs(node, GATHER_INPUTS)
    (_, packed), dtype = known_dims(label, values, named["data"], ranks=(2,))
    bits, block = attributes.get("bits", 4), attributes.get("block_size", 128)
    columns = packed * 8 // bits
    axes = (attributes.get("gather_axis", 0) % 2, attributes.get("quantize_axis", 1) % 2)
    refused = [f"{np.dtype(dtype)} data"] if np.dtype(dtype) != np.uint8 else []
    refused += [f"{bits}-bit codes"] if bits not in BITS else []
    refused += [f"gather_axis {axes[0]} and quantize_axis {axes[1]}"] if axes != (0, 1) else []
    refused += [f"rows of {columns} codes in blocks of {block}"] if block <= 0 or columns % block else []
    if refused:
        raise ModelLoadError(f"{label}: relay_amp unpacks GatherBlockQuantized rows of uint8 codes gathered along "
                             f"axis 0, in whole blocks along axis 1; this one has {', '.join(refused)}")
    flat = writer.op("Reshape", named["indices"], writer.const([-1]))
    codes = _codes(writer, writer.op("Gather", named["data"], flat, axis=0), bits)
    blocked = writer.op("Reshape", codes, writer.const([-1, columns // block, block]))
    if named["zero_points"]:  # packed as the codes, one per block: each row's first columns // block
        every = _codes(writer, writer.op("Gather", named["zero_points"], flat, axis=0), bits)
        points = writer.op("Unsqueeze", writer.op("Slice", every, writer.const([0]), writer.const([columns // block]),
                                                  writer.const([1])), writer.const([-1]))
    else:
        points = writer.const(2 ** (bits - 1), "float32")
    shifted = writer.op("Sub", blocked, points)
    scales = writer.op("Unsqueeze", writer.op("Gather", named["scales"], flat, axis=0), writer.const([-1]))
    values = writer.op("Mul", writer.op("CastLike", shifted, scales), scales)
    shape = writer.op("Concat", writer.op("Shape", named["indices"]), writer.const([columns]), axis=0)
    writer.op("Reshape", values, shape, out=node.output[0])


def _codes(writer: Writer, packed: str, bits: int) -> str:
    """Packed (rows, bytes) uint8 codes as (rows, codes) fp32, each byte's lowest bits first."""
    if bits == 8:
        return writer.op("Cast", packed, to=FLOAT)
    shifts = writer.const(np.arange(0, 8, bits), "uint8")
    parts = writer.op("BitShift", writer.op("Unsqueeze", packed, writer.const([-1])), shifts, direction="RIGHT")
    masked = writer.op("BitwiseAnd", parts, writer.const(2 ** bits - 1, "uint8"))
    return writer.op("Cast", writer.op("Reshape", masked, writer.const([0, -1])), to=FLOAT)


def low_bit_dequantizes_folded(proto):
    """`proto` with each DequantizeLinear of a constant of 2 or 4 bits a constant of the values it computes (a
    copy; `proto` is unchanged)."""
    low_bit = {tensor.name for tensor in proto.graph.initializer if tensor.data_type in LOW_BIT_TYPES}
    if not any(node.op_type == "DequantizeLinear" and node.input[0] in low_bit for node in proto.graph.node):
        return proto
    constants = constant_values(proto.graph)
    return rewrite_nodes(proto, ["DequantizeLinear"],
                         lambda node, writer: _folded_dequantize(node, writer, constants, low_bit))


def _folded_dequantize(node, writer: Writer, constants: dict, low_bit: set) -> None:
    inputs = [*node.input, "", ""]
    if inputs[0] not in low_bit:
        writer.nodes.append(node)
        return
    missing = [name for name in inputs[1:3] if name and name not in constants]
    if missing:
        raise ModelLoadError(f"{node_label(node)}: relay_amp folds a dequantize of 2- or 4-bit codes whose scale "
                             f"and zero point are constants; {', '.join(missing)} is not")
    attributes = node_attributes(node)
    codes = constants[inputs[0]].astype("float32")
    scale = constants[inputs[1]]
    points = constants[inputs[2]].astype("float32") if inputs[2] else np.zeros((), "float32")
    axis = attributes.get("axis", 1) % max(codes.ndim, 1)
    values = (codes - _spread(points, codes, axis, attributes)) * _spread(scale.astype("float32"), codes, axis,
                                                                          attributes)
    dtype = scale.dtype if "output_dtype" not in attributes else _element_dtype(attributes["output_dtype"])
    writer.op("Identity", writer.const(values, dtype), out=node.output[0])


def _spread(factor: np.ndarray, codes: np.ndarray, axis: int, attributes: dict) -> np.ndarray:
    """A per-tensor, per-axis or blocked scale or zero point broadcast to the codes' shape."""
    if factor.ndim == 0 or factor.size == 1:
        return factor.reshape(())
    block = attributes.get("block_size", 0)
    if block:
        return np.repeat(factor, block, axis=axis).take(range(codes.shape[axis]), axis=axis)
    shape = [1] * codes.ndim
    shape[axis] = codes.shape[axis]
    return factor.reshape(shape)


def _element_dtype(element: int) -> np.dtype:
    import onnx

    return onnx.helper.tensor_dtype_to_np_dtype(element)
