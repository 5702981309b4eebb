"""onnx_multihead: ONNX Runtime's MultiHeadAttention imported as the ONNX ops it computes, checked against ONNX
Runtime's own kernel."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.onnx_multihead import CONTRIB

onnxruntime = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)
BATCH, LENGTH, HEADS, HEAD_SIZE = 2, 5, 4, 8
HIDDEN = HEADS * HEAD_SIZE


def _model(keys: int = LENGTH, past: int = 0, cached_keys: bool = False, bias: bool = False, mask: str = "",
           attention_bias: bool = False, **attributes):
    """One MultiHeadAttention node over [BATCH, LENGTH, HIDDEN] queries and `keys` keys (as [batch, heads, keys,
    size] where `cached_keys`), with the inputs asked for."""
    key_shape = [BATCH, HEADS, keys, HEAD_SIZE] if cached_keys else [BATCH, keys, HIDDEN]
    inputs = {"q": (TensorProto.FLOAT, [BATCH, LENGTH, HIDDEN]), "k": (TensorProto.FLOAT, key_shape),
              "v": (TensorProto.FLOAT, key_shape)}
    if mask:
        inputs["mask"] = (TensorProto.INT32, [BATCH, past + keys] if mask == "2-D" else [BATCH])
    if attention_bias:
        inputs["attention_bias"] = (TensorProto.FLOAT, [1, HEADS, LENGTH, past + keys])
    if past:
        inputs.update({name: (TensorProto.FLOAT, [BATCH, HEADS, past, HEAD_SIZE]) for name in ("pk", "pv")})
    names = ["q", "k", "v", "bias" if bias else "", "mask" if mask else "",
             "attention_bias" if attention_bias else "", *(["pk", "pv"] if past else [])]
    outputs = ["y", *(["present_key", "present_value"] if past else [])]
    node = helper.make_node("MultiHeadAttention", names, outputs, "mha", domain=CONTRIB, num_heads=HEADS,
                            **attributes)
    cache = [BATCH, HEADS, past + keys, HEAD_SIZE]
    graph = helper.make_graph(
        [node], "mha", [helper.make_tensor_value_info(name, *types) for name, types in inputs.items()],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [BATCH, LENGTH, HIDDEN] if name == "y" else cache)
         for name in outputs],
        [numpy_helper.from_array(RNG.standard_normal(3 * HIDDEN).astype("float32"), "bias")] if bias else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])


def _feeds(model) -> dict:
    feeds = {}
    for value in model.graph.input:
        shape = [dim.dim_value for dim in value.type.tensor_type.shape.dim]
        if value.name != "mask":
            feeds[value.name] = RNG.standard_normal(shape).astype("float32")
        elif len(shape) == 2:  # the second row's last two keys padding
            feeds[value.name] = (np.arange(shape[1]) < np.array([[shape[1]], [shape[1] - 2]])).astype("int32")
        else:  # key lengths
            feeds[value.name] = np.array([LENGTH, 3], "int32")
    return feeds


CASES = {
    "self-attention": {},
    "input-projection bias": {"bias": True},
    "cross-attention": {"keys": 7},
    "cross-attention on cached keys": {"keys": 6, "cached_keys": True},
    "key padding mask": {"mask": "2-D"},
    "key lengths": {"mask": "lengths"},
    "causal": {"unidirectional": 1},
    "causal after a cache": {"past": 3, "unidirectional": 1},
    "mask over a cache": {"past": 3, "mask": "2-D"},
    "attention bias": {"attention_bias": True},
    "bias and a cache": {"past": 2, "bias": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_multihead_attention_matches_onnx_runtime(case):
    model = _model(**CASES[case])
    feeds = _feeds(model)
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), list(feeds.values()))
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_options_it_does_not_write_are_refused_naming_the_node():
    packed = _model()
    del packed.graph.node[0].input[1:]  # Q, K and V packed in the query
    with pytest.raises(ModelLoadError, match="MultiHeadAttention node 'mha': .* packed in one input"):
        relay_amp.frontend.from_onnx(packed)
    beam = _model(past=2)
    beam.graph.node[0].input.extend(["", "beams"])
    beam.graph.input.append(helper.make_tensor_value_info("beams", TensorProto.INT32, [BATCH, 1, 6]))
    with pytest.raises(ModelLoadError, match="MultiHeadAttention node 'mha': .* with cache_indirection"):
        relay_amp.frontend.from_onnx(beam)
