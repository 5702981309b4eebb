"""ONNX's Attention (opset 23) written as the matmuls, mask and softmax it computes, before import.

`torch.onnx.export(..., dynamo=True, opset_version=23)` writes every `scaled_dot_product_attention` of a
transformer as one Attention node. TVM's importer reads an "Attention" node as ONNX Runtime's contrib operator
(com.microsoft, another signature), so such exports failed to import ("num_heads"). `attentions_as_matmuls` writes
each default-domain Attention as Q·Kᵀ times the scale, the soft cap, the mask (a boolean mask selects 0 or -inf;
a float mask adds) and the causal bias (bottom-right: query i of a block after P cached keys sees keys up to
i + P), a last-axis softmax (rows whose every key is masked give zeros, as ONNX defines) and the product with V.
3-D inputs are split into heads and joined again; grouped key/value heads are repeated for their query heads; a
past key and value are concatenated before the product and are the present outputs. The matmuls and the softmax
then run on relay_amp's kernels and row schedules like any exporter's spelled-out attention.
"""

import numpy as np

from ._onnx_graph import (DEFAULT_DOMAINS, Writer, default_opset, inferred_values, known_dims, named_inputs,
                          node_attributes, node_label, rewrite_nodes)
from .errors import ModelLoadError

ATTENTION_OPSET = 23  # the first opset with ONNX's own Attention
INPUTS = ("q", "k", "v", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
FLOAT = 1  # onnx.TensorProto.FLOAT


def attentions_as_matmuls(proto):
    """`proto` with each Attention node of ONNX's own operator set written as the ops it computes (a copy; `proto` is
    unchanged), or ModelLoadError naming a node whose options it does not write."""
    if default_opset(proto) < ATTENTION_OPSET or not any(
            node.op_type == "Attention" and node.domain in DEFAULT_DOMAINS for node in proto.graph.node):
        return proto
    values = inferred_values(proto)
    return rewrite_nodes(proto, {"Attention"}, lambda node, writer: _attention(node, writer, values))


def _attention(node, writer: Writer, values: dict) -> None:
    label = node_label(node)
    attributes = node_attributes(node)
    named = named_inputs(node, INPUTS)
    _check_supported(label, node, attributes, named)
    q_dims, dtype = known_dims(label, values, named["q"])
    split = len(q_dims) == 3
    q = _heads(writer, named["q"], attributes.get("q_num_heads"), split)
    k = _heads(writer, named["k"], attributes.get("kv_num_heads"), split)
    v = _heads(writer, named["v"], attributes.get("kv_num_heads"), split)
    k, v = (with_past(writer, named[past], current, node.output, index) for past, current, index in
            (("past_key", k, 1), ("past_value", v, 2)))
    q_heads, q_length, head_size = _query_sizes(label, q_dims, attributes)
    kv_heads, kv_length, past = _key_sizes(label, values, named, attributes, split)
    k, v = (_repeated_heads(writer, tensor, q_heads, kv_heads, kv_length) for tensor in (k, v))
    scores = writer.op("Mul", writer.op("MatMul", q, writer.op("Transpose", k, perm=[0, 1, 3, 2])),
                       writer.const(attributes.get("scale", 1 / np.sqrt(head_size)), dtype))
    softcap = attributes.get("softcap", 0.0)
    if softcap > 0:
        capped = writer.op("Tanh", writer.op("Div", scores, writer.const(softcap, dtype)))
        scores = writer.op("Mul", capped, writer.const(softcap, dtype))
    bias = _bias(label, writer, values, named["attn_mask"], dtype, bool(attributes.get("is_causal", 0)),
                 (q_length, kv_length, past))
    probabilities = writer.op("Softmax", scores if bias is None else writer.op("Add", scores, bias), axis=-1)
    if bias is not None:
        probabilities = _masked_rows_zeroed(writer, probabilities, bias, dtype)
    output = writer.op("MatMul", probabilities, v)
    if split:
        output = joined_heads(writer, output)
    writer.op("Identity", output, out=node.output[0])


def _check_supported(label: str, node, attributes: dict, named: dict) -> None:
    refused = [name for name in ("nonpad_kv_seqlen",) if named[name]]
    refused += ["the qk_matmul_output output"] if len(node.output) > 3 and node.output[3] else []
    refused += [name for name in ("left_window_size", "right_window_size") if attributes.get(name, -1) != -1]
    if refused:
        raise ModelLoadError(f"{label}: relay_amp does not write an Attention with {', '.join(refused)}")


def _heads(writer: Writer, tensor: str, heads: "int | None", split: bool) -> str:
    """A 3-D [batch, sequence, heads x size] input as [batch, heads, sequence, size]; a 4-D one as it is."""
    return split_heads(writer, tensor, heads) if split else tensor


def split_heads(writer: Writer, tensor: str, heads: int) -> str:
    """[batch, sequence, heads x size] as [batch, heads, sequence, size]."""
    return writer.op("Transpose", writer.op("Reshape", tensor, writer.const([0, 0, heads, -1])), perm=[0, 2, 1, 3])


def joined_heads(writer: Writer, tensor: str, out: "str | None" = None) -> str:
    """[batch, heads, sequence, size] as [batch, sequence, heads x size]."""
    return writer.op("Reshape", writer.op("Transpose", tensor, perm=[0, 2, 1, 3]), writer.const([0, 0, -1]), out=out)


def with_past(writer: Writer, past: str, current: str, outputs, index: int) -> str:
    """The keys or values after the cache's (the present output, where the node has it)."""
    present = current if not past else writer.op("Concat", past, current, axis=2)
    named_output(writer, present, outputs, index)
    return present


def named_output(writer: Writer, value: str, outputs, index: int) -> None:
    """`value` as the node's output `index`, where the node names that output."""
    if len(outputs) > index and outputs[index]:
        writer.op("Identity", value, out=outputs[index])


def _query_sizes(label: str, dims: list, attributes: dict) -> tuple[int, int, int]:
    """Query heads, query length and head size."""
    if len(dims) == 4:
        return dims[1], dims[2], dims[3]
    heads = attributes.get("q_num_heads")
    if not heads or "kv_num_heads" not in attributes:
        raise ModelLoadError(f"{label}: 3-D inputs need q_num_heads and kv_num_heads")
    return heads, dims[1], dims[2] // heads


def _key_sizes(label: str, values: dict, named: dict, attributes: dict, split: bool) -> tuple[int, int, int]:
    """Key/value heads, the keys' length with the cache's, and the cache's length."""
    dims, _ = known_dims(label, values, named["k"])
    heads, length = (attributes["kv_num_heads"], dims[1]) if split else (dims[1], dims[2])
    past = known_dims(label, values, named["past_key"])[0][2] if named["past_key"] else 0
    return heads, length + past, past


def _repeated_heads(writer: Writer, tensor: str, q_heads: int, kv_heads: int, length: int) -> str:
    """Each of `kv_heads` key or value heads (of `length` keys) repeated for the query heads that share it:
    [h0, h0, h1, h1, ...]."""
    if q_heads == kv_heads:
        return tensor
    repeats = [1, 1, q_heads // kv_heads, 1, 1]
    tiled = writer.op("Tile", writer.op("Unsqueeze", tensor, writer.const([2])), writer.const(repeats))
    return writer.op("Reshape", tiled, writer.const([0, q_heads, length, -1]))


def _bias(label: str, writer: Writer, values: dict, mask: str, dtype, causal: bool, lengths: tuple) -> "str | None":
    """The additive bias of the mask (a boolean mask: 0 where True, -inf elsewhere) and the causal bias; None
    for neither."""
    q_length, kv_length, past = lengths
    bias = None
    if mask:
        mask_dims, mask_dtype = values.get(mask, (None, None))
        if mask_dims and mask_dims[-1] is not None and mask_dims[-1] != kv_length:
            raise ModelLoadError(f"{label}: its mask covers {mask_dims[-1]} keys of {kv_length}")
        bias = mask if mask_dtype != np.bool_ else writer.op(
            "Where", mask, writer.const(0.0, dtype), writer.const(-np.inf, dtype))
    if causal:
        allowed = np.arange(kv_length)[None, :] <= np.arange(q_length)[:, None] + past
        causal_bias = writer.const(np.where(allowed, 0.0, -np.inf), dtype)
        bias = causal_bias if bias is None else writer.op("Add", bias, causal_bias)
    return bias


def _masked_rows_zeroed(writer: Writer, probabilities: str, bias: str, dtype) -> str:
    """`probabilities` with the rows whose every key the bias masks (-inf) set to 0 (their softmax is NaN). The
    row's largest bias would not tell: TVM's max starts from the lowest finite float, not -inf."""
    open_keys = writer.op("Cast", writer.op("Not", writer.op("IsInf", bias, detect_positive=0)), to=FLOAT)
    any_open = writer.op("ReduceMax", open_keys, writer.const([-1]), keepdims=1)
    masked = writer.op("Less", any_open, writer.const(0.5, "float32"))
    return writer.op("Where", masked, writer.const(0.0, dtype), probabilities)
