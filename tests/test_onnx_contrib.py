"""onnx_contrib: ONNX Runtime's fused norms, matmuls and activations imported as the ONNX ops they compute."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.onnx_contrib import CONTRIB, contrib_ops_as_onnx

from builders import hidden_states

RNG = np.random.default_rng(0)
SHAPE = (2, 5, 16)


def _model(op_type: str, inputs: dict, outputs: dict, domain: str = CONTRIB, opset: int = 17, **attributes):
    """One node of `op_type`: inputs by name (an array: a constant; a shape: a graph input), outputs by name (their
    shapes; "" leaves an output out)."""
    graph_inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, v) for n, v in inputs.items()
                    if isinstance(v, tuple)]
    constants = [numpy_helper.from_array(v, n) for n, v in inputs.items() if isinstance(v, np.ndarray)]
    node = helper.make_node(op_type, [n if v is not None else "" for n, v in inputs.items()], list(outputs),
                            "fused", domain=domain, **attributes)
    graph = helper.make_graph([node], "fused", graph_inputs,
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items() if n],
                              constants)
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(CONTRIB, 1)]
    return helper.make_model(graph, opset_imports=imports)


def _layer_norm(x, gamma, beta, epsilon, centred=True):
    mean = x.mean(-1, keepdims=True) if centred else 0.0
    inverse = 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + epsilon)
    return (x - mean) * inverse * gamma + (0.0 if beta is None else beta), mean, inverse


@pytest.mark.parametrize("beta, bias", [(True, True), (False, False)])
@pytest.mark.parametrize("opset", [14, 18])  # ReduceMean's axes an attribute, then an input
def test_skip_layer_norm_computes_every_output(beta, bias, opset):
    gamma, beta_value, bias_value = (RNG.standard_normal(16).astype("float32") for _ in range(3))
    inputs = {"x": SHAPE, "skip": SHAPE, "gamma": gamma, "beta": beta_value if beta else None,
              "bias": bias_value if bias else None}
    stats = SHAPE[:2] + (1,)
    model = _model("SkipLayerNormalization", inputs, {"y": SHAPE, "mean": stats, "inv_std": stats, "sum": SHAPE},
                   opset=opset, epsilon=1e-5)
    assert all(node.domain == "" for node in contrib_ops_as_onnx(model).graph.node)
    x, skip = (RNG.standard_normal(SHAPE).astype("float32") for _ in range(2))
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), [x, skip])
    total = x + skip + (bias_value if bias else 0)
    expected = [*_layer_norm(total, gamma, beta_value if beta else None, 1e-5), total]
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(ours, np.broadcast_to(theirs, ours.shape), rtol=2e-5, atol=2e-5)


def test_skip_simplified_layer_norm_is_an_rms_norm_and_gives_the_residual_sum():
    gamma, bias = (RNG.standard_normal(16).astype("float32") for _ in range(2))
    model = _model("SkipSimplifiedLayerNormalization", {"x": SHAPE, "skip": SHAPE, "gamma": gamma, "bias": bias},
                   {"y": SHAPE, "": None, "inv_std": SHAPE[:2] + (1,), "sum": SHAPE}, epsilon=1e-6)
    x, skip = (RNG.standard_normal(SHAPE).astype("float32") for _ in range(2))
    y, inverse, total = relay_amp.run(relay_amp.frontend.from_onnx(model), [x, skip])
    expected, _, expected_inverse = _layer_norm(x + skip + bias, gamma, None, 1e-6, centred=False)
    np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(inverse, expected_inverse, rtol=2e-5)
    np.testing.assert_allclose(total, x + skip + bias, rtol=1e-6)


def test_simplified_layer_norm_in_onnxs_domain_is_an_rms_norm():
    scale = RNG.standard_normal(16).astype("float32")
    model = _model("SimplifiedLayerNormalization", {"x": SHAPE, "scale": scale}, {"y": SHAPE}, domain="",
                   axis=-1, epsilon=1e-6)
    x = RNG.standard_normal(SHAPE).astype("float32")
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), [x])[0]
    np.testing.assert_allclose(got, _layer_norm(x, scale, None, 1e-6, centred=False)[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_fused_matmul_transposes_and_scales(trans_a, trans_b):
    a_shape, b_shape = (2, 3, 4, 6)[:2] + ((6, 4) if trans_a else (4, 6)), (2, 3) + ((5, 6) if trans_b else (6, 5))
    model = _model("FusedMatMul", {"a": a_shape, "b": b_shape}, {"y": (2, 3, 4, 5)}, alpha=0.5, transA=trans_a,
                   transB=trans_b)
    a, b = RNG.standard_normal(a_shape).astype("float32"), RNG.standard_normal(b_shape).astype("float32")
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), [a, b])[0]
    expected = 0.5 * (a.swapaxes(-1, -2) if trans_a else a) @ (b.swapaxes(-1, -2) if trans_b else b)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_bias_add_and_quick_gelu():
    bias = RNG.standard_normal(16).astype("float32")
    added = _model("BiasAdd", {"x": SHAPE, "bias": bias, "skip": SHAPE}, {"y": SHAPE})
    x, skip = (RNG.standard_normal(SHAPE).astype("float32") for _ in range(2))
    np.testing.assert_allclose(relay_amp.run(relay_amp.frontend.from_onnx(added), [x, skip])[0], x + bias + skip,
                               rtol=1e-6)
    gelu = _model("QuickGelu", {"x": SHAPE}, {"y": SHAPE}, alpha=1.702)
    np.testing.assert_allclose(relay_amp.run(relay_amp.frontend.from_onnx(gelu), [x])[0],
                               x / (1 + np.exp(-1.702 * x)), rtol=1e-5, atol=1e-6)


def test_options_it_does_not_write_are_refused_naming_the_node():
    batched = _model("FusedMatMul", {"a": (2, 4, 6), "b": (2, 6, 5)}, {"y": (2, 4, 5)}, transBatchA=1)
    with pytest.raises(ModelLoadError, match="FusedMatMul node 'fused': .* transBatchA"):
        relay_amp.frontend.from_onnx(batched)
    scale = np.ones(16, "float32")
    over_two_axes = _model("SimplifiedLayerNormalization", {"x": SHAPE, "scale": scale}, {"y": SHAPE}, domain="",
                           axis=1)
    with pytest.raises(ModelLoadError, match="SimplifiedLayerNormalization node 'fused': .* not from axis 1"):
        relay_amp.frontend.from_onnx(over_two_axes)


def test_a_gpt2_optimized_by_onnx_runtime_imports_and_matches_it(tmp_path):
    """ONNX Runtime's transformer optimizer fuses GPT-2's residual adds and layer norms into SkipLayerNormalization
    nodes whose fourth output (the residual sum) the next block reads, and its GELU into FastGelu."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    onnxruntime = pytest.importorskip("onnxruntime")
    from onnxruntime.transformers import optimizer

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100)
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, 100, (1, 16))
    exported, optimized = tmp_path / "gpt2.onnx", tmp_path / "gpt2_optimized.onnx"
    torch.onnx.export(hidden_states(model), (ids,), str(exported), input_names=["ids"], opset_version=17,
                      dynamo=False)
    optimizer.optimize_model(str(exported), model_type="gpt2", num_heads=4, hidden_size=64).save_model_to_file(
        str(optimized))
    import onnx

    assert "SkipLayerNormalization" in {node.op_type for node in onnx.load(optimized).graph.node}
    expected = onnxruntime.InferenceSession(str(optimized)).run(None, {"ids": ids.numpy()})[0]
    got = relay_amp.run(relay_amp.frontend.from_onnx(optimized), [ids.numpy()])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_layer_norm_in_onnxs_domain_before_opset_17_is_onnx_runtimes_and_spelled_out():
    """ONNX Runtime's optimizer writes LayerNormalization into files of any opset; ONNX's checker knows it from 17."""
    scale, bias = (RNG.standard_normal(16).astype("float32") for _ in range(2))
    model = _model("LayerNormalization", {"x": SHAPE, "scale": scale, "bias": bias}, {"y": SHAPE}, domain="",
                   opset=14, axis=-1, epsilon=1e-5)
    x = RNG.standard_normal(SHAPE).astype("float32")
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), [x])[0]
    np.testing.assert_allclose(got, _layer_norm(x, scale, bias, 1e-5)[0], rtol=2e-5, atol=2e-5)


ATTENTION_MASKS = {  # name: (mask input type, its shape, its values), or None
    "none": None,
    "key lengths": (TensorProto.INT32, [2], np.array([8, 5], "int32")),
    "2-D 0/1": (TensorProto.INT32, [2, 8], (np.arange(8) < np.array([[8], [6]])).astype("int32")),
    "3-D 0/1": (TensorProto.INT32, [2, 8, 8], np.tril(np.ones((8, 8), "int32"))[None].repeat(2, 0)),
}


@pytest.mark.parametrize("mask", list(ATTENTION_MASKS))
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_onnx_runtimes_fused_attention_matches_it(mask, unidirectional):
    """TVM's converter of ONNX Runtime's Attention refused its usual 2-D mask and any `unidirectional`."""
    onnxruntime = pytest.importorskip("onnxruntime")
    weights = (RNG.standard_normal((32, 96)) * 0.2).astype("float32")
    bias = (RNG.standard_normal(96) * 0.1).astype("float32")
    inputs = {"x": (2, 8, 32), "w": weights, "b": bias}
    if ATTENTION_MASKS[mask]:
        inputs["mask"] = "mask"
    attributes = {"num_heads": 4, **({"unidirectional": 1} if unidirectional else {})}
    model = _model("Attention", {k: v for k, v in inputs.items() if k != "mask"}, {"y": (2, 8, 32)}, **attributes)
    feeds = {"x": RNG.standard_normal((2, 8, 32)).astype("float32")}
    if ATTENTION_MASKS[mask]:
        element, shape, value = ATTENTION_MASKS[mask]
        model.graph.input.append(helper.make_tensor_value_info("mask", element, shape))
        model.graph.node[0].input.append("mask")
        feeds["mask"] = value
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), list(feeds.values()))[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_fused_attention_with_a_cache_is_refused_naming_the_node():
    weights = np.zeros((32, 96), "float32")
    model = _model("Attention", {"x": (2, 8, 32), "w": weights, "b": None, "mask": None, "past": (2, 2, 4, 3, 8)},
                   {"y": (2, 8, 32)}, num_heads=4)
    with pytest.raises(ModelLoadError, match="Attention node 'fused': relay_amp does not write an Attention with past"):
        relay_amp.frontend.from_onnx(model)


def test_fused_attentions_in_a_row_import_through_shapes_inference_does_not_know():
    """Shape inference stops at ONNX Runtime's ops: a second fused attention's input (after the first and a
    SkipLayerNormalization: GenAI's Whisper encoder) had no known shape and was refused."""
    onnxruntime = pytest.importorskip("onnxruntime")
    weights = [(RNG.standard_normal((32, 96)) * 0.2).astype("float32") for _ in range(2)]
    gamma = np.ones(32, "float32")
    nodes = [helper.make_node("Attention", ["x", "w0"], ["a0"], domain=CONTRIB, num_heads=4),
             helper.make_node("SkipLayerNormalization", ["a0", "x", "gamma"], ["n0"], domain=CONTRIB),
             helper.make_node("Attention", ["n0", "w1"], ["y"], "second", domain=CONTRIB, num_heads=4)]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 8, 32))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 8, 32))],
                              [numpy_helper.from_array(value, name) for name, value in
                               (("w0", weights[0]), ("w1", weights[1]), ("gamma", gamma))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    x = RNG.standard_normal((2, 8, 32)).astype("float32")
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(relay_amp.run(relay_amp.frontend.from_onnx(model), [x])[0], expected, rtol=1e-5,
                               atol=1e-5)
