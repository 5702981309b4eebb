"""onnx_attention: ONNX's Attention (opset 23) imported as the matmuls, mask and softmax ONNX defines."""

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.onnx_attention import attentions_as_matmuls

from builders import hidden_states

RNG = np.random.default_rng(0)
BATCH, HEADS, LENGTH, SIZE = 2, 4, 6, 8
FLOAT, BOOL = TensorProto.FLOAT, TensorProto.BOOL


def _attention_model(inputs: dict, outputs: int = 1, **attributes):
    """One Attention node over graph inputs named as its inputs (name -> (element type, shape))."""
    order = ["q", "k", "v", "attn_mask", "past_key", "past_value"]
    names = [name if name in inputs else "" for name in order]
    while not names[-1]:
        names.pop()
    out_names = ["y", "present_key", "present_value"][:outputs]
    node = helper.make_node("Attention", names, out_names, "attention", **attributes)
    graph = helper.make_graph([node], "attention",
                              [helper.make_tensor_value_info(n, *inputs[n]) for n in order if n in inputs],
                              [helper.make_tensor_value_info(n, FLOAT, None) for n in out_names])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    feeds = {n: _value(*inputs[n]) for n in order if n in inputs}
    expected = ReferenceEvaluator(model).run(None, feeds)
    for output, value in zip(model.graph.output, expected):  # their shapes, for the checker
        output.CopyFrom(helper.make_tensor_value_info(output.name, FLOAT, value.shape))
    return model, feeds, expected


def _value(element_type, shape):
    if element_type == BOOL:
        return RNG.random(shape) > 0.3
    return RNG.standard_normal(shape).astype("float32")


def _4d(heads=HEADS, length=LENGTH):
    return FLOAT, [BATCH, heads, length, SIZE]


CASES = {
    "plain": ({"q": _4d(), "k": _4d(), "v": _4d()}, 1, {}),
    "boolean mask": ({"q": _4d(), "k": _4d(), "v": _4d(), "attn_mask": (BOOL, [BATCH, 1, LENGTH, LENGTH])}, 1, {}),
    "float mask, scale": ({"q": _4d(), "k": _4d(), "v": _4d(), "attn_mask": (FLOAT, [LENGTH, LENGTH])}, 1,
                          {"scale": 0.3}),
    "causal": ({"q": _4d(), "k": _4d(), "v": _4d()}, 1, {"is_causal": 1}),
    "softcap": ({"q": _4d(), "k": _4d(), "v": _4d()}, 1, {"softcap": 2.0}),
    "grouped heads": ({"q": _4d(), "k": _4d(heads=2), "v": _4d(heads=2)}, 1, {"is_causal": 1}),
    "3-D inputs": ({"q": (FLOAT, [BATCH, LENGTH, HEADS * SIZE]), "k": (FLOAT, [BATCH, LENGTH, 2 * SIZE]),
                    "v": (FLOAT, [BATCH, LENGTH, 2 * SIZE])}, 1, {"q_num_heads": HEADS, "kv_num_heads": 2}),
    "cache, causal": ({"q": _4d(length=1), "k": _4d(length=1), "v": _4d(length=1), "past_key": _4d(length=5),
                       "past_value": _4d(length=5)}, 3, {"is_causal": 1}),
    "cache, boolean mask": ({"q": _4d(length=2), "k": _4d(length=2), "v": _4d(length=2),
                             "attn_mask": (BOOL, [BATCH, 1, 2, 7]), "past_key": _4d(length=5),
                             "past_value": _4d(length=5)}, 3, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_imports_as_the_ops_onnx_defines(case):
    inputs, outputs, attributes = CASES[case]
    model, feeds, expected = _attention_model(inputs, outputs, **attributes)
    assert "Attention" not in [node.op_type for node in attentions_as_matmuls(model).graph.node]
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), list(feeds.values()))
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_row_whose_every_key_is_masked_is_zero_as_onnx_defines():
    mask = np.ones([BATCH, 1, LENGTH, LENGTH], bool)
    mask[:, :, 2] = False  # query 2 may see no key
    model, feeds, expected = _attention_model({"q": _4d(), "k": _4d(), "v": _4d(),
                                               "attn_mask": (BOOL, [BATCH, 1, LENGTH, LENGTH])})
    feeds["attn_mask"] = mask
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), list(feeds.values()))[0]
    assert np.all(got[:, :, 2] == 0) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_an_attention_with_options_it_does_not_write_is_refused_naming_the_node():
    model, _, _ = _attention_model({"q": _4d(), "k": _4d(), "v": _4d()})
    model.graph.node[0].output.extend(["", "", "qk"])
    with pytest.raises(ModelLoadError, match="Attention node 'attention': .* the qk_matmul_output output"):
        relay_amp.frontend.from_onnx(model)


@pytest.mark.parametrize("architecture", ["bert", "llama"])
def test_transformers_exported_at_opset_23_match_pytorch(architecture, tmp_path):
    """The dynamo exporter at opset 23 writes each scaled_dot_product_attention as one Attention node (BERT: a
    padding mask; LLaMA: a causal mask over grouped key/value heads); TVM's importer took it for ONNX Runtime's."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if architecture == "bert":
        config = transformers.BertConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                         intermediate_size=128, vocab_size=100)
        model = transformers.BertModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=100)
        model = transformers.LlamaModel(config)
    hidden = hidden_states(model.eval())
    ids, mask = torch.randint(0, 100, (2, 12)), torch.ones(2, 12, dtype=torch.int64)
    mask[1, 9:] = 0  # the second sequence padded
    with torch.no_grad():
        expected = hidden(ids, mask).numpy()  # before the export, which may change the module
    path = tmp_path / f"{architecture}.onnx"
    torch.onnx.export(hidden, (ids, mask), str(path), dynamo=True, opset_version=23)
    got = relay_amp.run(relay_amp.frontend.from_onnx(path), [ids.numpy(), mask.numpy()])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
