"""ONNX Runtime's contrib operators that its transformer optimizer writes, written as ONNX ops before import.

Files optimized by `onnxruntime.transformers.optimizer` (or Optimum's ORTOptimizer) fuse each residual add and
layer norm into a SkipLayerNormalization, RMS norms into (Skip)SimplifiedLayerNormalization, and scaled or
transposed matmuls into FusedMatMul. TVM's importer has no converter for most of these, and its
SkipLayerNormalization needs a beta and a bias and has no fourth output: the residual sum a pre-norm model (GPT-2,
LLaMA) reads, so such files failed to import. `contrib_ops_as_onnx` writes them as the ops an exporter would have
written (norms spelled out, which relay_amp's import folds into one layer norm), every output included:
- SkipLayerNormalization: sum = input + skip (+ bias); its layer norm with gamma (and beta); mean and inverse
  standard deviation; the sum (output 3);
- SkipSimplifiedLayerNormalization and SimplifiedLayerNormalization: the same with an RMS norm; LayerNormalization
  in files before opset 17 (ONNX Runtime's own, in ONNX's domain), spelled out;
- FusedMatMul: alpha times A (transposed) times B (transposed); BiasAdd: x + bias + skip; QuickGelu:
  x sigmoid(alpha x);
- Attention (BERT's and GPT-2's fused self-attention; TVM's converter refused its usual 2-D mask and
  `unidirectional`): the packed Q, K, V projection, heads, scores times the scale, plus mask_filter_value
  (-10000) where the mask (key lengths, or a 2-D or 3-D 0/1 mask) or the causal order excludes a key, plus the
  attention bias, a softmax and the heads joined again.
"""

import numpy as np

from ._onnx_graph import (Writer, constant_values, default_opset, inferred_values, node_attributes, node_label,
                          rewrite_nodes, value_info)
from .errors import ModelLoadError
from .onnx_attention import joined_heads, split_heads

CONTRIB = "com.microsoft"
SKIP_NORMS = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")
OPS = (*SKIP_NORMS, "SimplifiedLayerNormalization", "FusedMatMul", "BiasAdd", "QuickGelu", "Attention")
DOMAINS = (CONTRIB, "", "ai.onnx")  # ONNX Runtime registers SimplifiedLayerNormalization in ONNX's own domain
MASK_FILTER_VALUE = -10000.0  # what ONNX Runtime's Attention adds to a masked key's score unless told otherwise
ATTENTION_REFUSED = ("do_rotary", "past_present_share_buffer")
INT64, BOOL = 7, 9  # onnx.TensorProto's codes of the element types
AXES_AS_INPUT = 18  # the opset from which ReduceMean takes its axes as an input
LAYER_NORM_OPSET = 17  # ONNX's LayerNormalization; before it, ONNX Runtime's own in ONNX's domain
QUICK_GELU_ALPHA = 1.702


def contrib_ops_as_onnx(proto):
    """`proto` with ONNX Runtime's fused norm, matmul and activation ops written as ONNX ops (a copy; `proto` is
    unchanged), or ModelLoadError naming a node whose options it does not write."""
    opset = default_opset(proto)
    ops = OPS if opset >= LAYER_NORM_OPSET else (*OPS, "LayerNormalization")
    if not any(_is_contrib(node, ops) for node in proto.graph.node):
        return proto
    values = inferred_values(proto)
    rewritten = rewrite_nodes(proto, [op for op in ops if op != "Attention"],
                              lambda node, writer: _rewrite(node, writer, opset, values), DOMAINS)
    if not any(_is_contrib(node, ["Attention"]) for node in rewritten.graph.node):
        return rewritten
    values = inferred_values(rewritten, _attention_shapes)  # through the norms spelled out, and the attentions
    constants = constant_values(proto.graph)
    widths = {name: constants.dims(name)[-1] for name in constants if len(constants.dims(name)) == 2}
    return rewrite_nodes(rewritten, ["Attention"], lambda node, writer: _attention(node, writer, values, widths),
                         [CONTRIB])


def _attention_shapes(nodes, values: dict) -> list:
    """Value infos of the fused attentions' outputs, [batch, sequence, V's width], where their input's and
    weights' shapes are known (shape inference does not know ONNX Runtime's ops)."""
    infos = []
    for node in nodes:
        dims, dtype = values.get(node.input[0], (None, None)) if _is_contrib(node, ["Attention"]) else (None, None)
        weights = values.get(node.input[1], (None,))[0] if dims else None
        if dims is None or weights is None or None in weights:
            continue
        width = node_attributes(node).get("qkv_hidden_sizes", [weights[-1] // 3] * 3)[2]
        infos.append(value_info(node.output[0], [*dims[:-1], width], dtype))
    return infos


def _is_contrib(node, ops) -> bool:
    """Whether `node` is one of `ops` as ONNX Runtime writes it (its Attention only in its own domain: ONNX's own
    Attention is onnx_attention's)."""
    return node.op_type in ops and node.domain in (DOMAINS if node.op_type != "Attention" else (CONTRIB,))


def _rewrite(node, writer: Writer, opset: int, values: dict) -> None:
    attributes = node_attributes(node)
    label = node_label(node)
    inputs = [*node.input, "", "", ""]
    dims, dtype = values.get(inputs[0], (None, "float32"))
    norm = _Norm(writer, opset, dtype)
    if node.op_type in SKIP_NORMS:
        _skip_norm(node, norm, attributes, inputs)
    elif node.op_type in ("SimplifiedLayerNormalization", "LayerNormalization"):
        _check_last_axis(label, attributes, dims)
        centred, outputs = node.op_type == "LayerNormalization", [*node.output, "", ""]
        beta = inputs[2] if centred else ""
        named = outputs[:3] if centred else [outputs[0], "", outputs[1]]  # (Y, mean, inverse) or (Y, inverse)
        norm.write(inputs[0], inputs[1], beta, attributes.get("epsilon", 1e-5), centred, named)
    elif node.op_type == "FusedMatMul":
        _fused_matmul(label, node, writer, attributes, inputs, values)
    elif node.op_type == "BiasAdd":
        writer.op("Add", writer.op("Add", inputs[0], inputs[1]), inputs[2], out=node.output[0])
    else:
        scaled = writer.op("Mul", inputs[0], writer.const(attributes.get("alpha", QUICK_GELU_ALPHA), dtype))
        writer.op("Mul", inputs[0], writer.op("Sigmoid", scaled), out=node.output[0])


def _skip_norm(node, norm: "_Norm", attributes: dict, inputs: list) -> None:
    """input + skip (+ bias), normalized: a layer norm (gamma, beta) or an RMS norm (gamma)."""
    centred = node.op_type == "SkipLayerNormalization"
    beta, bias = (inputs[3], inputs[4]) if centred else ("", inputs[3])
    total = norm.writer.op("Add", inputs[0], inputs[1])
    if bias:
        total = norm.writer.op("Add", total, bias)
    outputs = [*node.output, "", "", ""]
    if outputs[3]:
        norm.writer.op("Identity", total, out=outputs[3])
    norm.write(total, inputs[2], beta, attributes.get("epsilon", 1e-12 if centred else 1e-5), centred, outputs[:3])


class _Norm:
    """Writes layer and RMS norms over the last axis as exporters spell them out, in the model's float dtype."""

    def __init__(self, writer: Writer, opset: int, dtype):
        self.writer, self.opset, self.dtype = writer, opset, dtype

    def write(self, x: str, gamma: str, beta: str, epsilon: float, centred: bool, outputs) -> None:
        """A layer norm (`centred`) or RMS norm of `x`; outputs: the result, the mean (a layer norm's) and the
        inverse standard deviation, each where named."""
        op = self.writer.op
        mean = self._mean(x) if centred else ""
        deviation = op("Sub", x, mean) if centred else x
        variance = self._mean(op("Mul", deviation, deviation))
        root = op("Sqrt", op("Add", variance, self.writer.const(epsilon, self.dtype)))
        scaled = op("Mul", op("Div", deviation, root), gamma)
        if beta:
            op("Add", scaled, beta, out=outputs[0])
        else:
            op("Identity", scaled, out=outputs[0])
        if centred and outputs[1]:
            op("Identity", mean, out=outputs[1])
        if outputs[2]:
            op("Reciprocal", root, out=outputs[2])

    def _mean(self, x: str) -> str:
        if self.opset >= AXES_AS_INPUT:
            return self.writer.op("ReduceMean", x, self.writer.const([-1]), keepdims=1)
        return self.writer.op("ReduceMean", x, axes=[-1], keepdims=1)


def _check_last_axis(label: str, attributes: dict, dims) -> None:
    axis = attributes.get("axis", -1)
    if axis != -1 and axis != len(dims or []) - 1:
        raise ModelLoadError(f"{label}: relay_amp writes a norm over the last axis only, not from axis {axis}")


def _fused_matmul(label: str, node, writer: Writer, attributes: dict, inputs: list, values: dict) -> None:
    if attributes.get("transBatchA", 0) or attributes.get("transBatchB", 0):
        raise ModelLoadError(f"{label}: relay_amp does not write a FusedMatMul with transBatchA or transBatchB")
    operands = []
    for name, flag in ((inputs[0], "transA"), (inputs[1], "transB")):
        rank = len(values.get(name, ([],))[0])
        if attributes.get(flag, 0) and rank < 2:
            raise ModelLoadError(f"{label}: {flag} of {name!r}, whose rank is not known")
        swapped = [*range(rank - 2), rank - 1, rank - 2]
        operands.append(writer.op("Transpose", name, perm=swapped) if attributes.get(flag, 0) else name)
    product = writer.op("MatMul", *operands)
    dtype = values.get(inputs[0], (None, "float32"))[1]
    writer.op("Mul", product, writer.const(attributes.get("alpha", 1.0), dtype), out=node.output[0])


def _attention(node, writer: Writer, values: dict, widths: dict) -> None:
    """ONNX Runtime's fused self-attention: one projection to Q, K and V, then as onnx_attention's, masked keys
    getting mask_filter_value added to their scores (not -inf)."""
    label = node_label(node)
    attributes = node_attributes(node)
    inputs = [*node.input, *[""] * 7]
    refused = [name for name in ATTENTION_REFUSED if attributes.get(name)]
    refused += [name for name, index in (("past", 4), ("past_sequence_length", 6)) if inputs[index]]
    refused += ["the present output"] if len(node.output) > 1 and node.output[1] else []
    if refused:
        raise ModelLoadError(f"{label}: relay_amp does not write an Attention with {', '.join(refused)}")
    dims, dtype = values.get(inputs[0], (None, None))
    if dims is None or None in dims or len(dims) != 3:
        raise ModelLoadError(f"{label}: its input needs a known 3-D shape, not {dims}")
    heads = attributes["num_heads"]
    projected = writer.op("MatMul", inputs[0], inputs[1])
    if inputs[2]:
        projected = writer.op("Add", projected, inputs[2])
    if "qkv_hidden_sizes" not in attributes and inputs[1] not in widths:
        raise ModelLoadError(f"{label}: its weights ({inputs[1]!r}) are not a constant matrix")
    sizes = list(attributes.get("qkv_hidden_sizes", [widths.get(inputs[1], 0) // 3] * 3))
    q, k, v = (split_heads(writer, part, heads) for part in writer.split(projected, sizes, axis=2))
    scores = writer.op("Mul", writer.op("MatMul", q, writer.op("Transpose", k, perm=[0, 1, 3, 2])),
                       writer.const(attributes.get("scale", 1 / np.sqrt(sizes[0] // heads)), dtype))
    fill = attributes.get("mask_filter_value", MASK_FILTER_VALUE)
    for bias in (mask_bias(label, writer, inputs[3], values, dims[1], fill, dtype),
                 causal_bias(writer, dims[1], dims[1], fill, dtype) if attributes.get("unidirectional", 0) else "",
                 inputs[5]):
        if bias:
            scores = writer.op("Add", scores, bias)
    output = writer.op("MatMul", writer.op("Softmax", scores, axis=-1), v)
    joined_heads(writer, output, out=node.output[0])


def mask_bias(label: str, writer: Writer, mask: str, values: dict, length: int, fill: float, dtype) -> str:
    """mask_filter_value where a key is masked, broadcast to [batch, heads, queries, keys]: from key lengths
    [batch] (keys past the length), or a 0/1 mask [batch, keys] or [batch, queries, keys]."""
    if not mask:
        return ""
    rank = len(values.get(mask, ([],))[0])
    if rank == 1:
        keys = writer.const(np.arange(length).reshape(1, length))
        ends = writer.op("Unsqueeze", writer.op("Cast", mask, to=INT64), writer.const([1]))
        open_keys = writer.op("Less", keys, ends)  # [batch, keys]
    elif rank in (2, 3):
        open_keys = writer.op("Cast", mask, to=BOOL)
    else:
        raise ModelLoadError(f"{label}: relay_amp writes masks of key lengths or of 0/1 over keys (rank 1, 2 or 3), "
                             f"not of rank {rank}")
    bias = writer.op("Where", open_keys, writer.const(0.0, dtype), writer.const(fill, dtype))
    axes = [1, 2] if rank < 3 else [1]  # -> [batch, 1, 1, keys] or [batch, 1, queries, keys]
    return writer.op("Unsqueeze", bias, writer.const(axes))


def causal_bias(writer: Writer, length: int, keys: int, fill: float, dtype) -> str:
    """mask_filter_value where a key comes after its query ([length, keys]: query i at position keys - length + i,
    after a cache)."""
    later = np.arange(keys)[None, :] > np.arange(length)[:, None] + keys - length
    return writer.const(np.where(later, fill, 0.0), dtype)
