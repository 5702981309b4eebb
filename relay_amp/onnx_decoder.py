"""ONNX Runtime's decoder ops, GroupQueryAttention, RotaryEmbedding and CausalConvWithState, as ONNX ops before import.

ONNX Runtime GenAI's model builder (`python -m onnxruntime_genai.models.builder`) writes every attention of a
LLaMA, Mistral, Phi, Qwen or Gemma as one com.microsoft GroupQueryAttention node: Q, K and V packed in one input
(or three), the key/value cache as inputs and outputs, each batch row's length as `seqlens_k` (its attention
mask's sum minus one) and, with `do_rotary`, the rotary embedding applied to Q and K from cos and sin caches.
ONNX Runtime's transformer optimizer writes RotaryEmbedding nodes alone (and opset 23 has its own). TVM's importer
has neither, so such files failed to import. `decoder_ops_as_onnx` writes them as the ops they compute:
- RotaryEmbedding: each position's cos and sin gathered from the caches; the first `rotary_dim` values of each
  head rotated in halves (x1 cos - x2 sin, x2 cos + x1 sin) or, `interleaved`, in pairs; the rest kept.
- GroupQueryAttention: Q and K rotated at positions seqlens_k + 1 - sequence + i (from 0 in a first prompt
  whose rows are padded: ONNX Runtime's), or at `position_ids`; K and V written into the cache after each row's
  cached tokens (the present outputs: one row's after the cache input, several rows' by a gather, later
  positions zero); each group of query heads multiplied by its key/value head (no key/value head copied); scores
  times the scale, soft-capped, plus the attention bias; keys after a query's own position (or the row's last
  one), or before the last `local_window_size` positions up to it, masked; softmax (with a `head_sink`, each
  head's sink logit joins its denominator: gpt-oss's attention sinks); times V. With
  `sliding_window_cache` (GenAI's Gemma 2 and 3) the cache inputs hold each row's last tokens up to their
  capacity, and the present outputs the last `capacity` tokens of the cache and the new ones.
- CausalConvWithState (GenAI's LFM2 short convolutions): the carried state (zeros without one) and the input
  concatenated along the sequence, a depthwise Conv over them without padding (dilated, with its bias, SiLU'd where
  asked), the present state their last (k - 1) x dilation positions; channels-last layouts transposed around it.
Everything matches ONNX Runtime's kernels on its CPU, where the present outputs are their own buffers (a plain
InferenceSession; GenAI's loop shares them with the past inputs, holding the cache at its full length).
"""

import numpy as np

from ._onnx_graph import (DEFAULT_DOMAINS, Writer, attribute_text, inferred_values, known_dims, named_inputs,
                          node_attributes, node_label, rewrite_nodes, value_info)
from .errors import ModelLoadError
from .onnx_attention import joined_heads, named_output, split_heads

CONTRIB = "com.microsoft"
GQA_INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
              "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink")
GQA_REFUSED = ("smooth_softmax", "qk_output", "k_quant_type", "v_quant_type")
INT64 = 7  # onnx.TensorProto.INT64
CONV_INPUTS = ("input", "weight", "bias", "past_state")
CONV_ACTIVATIONS = ("none", "silu", "swish")
# CausalConvWithState's attributes beyond a 1-D convolution with one state (CUDA's extensions), at their defaults
CONV_REFUSED = {"ndim": 1, "state_window": 0, "state_update_capacity": 0, "state_length": 0,
                "input_channel_offset": 0, "input_channels": 0, "state_channels_last": -1}


def decoder_ops_as_onnx(proto):
    """`proto` with ONNX Runtime's GroupQueryAttention, RotaryEmbedding (and opset 23's) and CausalConvWithState
    nodes written as ONNX ops (a copy; `proto` is unchanged), or ModelLoadError naming a node it does not write."""
    if not any(_is_decoder_op(node) for node in proto.graph.node):
        return proto
    values = inferred_values(proto, _output_shapes)
    rewrite = {"GroupQueryAttention": _group_query_attention, "RotaryEmbedding": _rotary_embedding,
               "CausalConvWithState": _causal_conv}
    return rewrite_nodes(proto, rewrite, lambda node, writer: rewrite[node.op_type](node, writer, values),
                         (CONTRIB, *DEFAULT_DOMAINS))


def _output_shapes(nodes, values: dict) -> list:
    """Value infos of the decoder ops' outputs whose inputs' shapes are known (shape inference does not know
    ONNX Runtime's ops, so a second layer's would otherwise be unknown)."""
    infos = []
    for node in nodes:
        dims, dtype = values.get(node.input[0], (None, None)) if _is_decoder_op(node) else (None, None)
        if dims is None or None in dims:
            continue
        if node.op_type == "RotaryEmbedding":
            shapes = [dims]
        elif node.op_type == "CausalConvWithState":
            shapes = [dims, values.get(named_inputs(node, CONV_INPUTS)["past_state"], (None,))[0]]
        else:
            heads, kv_heads, head_size, past = _gqa_sizes(node, dims, values)
            cache = [dims[0], kv_heads, None if past is None else past + dims[1], head_size]
            shapes = [[dims[0], dims[1], heads * head_size], cache, cache]
        infos += [value_info(name, shape, dtype) for name, shape in zip(node.output, shapes) if name]
    return infos


def _gqa_sizes(node, dims: list, values: dict) -> tuple:
    """A GroupQueryAttention's query heads, key/value heads, head size and cached tokens (None where unknown)."""
    attributes = node_attributes(node)
    named = named_inputs(node, GQA_INPUTS)
    heads, kv_heads = attributes["num_heads"], attributes["kv_num_heads"]
    head_size = dims[2] // (heads + 2 * kv_heads if not named["key"] else heads)
    past = values.get(named["past_key"], ([None] * 3,))[0][2] if named["past_key"] else 0
    return heads, kv_heads, head_size, past


def _is_decoder_op(node) -> bool:
    return (node.op_type in ("GroupQueryAttention", "CausalConvWithState") and node.domain == CONTRIB) or (
        node.op_type == "RotaryEmbedding" and node.domain in (CONTRIB, *DEFAULT_DOMAINS))


def _rotary_width(label: str, values: dict, cos_cache: str, head_size: int) -> int:
    """How many of each head's values the rotary embedding turns: twice the caches' width."""
    width = 2 * known_dims(label, values, cos_cache, ranks=(2, 3))[0][-1]
    if width > head_size:
        raise ModelLoadError(f"{label}: its caches turn {width} values of heads of {head_size}")
    return width


def rotated(writer: Writer, heads: str, angles: tuple[str, str], width: int, head_size: int,
            interleaved: bool) -> str:
    """`heads` [batch, heads, sequence, size] with the first `width` values of each rotated by the angles' cos
    and sin [batch, 1, sequence, width / 2]: in halves (x1 cos - x2 sin, x2 cos + x1 sin) or in pairs."""
    cos, sin = angles
    half = width // 2
    parts = writer.split(heads, [width, head_size - width], axis=3) if width < head_size else [heads]
    if interleaved:
        pairs = writer.op("Reshape", parts[0], writer.const([0, 0, 0, half, 2]))
        first, second = (writer.op("Squeeze", part, writer.const([4])) for part in writer.split(pairs, [1, 1], 4))
    else:
        first, second = writer.split(parts[0], [half, half], axis=3)
    turned_first = writer.op("Sub", writer.op("Mul", first, cos), writer.op("Mul", second, sin))
    turned_second = writer.op("Add", writer.op("Mul", second, cos), writer.op("Mul", first, sin))
    if interleaved:
        stacked = writer.op("Concat", *(writer.op("Unsqueeze", part, writer.const([4]))
                                        for part in (turned_first, turned_second)), axis=4)
        turned = writer.op("Reshape", stacked, writer.const([0, 0, 0, width]))
    else:
        turned = writer.op("Concat", turned_first, turned_second, axis=3)
    return writer.op("Concat", turned, parts[1], axis=3) if width < head_size else turned


def _angles(writer: Writer, caches: tuple[str, str], positions: str) -> tuple[str, str]:
    """cos and sin at `positions` [batch, sequence], as [batch, 1, sequence, width / 2]."""
    return tuple(writer.op("Unsqueeze", writer.op("Gather", cache, positions, axis=0), writer.const([1]))
                 for cache in caches)


def _rotary_embedding(node, writer: Writer, values: dict) -> None:
    """RotaryEmbedding over [batch, sequence, hidden] or [batch, heads, sequence, size]; ONNX Runtime's takes
    (input, position_ids, cos_cache, sin_cache), ONNX's (input, cos_cache, sin_cache, position_ids), whose
    caches, without position_ids, are already [batch, sequence, width / 2]."""
    label = node_label(node)
    attributes = node_attributes(node)
    if attributes.get("is_packed_batching", 0):
        raise ModelLoadError(f"{label}: relay_amp does not write a RotaryEmbedding with is_packed_batching")
    inputs = [*node.input, "", "", ""]
    x, positions, cos, sin = inputs[:4] if node.domain == CONTRIB else (inputs[0], inputs[3], inputs[1], inputs[2])
    dims, _ = known_dims(label, values, x)
    heads = dims[1] if len(dims) == 4 else attributes.get("num_heads", 0)
    if not heads:
        raise ModelLoadError(f"{label}: a 3-D input needs num_heads")
    head_size = dims[3] if len(dims) == 4 else dims[2] // heads
    width = attributes.get("rotary_embedding_dim", 0) or _rotary_width(label, values, cos, head_size)
    if positions and len(values.get(positions, ([],))[0]) < 2:  # ONNX Runtime's [1]: the first token's position
        positions = writer.op("Add", positions, writer.const(np.arange(dims[-2 if len(dims) == 4 else 1])[None]))
    angles = (_angles(writer, (cos, sin), positions) if positions else
              tuple(writer.op("Unsqueeze", cache, writer.const([1])) for cache in (cos, sin)))
    as_heads = x if len(dims) == 4 else split_heads(writer, x, heads)
    turned = rotated(writer, as_heads, angles, width, head_size, bool(attributes.get("interleaved", 0)))
    if len(dims) == 4:
        writer.op("Identity", turned, out=node.output[0])
    else:
        joined_heads(writer, turned, out=node.output[0])


def _group_query_attention(node, writer: Writer, values: dict) -> None:
    label = node_label(node)
    attributes = node_attributes(node)
    named = named_inputs(node, GQA_INPUTS)
    _check_gqa(label, node, attributes, named)
    dims, dtype = known_dims(label, values, named["query"], ranks=(3,))
    heads, kv_heads, head_size, past = _gqa_sizes(node, dims, values)
    if past is None:
        raise ModelLoadError(f"{label}: its past key {named['past_key']!r} needs a known length")
    q, k, v = _split_qkv(writer, named, (heads, kv_heads, head_size))
    offsets, last = _past_lengths(writer, named["seqlens_k"], dims[1])
    if attributes.get("do_rotary", 0):
        positions = named["position_ids"] or writer.op(
            "Add", writer.op("Unsqueeze", offsets, writer.const([1])), writer.const(np.arange(dims[1])[None]))
        angles = _angles(writer, (named["cos_cache"], named["sin_cache"]), positions)
        width = _rotary_width(label, values, named["cos_cache"], head_size)
        interleaved = bool(attributes.get("rotary_interleaved", 0))
        q, k = (rotated(writer, part, angles, width, head_size, interleaved) for part in (q, k))
    sizes = (heads, kv_heads, dims[1], past + dims[1])
    if attributes.get("sliding_window_cache", 0):
        k, v, *keys = _window_cache(writer, named, (k, v), offsets, sizes, dtype, node.output)
    else:
        rows = offsets if dims[0] > 1 else None  # one row's cached tokens are the cache input's
        k, v = (_appended(writer, named[name], part, rows, sizes, dtype, node.output, index)
                for name, part, index in (("past_key", k, 1), ("past_value", v, 2)))
        keys = (writer.const(np.arange(sizes[3]).reshape(1, 1, -1)), None)
    scores = _scores(writer, (q, k), named["attention_bias"], attributes, sizes, head_size, dtype)
    mask = _causal_mask(writer, (offsets, last), keys, sizes, attributes.get("local_window_size", -1), dtype)
    probabilities = _softmax(writer, writer.op("Add", scores, mask), named["head_sink"], sizes, dims[0])
    grouped = writer.op("Reshape", probabilities, writer.const([0, kv_heads, -1, sizes[3]]))
    output = writer.op("Reshape", writer.op("MatMul", grouped, v), writer.const([0, heads, dims[1], head_size]))
    joined_heads(writer, output, out=node.output[0])


def _softmax(writer: Writer, scores: str, sink: str, sizes: tuple, batch: int) -> str:
    """The softmax of `scores` [batch, heads, sequence, keys] over the keys; with a head sink, each head's sink
    logit joins its denominator (a key that nothing reads: gpt-oss's attention sinks)."""
    if not sink:
        return writer.op("Softmax", scores, axis=-1)
    heads, _, length, keys = sizes
    per_head = writer.op("Reshape", sink, writer.const([1, heads, 1, 1]))
    column = writer.op("Expand", per_head, writer.const([batch, heads, length, 1]))
    joined = writer.op("Softmax", writer.op("Concat", scores, column, axis=3), axis=-1)
    return writer.op("Slice", joined, writer.const([0]), writer.const([keys]), writer.const([3]))


def _causal_conv(node, writer: Writer, values: dict) -> None:
    """A depthwise convolution over the carried state and the input along the last axis (k - 1 taps of state, no
    padding), plus the bias, with its activation; the present state is the last (k - 1) x dilation positions."""
    label, attributes, named = node_label(node), node_attributes(node), named_inputs(node, CONV_INPUTS)
    refused = [f"{name} {attributes[name]}" for name in CONV_REFUSED if attributes.get(name, CONV_REFUSED[name])
               != CONV_REFUSED[name]]
    activation = attribute_text(attributes.get("activation", "none"))
    refused += [f"activation {activation!r}"] if activation not in CONV_ACTIVATIONS else []
    if refused:
        raise ModelLoadError(f"{label}: relay_amp does not write a CausalConvWithState with {', '.join(refused)}")
    dims, dtype = known_dims(label, values, named["input"], ranks=(3,))
    last = attributes.get("channels_last", 0)
    batch, positions, channels = dims if last else (dims[0], dims[2], dims[1])
    kernel = values[named["weight"]][0][2]
    carried = (kernel - 1) * attributes.get("dilation", 1)
    turned = [writer.op("Transpose", name, perm=[0, 2, 1]) if last and name else name
              for name in (named["input"], named["past_state"])]
    past = turned[1] or writer.const(np.zeros((batch, channels, carried)), dtype)
    full = writer.op("Concat", past, turned[0], axis=2)
    inputs = [full, named["weight"], *([named["bias"]] if named["bias"] else [])]
    output = writer.op("Conv", *inputs, group=channels, kernel_shape=[kernel],
                       dilations=[attributes.get("dilation", 1)])
    if activation != "none":
        output = writer.op("Mul", output, writer.op("Sigmoid", output))
    present = writer.op("Slice", full, writer.const([positions]), writer.const([positions + carried]),
                        writer.const([2]))
    for index, value in enumerate((output, present)):
        named_output(writer, writer.op("Transpose", value, perm=[0, 2, 1]) if last else value, node.output, index)


def _split_qkv(writer: Writer, named: dict, sizes: tuple) -> tuple[str, str, str]:
    """Q, K and V as [batch, heads, sequence, size], from one packed input or three."""
    heads, kv_heads, head_size = sizes
    parts = ((named["query"], named["key"], named["value"]) if named["key"] else
             writer.split(named["query"], [heads * head_size, *[kv_heads * head_size] * 2], axis=2))
    return tuple(split_heads(writer, part, count) for part, count in zip(parts, (heads, kv_heads, kv_heads)))


def _scores(writer: Writer, qk: tuple[str, str], bias: str, attributes: dict, sizes: tuple, head_size: int,
            dtype) -> str:
    """Q·Kᵀ times the scale, soft-capped, plus the attention bias: [batch, heads, sequence, keys]."""
    scale = attributes.get("scale", 0.0) or 1 / np.sqrt(head_size)
    scores = _grouped_scores(writer, *qk, sizes, scale, dtype)
    softcap = attributes.get("softcap", 0.0)
    if softcap > 0:
        scores = writer.op("Mul", writer.op("Tanh", writer.op("Div", scores, writer.const(softcap, dtype))),
                           writer.const(softcap, dtype))
    return writer.op("Add", scores, bias) if bias else scores


def _check_gqa(label: str, node, attributes: dict, named: dict) -> None:
    refused = [name for name in GQA_REFUSED if attributes.get(name, 0) not in (0, "NONE")]
    refused += ["the output_qk output"] if len(node.output) > 3 and node.output[3] else []
    refused += ["a key without a value"] if bool(named["key"]) != bool(named["value"]) else []
    refused += ["do_rotary without cos and sin caches"] if attributes.get("do_rotary", 0) and not (
        named["cos_cache"] and named["sin_cache"]) else []
    refused += ["sliding_window_cache without a window and a cache"] if attributes.get("sliding_window_cache", 0) and (
        attributes.get("local_window_size", -1) <= 0 or not named["past_key"]) else []
    if refused:
        raise ModelLoadError(f"{label}: relay_amp does not write a GroupQueryAttention with {', '.join(refused)}")


def _past_lengths(writer: Writer, seqlens_k: str, length: int) -> tuple[str, str]:
    """Each row's count of cached tokens (its seqlens_k + 1 - sequence, 0 for a padded prompt) and last position
    (its seqlens_k): [batch] int64."""
    last = writer.op("Cast", seqlens_k, to=INT64)
    return writer.op("Max", writer.op("Add", last, writer.const(1 - length)), writer.const(0)), last


def _appended(writer: Writer, past: str, current: str, offsets: "str | None", sizes: tuple, dtype, outputs,
              index: int) -> str:
    """The cache with the new keys or values written after each row's cached tokens (the present output, where the
    node has it). One row: after the cache input; more: at each row's count, later positions zero."""
    _, _, length, keys = sizes
    present = writer.op("Concat", past, current, axis=2) if past and keys > length else current
    if offsets is not None and keys > length:
        positions = writer.const(np.arange(keys).reshape(1, keys))
        written = writer.op("Sub", positions, writer.op("Unsqueeze", offsets, writer.const([1])))
        is_new = writer.op("And", writer.op("GreaterOrEqual", written, writer.const(0)),
                           writer.op("Less", written, writer.const(length)))
        read = writer.op("Where", is_new, writer.op("Add", written, writer.const(keys - length)), positions)
        present = _gathered(writer, present, read, writer.op("Less", written, writer.const(length)), dtype)
    named_output(writer, present, outputs, index)
    return present


def _gathered(writer: Writer, cache: str, read: str, kept: str, dtype) -> str:
    """`cache` [batch, heads, slots, size] with slot j of row b reading slot read[b, j], or 0 where kept[b, j] is
    false."""
    rows = writer.op("Unsqueeze", read, writer.const([1, 3]))  # [batch, 1, slots, 1]
    per_slot = writer.op("Add", writer.op("Mul", writer.op("Shape", cache), writer.const([1, 1, 0, 1])),
                         writer.const([0, 0, 1, 0]))  # [batch, heads, 1, size]
    moved = writer.op("GatherElements", cache, writer.op("Expand", rows, per_slot), axis=2)
    return writer.op("Where", writer.op("Unsqueeze", kept, writer.const([1, 3])), moved, writer.const(0.0, dtype))


def _window_cache(writer: Writer, named: dict, kv: tuple[str, str], offsets: str, sizes: tuple, dtype,
                  outputs) -> tuple:
    """ONNX Runtime's sliding-window cache (sliding_window_cache): the past inputs hold each row's last tokens, up
    to their capacity; attention reads them and the new ones; the present outputs keep the last `capacity` of both.
    The keys and values, and each key's position and whether it holds a token: [batch, 1, keys]."""
    _, _, length, keys = sizes
    capacity = keys - length
    slots = writer.const(np.arange(keys).reshape(1, keys))
    cached, counts = writer.op("Less", slots, writer.const(capacity)), writer.op("Min", offsets, writer.const(capacity))
    row = {name: writer.op("Unsqueeze", value, writer.const([1])) for name, value in
           (("offsets", offsets), ("held", counts))}  # [batch, 1]
    first = writer.op("Sub", row["offsets"], row["held"])  # the position of slot 0
    positions = writer.op("Where", cached, writer.op("Add", first, slots),
                          writer.op("Add", row["offsets"], writer.op("Sub", slots, writer.const(capacity))))
    held = writer.op("Or", writer.op("Not", cached), writer.op("Less", slots, row["held"]))
    start = writer.op("Max", writer.op("Add", row["held"], writer.const(length - capacity)), writer.const(0))
    kept_index = writer.op("Add", start, writer.const(np.arange(capacity).reshape(1, capacity)))  # [batch, capacity]
    read = writer.op("Min", writer.op("Where", writer.op("Less", kept_index, row["held"]), kept_index, writer.op(
        "Add", writer.op("Sub", kept_index, row["held"]), writer.const(capacity))), writer.const(keys - 1))
    kept = writer.op("Less", kept_index, writer.op("Add", row["held"], writer.const(length)))
    full = []
    for past, current, index in ((named["past_key"], kv[0], 1), (named["past_value"], kv[1], 2)):
        full.append(writer.op("Concat", past, current, axis=2))
        named_output(writer, _gathered(writer, full[-1], read, kept, dtype), outputs, index)
    return (*full, *(writer.op("Unsqueeze", value, writer.const([1])) for value in (positions, held)))


def _grouped_scores(writer: Writer, q: str, k: str, sizes: tuple, scale: float, dtype) -> str:
    """Q·Kᵀ times the scale as [batch, heads, sequence, keys], each key/value head multiplied by its group of
    query heads stacked as one [group x sequence] block."""
    heads, kv_heads, length, keys = sizes
    grouped = writer.op("Reshape", q, writer.const([0, kv_heads, -1, 0]))
    scores = writer.op("MatMul", grouped, writer.op("Transpose", k, perm=[0, 1, 3, 2]))
    scaled = writer.op("Mul", scores, writer.const(scale, dtype))
    return writer.op("Reshape", scaled, writer.const([0, heads, length, keys]))


def _causal_mask(writer: Writer, rows: tuple[str, str], keys: tuple, sizes: tuple, window: int, dtype) -> str:
    """0 where query i of a row with P cached tokens (at position P + i) sees a key (held, at a position up to its
    own, and within the window), -inf elsewhere: [batch, 1, sequence, keys]. `keys`: the keys' positions and
    whether each holds a token ([batch or 1, 1, keys]; None: every key)."""
    length = sizes[2]
    positions, held = keys
    offsets, last = (writer.op("Unsqueeze", row, writer.const([1, 2])) for row in rows)
    own = writer.op("Min", writer.op("Add", offsets, writer.const(np.arange(length).reshape(1, length, 1))),
                    last)  # [batch, sequence, 1]: a padded prompt's padding queries see its tokens
    seen = writer.op("LessOrEqual", positions, own)
    if window > 0:
        seen = writer.op("And", seen, writer.op("GreaterOrEqual", positions,
                                                writer.op("Sub", own, writer.const(window - 1))))
    if held is not None:
        seen = writer.op("And", seen, held)
    mask = writer.op("Where", seen, writer.const(0.0, dtype), writer.const(-np.inf, dtype))
    return writer.op("Unsqueeze", mask, writer.const([1]))
