"""ONNX Runtime's MatMulNBits (weights of a few bits in blocks) as a MatMul by the weights it holds, dequantized.

ONNX Runtime GenAI's model builder (`-p int4`) and ONNX Runtime's MatMulNBitsQuantizer write each linear layer of
an LLM as one com.microsoft MatMulNBits node: B [N, blocks, block_size x bits / 8] packs the codes of the
transposed weight (the low bits of each byte first), one scale per block of `block_size` codes along K and output
column, zero points packed the same way (or as floats; by default the middle code, 2^(bits - 1)). TVM's importer
has no such op. `nbits_matmuls_as_onnx` writes each as MatMul(A, W) (+ bias) with W[k, n] = (code - zero point) x
scale computed here: the weights ONNX Runtime's kernels compute with. The model then takes any relay_amp dtype;
`int4w` packs them again in relay_amp's own int4 layout.
"""

import numpy as np

from ._onnx_graph import Writer, constant_values, node_attributes, node_label, rewrite_nodes
from .errors import ModelLoadError

CONTRIB = "com.microsoft"
INPUTS = ("A", "B", "scales", "zero_points", "g_idx", "bias")
BITS = (2, 4, 8)  # code widths that divide a byte


def nbits_matmuls_as_onnx(proto):
    """`proto` with each MatMulNBits node a MatMul by its dequantized weights (a copy; `proto` is unchanged), or
    ModelLoadError naming a node it cannot dequantize."""
    if not any(node.op_type == "MatMulNBits" and node.domain == CONTRIB for node in proto.graph.node):
        return proto
    constants = constant_values(proto.graph)
    return rewrite_nodes(proto, ["MatMulNBits"], lambda node, writer: _matmul(node, writer, constants), [CONTRIB])


def _matmul(node, writer: Writer, constants: dict) -> None:
    label = node_label(node)
    named = dict(zip(INPUTS, [*node.input, *[""] * len(INPUTS)]))
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
    weight = dequantized(constants[named["B"]], scales, constants.get(named["zero_points"]), attributes)
    product = writer.op("MatMul", named["A"], writer.const(weight.T, scales.dtype))
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
    codes = unpacked(packed, bits).reshape(columns, blocks * block)
    if zero_points is None:
        points = np.full((columns, blocks), 2 ** (bits - 1), "float32")
    elif np.issubdtype(zero_points.dtype, np.floating):
        points = zero_points.reshape(columns, blocks).astype("float32")
    else:
        points = unpacked(zero_points, bits).reshape(columns, -1)[:, :blocks].astype("float32")
    steps = scales.reshape(columns, blocks).astype("float32")
    values = (codes.reshape(columns, blocks, block) - points[..., None]) * steps[..., None]
    return values.reshape(columns, blocks * block)[:, :depth]


def unpacked(packed: np.ndarray, bits: int) -> np.ndarray:
    """The codes of `bits` bits each packed in bytes, lowest bits first, as float32 (the last axis widened)."""
    shifts = np.arange(0, 8, bits, dtype="uint8")
    codes = (packed.astype("uint8")[..., None] >> shifts) & np.uint8(2 ** bits - 1)
    return codes.reshape(*packed.shape[:-1], -1).astype("float32")
