"""ONNX Runtime's MultiHeadAttention written as the ONNX ops it computes, before import.

ONNX Runtime's transformer tools write the attention of encoder-decoder and diffusion models (Whisper from GenAI's
builder and ONNX Runtime's Whisper export, its optimized CLIP, UNet and VAE) as com.microsoft MultiHeadAttention:
Q, K and V apart (K and V as [batch, length, hidden], or as [batch, heads, length, size] for a cross-attention's
precomputed cache), an optional packed input-projection bias, a key padding mask, an attention bias, a past key
and value and `unidirectional` (causal) order. TVM's importer has no such op. `multihead_attentions_as_onnx`
writes each as heads split, the past concatenated (the present outputs), scores times the scale plus
mask_filter_value (-10000) where the mask or the causal order excludes a key, plus the attention bias, a softmax
and the heads joined.
"""

import numpy as np

from ._onnx_graph import (Writer, inferred_values, known_dims, named_inputs, node_attributes, node_label,
                          rewrite_nodes, value_info)
from .errors import ModelLoadError
from .onnx_attention import joined_heads, split_heads, with_past
from .onnx_contrib import MASK_FILTER_VALUE, causal_bias, mask_bias

CONTRIB = "com.microsoft"
INPUTS = ("query", "key", "value", "bias", "key_padding_mask", "attention_bias", "past_key", "past_value",
          "past_sequence_length", "cache_indirection")
REFUSED_INPUTS = ("past_sequence_length", "cache_indirection")


def multihead_attentions_as_onnx(proto):
    """`proto` with each MultiHeadAttention node written as ONNX ops (a copy; `proto` is unchanged), or
    ModelLoadError naming a node whose options it does not write."""
    if not any(_is_multihead(node) for node in proto.graph.node):
        return proto
    values = inferred_values(proto, _output_shapes)
    return rewrite_nodes(proto, ["MultiHeadAttention"], lambda node, writer: _attention(node, writer, values),
                         [CONTRIB])


def _is_multihead(node) -> bool:
    return node.op_type == "MultiHeadAttention" and node.domain == CONTRIB


def _output_shapes(nodes, values: dict) -> list:
    """Value infos of the outputs whose inputs' shapes are known: [batch, sequence, heads x value size] and the
    present key and value."""
    infos = []
    for node in filter(_is_multihead, nodes):
        named = named_inputs(node, INPUTS)
        dims, dtype = values.get(named["query"], (None, None))
        sizes = _sizes(node, values, named) if dims and None not in dims else None
        if sizes is None:
            continue
        heads, value_size, keys = sizes
        cache = [dims[0], heads, keys]
        shapes = [[dims[0], dims[1], heads * value_size], [*cache, dims[2] // heads], [*cache, value_size]]
        infos += [value_info(name, shape, dtype) for name, shape in zip(node.output, shapes) if name]
    return infos


def _sizes(node, values: dict, named: dict) -> "tuple[int, int, int] | None":
    """Heads, the value heads' size and the keys' count with the past's; None where a shape is unknown."""
    heads = node_attributes(node)["num_heads"]
    value_dims = values.get(named["value"], (None,))[0]
    past = values.get(named["past_key"], ([0, 0, 0],))[0][2] if named["past_key"] else 0
    if not value_dims or None in value_dims or past is None:
        return None
    if len(value_dims) == 4:
        return heads, value_dims[3], value_dims[2] + past
    return heads, value_dims[2] // heads, value_dims[1] + past


def _attention(node, writer: Writer, values: dict) -> None:
    label = node_label(node)
    attributes = node_attributes(node)
    named = named_inputs(node, INPUTS)
    _check(label, node, named, values)
    dims, dtype = values[named["query"]]
    sizes = _sizes(node, values, named)
    if sizes is None:
        raise ModelLoadError(f"{label}: its value and past inputs need known shapes (size the symbolic dims)")
    heads, _, keys = sizes
    q, k, v = _projected(writer, named, values, dims[2])
    q, k, v = (part if len(values[named[name]][0]) == 4 else split_heads(writer, part, heads)
               for part, name in ((q, "query"), (k, "key"), (v, "value")))
    k, v = (with_past(writer, named[past], part, node.output, index)
            for past, part, index in (("past_key", k, 1), ("past_value", v, 2)))
    head_size = dims[2] // heads
    scale = attributes.get("scale", 0.0) or 1 / np.sqrt(head_size)
    scores = writer.op("Mul", writer.op("MatMul", q, writer.op("Transpose", k, perm=[0, 1, 3, 2])),
                       writer.const(scale, dtype))
    fill = attributes.get("mask_filter_value", MASK_FILTER_VALUE)
    biases = [mask_bias(label, writer, named["key_padding_mask"], values, keys, fill, dtype),
              causal_bias(writer, dims[1], keys, fill, dtype) if attributes.get("unidirectional", 0) else "",
              named["attention_bias"]]
    for bias in filter(None, biases):
        scores = writer.op("Add", scores, bias)
    joined_heads(writer, writer.op("MatMul", writer.op("Softmax", scores, axis=-1), v), out=node.output[0])


def _check(label: str, node, named: dict, values: dict) -> None:
    refused = [name for name in REFUSED_INPUTS if named[name]]
    refused += ["the qk output"] if len(node.output) > 3 and node.output[3] else []
    refused += ["Q, K and V packed in one input"] if not named["key"] or not named["value"] else []
    refused += ["a bias with 4-D keys"] if named["bias"] and len(values.get(named["key"], ([],))[0]) == 4 else []
    if refused:
        raise ModelLoadError(f"{label}: relay_amp does not write a MultiHeadAttention with {', '.join(refused)}")
    known_dims(label, values, named["query"], ranks=(3,))


def _projected(writer: Writer, named: dict, values: dict, hidden: int) -> tuple[str, str, str]:
    """Q, K and V plus their parts of the packed input-projection bias, where the node has one."""
    if not named["bias"]:
        return named["query"], named["key"], named["value"]
    value_hidden = values[named["value"]][0][-1]
    parts = writer.split(named["bias"], [hidden, hidden, value_hidden], axis=0)
    return tuple(writer.op("Add", named[name], part) for name, part in zip(("query", "key", "value"), parts))
