"""onnx_decoder: ONNX Runtime's GroupQueryAttention and RotaryEmbedding (and opset 23's RotaryEmbedding) imported
as the ONNX ops they compute, checked against ONNX Runtime's own kernels."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.onnx_decoder import CONTRIB, decoder_ops_as_onnx

onnxruntime = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)
HEADS, KV_HEADS, HEAD_SIZE, MAX_POSITIONS = 4, 2, 16, 64
TOLERANCE = 1e-5  # fp32 against ONNX Runtime's kernels: reassociated sums


def _caches(width: int) -> list:
    """cos and sin caches [MAX_POSITIONS, width / 2] as the builders write them (initializers)."""
    angles = np.arange(MAX_POSITIONS)[:, None] / 10000 ** (np.arange(width // 2) / (width // 2))[None]
    return [numpy_helper.from_array(np.cos(angles).astype("float32"), "cos"),
            numpy_helper.from_array(np.sin(angles).astype("float32"), "sin")]


def _gqa_model(batch: int, length: int, past: int, packed: bool = True, rotary: bool = True, sink: bool = False,
               **attributes):
    """One GroupQueryAttention node: Q, K and V packed or apart, a cache of `past` tokens, seqlens_k an input, a
    head sink (a constant) or not."""
    width = (HEADS + 2 * KV_HEADS) * HEAD_SIZE if packed else HEADS * HEAD_SIZE
    inputs = [("qkv" if packed else "q", [batch, length, width])]
    inputs += [] if packed else [(name, [batch, length, KV_HEADS * HEAD_SIZE]) for name in ("k", "v")]
    inputs += [(name, [batch, KV_HEADS, past, HEAD_SIZE]) for name in ("past_key", "past_value")]
    values = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs]
    values.append(helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch]))
    names = [name for name, _ in inputs]
    node_inputs = [*(names[:1] + ["", ""] if packed else names[:3]), "past_key", "past_value", "seqlens_k", "total",
                   *(["cos", "sin"] if rotary else ["", ""]), *(["", "", "sink"] if sink else [])]
    node = helper.make_node("GroupQueryAttention", node_inputs, ["y", "present_key", "present_value"],
                            domain=CONTRIB, num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=int(rotary),
                            **attributes)
    cache = [batch, KV_HEADS, past + length, HEAD_SIZE]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, length, HEADS * HEAD_SIZE])]
    outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, cache)
                for name in ("present_key", "present_value")]
    constants = [numpy_helper.from_array(np.array(past + length, "int32"), "total"), *_caches(HEAD_SIZE),
                 numpy_helper.from_array(RNG.standard_normal(HEADS).astype("float32") * 3, "sink")]
    graph = helper.make_graph([node], "gqa", values, outputs, constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CONTRIB, 1)])


def _feeds(model, seqlens_k) -> dict:
    feeds = {}
    for value in model.graph.input:
        shape = [dim.dim_value for dim in value.type.tensor_type.shape.dim]
        feeds[value.name] = (np.asarray(seqlens_k, "int32") if value.name == "seqlens_k"
                             else RNG.standard_normal(shape).astype("float32"))
    return feeds


def _check_against_onnx_runtime(model, feeds: dict, rows=slice(None)) -> None:
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)
    mod = relay_amp.frontend.from_onnx(model)
    assert relay_amp.symbolic_dims(mod) == []  # an empty cache's dim of 0 too (TVM's importer read 0 as unknown)
    got = relay_amp.run(mod, list(feeds.values()))
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(ours[rows], theirs[rows], rtol=TOLERANCE, atol=TOLERANCE)


GQA_CASES = {  # name: (batch, sequence, cached tokens, options)
    "prompt": (1, 5, 0, {}),
    "prompt after a cache": (1, 5, 7, {}),
    "decode step": (1, 1, 9, {}),
    "q, k and v apart": (1, 4, 3, {"packed": False}),
    "interleaved rotary": (1, 4, 3, {"rotary_interleaved": 1}),
    "no rotary": (1, 4, 3, {"rotary": False}),
    "sliding window": (1, 5, 6, {"local_window_size": 3}),
    "soft cap and scale": (1, 4, 2, {"softcap": 2.0, "scale": 0.3}),
    "batch decode": (2, 1, 4, {}),
    "head sink": (1, 5, 3, {"sink": True}),
    "head sink, sliding window": (1, 5, 6, {"sink": True, "local_window_size": 3}),
}


@pytest.mark.parametrize("case", list(GQA_CASES))
def test_group_query_attention_matches_onnx_runtime(case):
    batch, length, past, options = GQA_CASES[case]
    model = _gqa_model(batch, length, past, **options)
    assert not any(node.op_type == "GroupQueryAttention" for node in decoder_ops_as_onnx(model).graph.node)
    _check_against_onnx_runtime(model, _feeds(model, [past + length - 1] * batch))


def test_rows_of_a_batch_with_other_lengths_match_onnx_runtime():
    """A row with fewer tokens than the cache holds gets its new token after its own (the present outputs too); a
    padded prompt's row attends to its tokens only, rotated from position 0."""
    decode = _gqa_model(3, 1, 4, local_window_size=2)
    _check_against_onnx_runtime(decode, _feeds(decode, [4, 2, 0]))
    prompt = _gqa_model(2, 4, 0)
    _check_against_onnx_runtime(prompt, _feeds(prompt, [3, 1]))


@pytest.mark.parametrize("length, tokens", [(1, 2), (1, 4), (1, 9), (6, 6), (3, 7), (3, 3)])
def test_a_sliding_window_cache_matches_onnx_runtime(length, tokens):
    """sliding_window_cache (GenAI's Gemma 2 and 3): a cache of the window's capacity holds each row's last tokens;
    the present keeps the last of them and the new ones. ONNX Runtime leaves the slots of a cache it does not fill
    unwritten, so the presents are compared where it fills them."""
    window = 4
    model = _gqa_model(1, length, window, local_window_size=window, sliding_window_cache=1)
    for value in model.graph.output[1:]:
        value.type.tensor_type.shape.dim[2].dim_value = window
    feeds = _feeds(model, [tokens - 1])
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), list(feeds.values()))
    compared = got if tokens >= window else got[:1]
    for ours, theirs in zip(compared, expected):
        np.testing.assert_allclose(ours, theirs, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_decoder_of_two_layers_with_symbolic_dims_imports_once_they_are_sized():
    """Shape inference stops at ONNX Runtime's ops, so the second layer's input shape comes from the first's
    outputs (what GenAI's builder writes: symbolic batch and sequence, value infos in the same names)."""
    model = _gqa_model(1, 3, 5)
    caches = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, KV_HEADS, 5, HEAD_SIZE])
              for name in ("past_key_2", "past_value_2")]
    second = helper.make_node("GroupQueryAttention", ["joined", "", "", "past_key_2", "past_value_2", "seqlens_k",
                                                      "total", "cos", "sin"], ["z", "present_key_2",
                                                                                  "present_value_2"], domain=CONTRIB,
                              num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1)
    weights = (RNG.standard_normal((HEADS * HEAD_SIZE, 128)) * 0.1).astype("float32")
    model.graph.node.extend([helper.make_node("MatMul", ["y", "w"], ["joined"]), second])
    model.graph.initializer.append(numpy_helper.from_array(weights, "w"))
    model.graph.input.extend(caches)
    feeds = _feeds(model, [7])
    symbolic = ["batch", "sequence"]
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [*symbolic, HEADS * HEAD_SIZE]))
    model.graph.value_info.append(helper.make_tensor_value_info("joined", TensorProto.FLOAT, [*symbolic, 128]))
    for dim, name in zip(model.graph.input[0].type.tensor_type.shape.dim, symbolic):
        dim.dim_param = name
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)
    got = relay_amp.run(relay_amp.frontend.from_onnx(model, dims={"batch": 1, "sequence": 3}), list(feeds.values()))
    np.testing.assert_allclose(got[-1], expected[-1], rtol=TOLERANCE, atol=TOLERANCE)


def _rotary_model(shape: list, domain: str, positions: "list | None", **attributes):
    """One RotaryEmbedding node over `shape`: ONNX Runtime's (input, position_ids, cos, sin) or ONNX's (input, cos,
    sin[, position_ids])."""
    values = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)]
    if positions is not None:
        values.append(helper.make_tensor_value_info("positions", TensorProto.INT64, positions))
    width = 2 * attributes.get("rotary_embedding_dim", HEAD_SIZE) // 2
    inputs = ["x", "positions", "cos", "sin"] if domain == CONTRIB else ["x", "cos", "sin", "positions"]
    node = helper.make_node("RotaryEmbedding", inputs, ["y"], domain=domain, **attributes)
    graph = helper.make_graph([node], "rotary", values, [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              _caches(width))
    opset = [helper.make_opsetid("", 23)] + ([helper.make_opsetid(CONTRIB, 1)] if domain == CONTRIB else [])
    return helper.make_model(graph, opset_imports=opset)


ROTARY_CASES = {  # name: (input shape, domain, position_ids shape, attributes)
    "heads apart": ([2, HEADS, 5, HEAD_SIZE], CONTRIB, [2, 5], {}),
    "heads joined": ([2, 5, HEADS * HEAD_SIZE], CONTRIB, [2, 5], {"num_heads": HEADS}),
    "interleaved": ([1, 5, HEADS * HEAD_SIZE], CONTRIB, [1, 5], {"num_heads": HEADS, "interleaved": 1}),
    "first position only": ([1, HEADS, 3, HEAD_SIZE], CONTRIB, [1], {}),
    "part of each head": ([1, HEADS, 5, HEAD_SIZE], CONTRIB, [1, 5], {"rotary_embedding_dim": 8, "num_heads": HEADS}),
    "ONNX's": ([1, 5, HEADS * HEAD_SIZE], "", [1, 5], {"num_heads": HEADS}),
    "ONNX's, part of each head": ([1, HEADS, 5, HEAD_SIZE], "", [1, 5], {"rotary_embedding_dim": 8,
                                                                         "interleaved": 1}),
}


@pytest.mark.parametrize("case", list(ROTARY_CASES))
def test_rotary_embedding_matches_onnx_runtime(case):
    shape, domain, positions, attributes = ROTARY_CASES[case]
    model = _rotary_model(shape, domain, positions, **attributes)
    feeds = {"x": RNG.standard_normal(shape).astype("float32"),
             "positions": RNG.integers(0, MAX_POSITIONS - 8, positions).astype("int64")}
    _check_against_onnx_runtime(model, feeds)


def test_options_it_does_not_write_are_refused_naming_the_node():
    for options in ({"smooth_softmax": 1}, {"sliding_window_cache": 1}):  # a softmax with a sink; no window
        model = _gqa_model(1, 2, 2, **options)
        with pytest.raises(ModelLoadError, match=f"GroupQueryAttention node 'y': .* with {next(iter(options))}"):
            relay_amp.frontend.from_onnx(model)
    packed = _rotary_model([1, 5, HEADS * HEAD_SIZE], CONTRIB, [1, 5], num_heads=HEADS, is_packed_batching=1)
    with pytest.raises(ModelLoadError, match="RotaryEmbedding node 'y': .* with is_packed_batching"):
        relay_amp.frontend.from_onnx(packed)
    unknown_past = _gqa_model(1, 2, 3)
    for value in unknown_past.graph.input[1:3]:
        value.type.tensor_type.shape.dim[2].dim_param = "past"
    with pytest.raises(ModelLoadError, match="GroupQueryAttention node 'y': its past key 'past_key' needs a known"):
        relay_amp.frontend.from_onnx(unknown_past)
    unsized = _rotary_model(["batch", 5, HEADS * HEAD_SIZE], CONTRIB, [1, 5], num_heads=HEADS)
    with pytest.raises(ModelLoadError, match="RotaryEmbedding node 'y': 'x' needs a known shape"):
        relay_amp.frontend.from_onnx(unsized)


def _conv_model(length: int, past: bool = True, bias: bool = False, channels_last: int = 0, kernel: int = 3,
                **attributes):
    """One CausalConvWithState node over [1, 8 channels, length] (or [1, length, 8]), its state an input."""
    channels, carried = 8, (kernel - 1) * attributes.get("dilation", 1)

    def laid(positions: int) -> list:
        return [1, positions, channels] if channels_last else [1, channels, positions]
    values = [helper.make_tensor_value_info("x", TensorProto.FLOAT, laid(length))]
    values += [helper.make_tensor_value_info("state", TensorProto.FLOAT, laid(carried))] if past else []
    constants = [numpy_helper.from_array(RNG.standard_normal((channels, 1, kernel)).astype("float32"), "w"),
                 numpy_helper.from_array(RNG.standard_normal(channels).astype("float32"), "b")]
    node = helper.make_node("CausalConvWithState", ["x", "w", "b" if bias else "", "state" if past else ""],
                            ["y", "present"], domain=CONTRIB, channels_last=channels_last, **attributes)
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, laid(length)),
               helper.make_tensor_value_info("present", TensorProto.FLOAT, laid(carried))]
    graph = helper.make_graph([node], "conv", values, outputs, constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CONTRIB, 1)])


CONV_CASES = {  # name: (length, options)
    "prompt after a state": (6, {}),
    "decode step": (1, {}),
    "no state input": (5, {"past": False}),
    "bias and silu": (4, {"bias": True, "activation": "silu"}),
    "dilated, kernel 4": (5, {"dilation": 2, "kernel": 4}),
    "channels last": (5, {"channels_last": 1, "activation": "swish"}),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_causal_conv_with_state_matches_onnx_runtime(case):
    """GenAI's LFM2 (and LFM2-MoE) short convolutions, carrying their last inputs between steps (did not import)."""
    length, options = CONV_CASES[case]
    model = _conv_model(length, **options)
    _check_against_onnx_runtime(model, _feeds(model, []))


def test_a_causal_conv_it_does_not_write_is_refused_naming_the_node():
    for options, reason in (({"state_window": 2}, "state_window 2"), ({"ndim": 2}, "ndim 2"),
                            ({"activation": "relu"}, "activation 'relu'")):
        with pytest.raises(ModelLoadError, match=f"CausalConvWithState node 'y': .* with {reason}"):
            relay_amp.frontend.from_onnx(_conv_model(3, **options))
