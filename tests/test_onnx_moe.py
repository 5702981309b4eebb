"""onnx_moe: ONNX Runtime's MoE and QMoE imported as the ops they compute, checked against ONNX Runtime's own CPU
kernels."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.onnx_moe import CONTRIB, moe_ops_as_onnx

onnxruntime = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)
HIDDEN, INTER, EXPERTS = 32, 16, 4
TOLERANCE = 1e-5  # fp32 against ONNX Runtime's kernels, of the output's largest magnitude: reassociated sums


def _moe_model(tokens=6, top_k=2, activation="swiglu", fusion=1, bias=True, rank=2, third=False, **attributes):
    """One MoE node over (tokens, HIDDEN) (or (1, tokens, HIDDEN)) and the router's (tokens, EXPERTS) logits."""
    fused = activation == "swiglu" and fusion
    weights = {"w1": (EXPERTS, 2 * INTER if fused else INTER, HIDDEN), "w2": (EXPERTS, HIDDEN, INTER)}
    weights.update({"w3": (EXPERTS, INTER, HIDDEN)} if third else {})
    weights.update({"b1": weights["w1"][:2], "b2": (EXPERTS, HIDDEN)} if bias else {})
    weights.update({"b3": (EXPERTS, INTER)} if bias and third else {})
    inputs = ["x", "router", "w1", "b1", "w2", "b2", "w3", "b3"]
    inputs = [name if name in weights or name in ("x", "router") else "" for name in inputs]
    swiglu = {"swiglu_fusion": fusion} if activation == "swiglu" else {}
    node = helper.make_node("MoE", inputs, ["y"], domain=CONTRIB, k=top_k, activation_type=activation, **swiglu,
                            **attributes)
    initializers = [numpy_helper.from_array((RNG.standard_normal(shape) * 0.3).astype("float32"), name)
                    for name, shape in weights.items()]
    return _model(node, tokens, rank, initializers)


def _model(node, tokens: int, rank: int, initializers: list, token_dim=None):
    shape = [1, tokens, HIDDEN][-rank:]
    symbolic = [token_dim or dim for dim in shape[:-1]] + [HIDDEN]
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, symbolic),
                                              helper.make_tensor_value_info("router", TensorProto.FLOAT,
                                                                            [symbolic[-2], EXPERTS])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, symbolic)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CONTRIB, 1)])
    feeds = {"x": RNG.standard_normal(shape).astype("float32"),
             "router": RNG.standard_normal((tokens, EXPERTS)).astype("float32")}
    return model, feeds


def _check(model, feeds: dict, tolerance: float = TOLERANCE, ours=None, **import_options) -> None:
    """relay_amp's import of `ours` (else `model`) against ONNX Runtime running `model`."""
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    got = relay_amp.run(relay_amp.frontend.from_onnx(ours or model, **import_options), list(feeds.values()))[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance * np.abs(expected).max())


MOE_CASES = {  # name: _moe_model's options
    "swiglu, interleaved": {},
    "swiglu, limit, alpha and beta, normalized": {"swiglu_limit": 1.5, "activation_alpha": 1.702,
                                                  "activation_beta": 1.0, "normalize_routing_weights": 1},
    "relu": {"activation": "relu"},
    "gelu, no biases": {"activation": "gelu", "bias": False},
    "silu, normalized": {"activation": "silu", "normalize_routing_weights": 1},
    "identity, 3-D input, top 1": {"activation": "identity", "rank": 3, "top_k": 1},
    "more rows than experts": {"tokens": 40, "top_k": 3, "activation": "silu"},
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_matches_onnx_runtime(case):
    model, feeds = _moe_model(**MOE_CASES[case])
    assert not any(node.op_type == "MoE" for node in moe_ops_as_onnx(model).graph.node)
    _check(model, feeds)


def test_swiglu_concatenated_or_in_a_third_projection_matches_the_interleaved_one():
    """ONNX Runtime's CPU kernel takes only interleaved gates and linear parts; the same weights concatenated
    (swiglu_fusion 2), or the linear part as a third projection (0), must compute what it computes."""
    model, feeds = _moe_model(swiglu_limit=2.0)
    values = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    gate, linear = values["w1"][:, 0::2], values["w1"][:, 1::2]
    gate_bias, linear_bias = values["b1"][:, 0::2], values["b1"][:, 1::2]
    for fusion, replaced in ((2, {"w1": np.concatenate([gate, linear], 1), "b1": np.concatenate([gate_bias,
                                                                                                 linear_bias], 1)}),
                             (0, {"w1": gate, "b1": gate_bias, "w3": linear, "b3": linear_bias})):
        ours, _ = _moe_model(fusion=fusion, third=fusion == 0, swiglu_limit=2.0)
        for tensor in ours.graph.initializer:
            tensor.CopyFrom(numpy_helper.from_array(
                np.ascontiguousarray(replaced.get(tensor.name, values.get(tensor.name))), tensor.name))
        _check(model, feeds, ours=ours)


def _packed(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes of `bits` bits packed in bytes along the last axis, lowest bits first (padded to whole bytes)."""
    per_byte = 8 // bits
    padded = np.concatenate([codes, np.zeros((*codes.shape[:-1], -codes.shape[-1] % per_byte), codes.dtype)], -1)
    parts = padded.reshape(*codes.shape[:-1], -1, per_byte).astype("uint8")
    return np.bitwise_or.reduce(parts << (np.arange(per_byte, dtype="uint8") * bits), axis=-1).astype("uint8")


def _qmoe_model(bits=4, block=0, zero_points=False, activation="swiglu", tokens=6):
    """One QMoE node: codes of `bits` bits per output channel (or in blocks of `block` along the depth), zero
    points or the middle code, routing weights normalized (ONNX Runtime's CPU kernel normalizes them always)."""
    fused = 2 if activation == "swiglu" else 1
    initializers = []
    for name, (outputs, depth) in (("fc1", (fused * INTER, HIDDEN)), ("fc2", (HIDDEN, INTER))):
        codes = RNG.integers(0, 2 ** bits, (EXPERTS, outputs, depth))
        scale_shape = (EXPERTS, outputs, depth // block) if block else (EXPERTS, outputs)
        initializers += [numpy_helper.from_array(_packed(codes, bits), f"{name}_weights"),
                         numpy_helper.from_array((RNG.random(scale_shape) * 0.05 + 0.01).astype("float32"),
                                                 f"{name}_scales")]
        if zero_points:
            points = RNG.integers(0, 2 ** bits, scale_shape if block else (EXPERTS, 1, outputs))
            initializers.append(numpy_helper.from_array(_packed(points, bits).reshape(
                (EXPERTS, outputs, -1) if block else (EXPERTS, -1)), f"{name}_zero_points"))
    points = ["fc1_zero_points", "fc2_zero_points"] if zero_points else ["", ""]
    inputs = ["x", "router", "fc1_weights", "fc1_scales", "", "fc2_weights", "fc2_scales", "", "", "", "", *points]
    options = {"block_size": block} if block else {}
    options.update({"swiglu_fusion": 1} if activation == "swiglu" else {})
    node = helper.make_node("QMoE", inputs, ["y"], domain=CONTRIB, k=2, activation_type=activation,
                            expert_weight_bits=bits, normalize_routing_weights=1, **options)
    return _model(node, tokens, 2, initializers)


QMOE_CASES = {  # name: (_qmoe_model's options, tolerance)
    "int4 per channel": ({}, TOLERANCE),
    "int8 per channel": ({"bits": 8}, TOLERANCE),
    "int4 in blocks": ({"block": 16}, TOLERANCE),
    "int4 zero points per channel": ({"zero_points": True}, TOLERANCE),
    "int4 zero points in blocks": ({"zero_points": True, "block": 16}, TOLERANCE),
    "int8 zero points, silu": ({"bits": 8, "zero_points": True, "activation": "silu"}, TOLERANCE),
    # ONNX Runtime computes blocks of int8 weights with int8 activations: its own rounding, about 1%
    "int8 in blocks": ({"bits": 8, "block": 16}, 3e-2),
}


@pytest.mark.parametrize("case", list(QMOE_CASES))
def test_qmoe_matches_onnx_runtime(case):
    options, tolerance = QMOE_CASES[case]
    model, feeds = _qmoe_model(**options)
    _check(model, feeds, tolerance)


def test_a_moe_of_symbolic_tokens_sized_at_import_runs_on_the_expert_kernel():
    """GenAI's files leave the tokens symbolic; sized at import, the layer's products are the CPU backend's
    grouped expert kernel's (only the routed rows'), and still match ONNX Runtime."""
    model, feeds = _moe_model(tokens=12, activation="swiglu", normalize_routing_weights=1)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "tokens"
    model.graph.input[1].type.tensor_type.shape.dim[0].dim_param = "tokens"
    _check(model, feeds, dims={"tokens": 12})
    mod = relay_amp.frontend.from_onnx(model, dims={"tokens": 12})
    executable = relay_amp.build(mod, relay_amp.targets.host_preset())
    assert "expert_matmul" in executable.as_text() and "gather_nd" not in executable.as_text()


REFUSED = {  # what the error names: (node constructor, options)
    "use_sparse_mixer": (_moe_model, {"use_sparse_mixer": 1}),
    "activation_type 'relu2'": (_moe_model, {"activation": "relu2"}),
    "a third projection without swiglu_fusion 0": (_moe_model, {"activation": "silu", "third": True}),
    "swiglu_fusion 0 without a third projection": (_moe_model, {"fusion": 0}),
}


@pytest.mark.parametrize("reason", list(REFUSED))
def test_options_it_does_not_write_are_refused_naming_the_node(reason):
    build, options = REFUSED[reason]
    model, _ = build(**options)
    with pytest.raises(ModelLoadError, match=f"MoE node 'y': relay_amp does not write .*{reason}"):
        relay_amp.frontend.from_onnx(model)


def test_quantizations_it_does_not_dequantize_are_refused_naming_them():
    for attribute, value, reason in (("expert_weight_bits", 2, "2-bit weights"), ("quant_type", "fp4",
                                                                                 "quant_type 'fp4'")):
        model, _ = _qmoe_model()
        for existing in model.graph.node[0].attribute:
            if existing.name == attribute:
                model.graph.node[0].attribute.remove(existing)
        model.graph.node[0].attribute.append(helper.make_attribute(attribute, value))
        with pytest.raises(ModelLoadError, match=f"QMoE node 'y': .*{reason}"):
            relay_amp.frontend.from_onnx(model)
    model, _ = _moe_model()
    model.graph.input.append(helper.make_tensor_value_info("w2", TensorProto.FLOAT, [EXPERTS, HIDDEN, INTER]))
    model.graph.initializer.pop(1)  # the second projection's weights an input
    with pytest.raises(ModelLoadError, match="MoE node 'y': .*non-constant fc2_experts_weights 'w2'"):
        relay_amp.frontend.from_onnx(model)


def test_symmetric_int4_experts_stay_packed_and_int4w_multiplies_the_files_own_codes():
    """A QMoE of symmetric 4-bit codes in blocks (as GenAI's int4 files hold them) imports with each projection's
    codes held packed, one (depth, experts x outputs) weight, not dequantized to fp32 (the module's largest float
    constant is smaller than one projection's experts); int4w's build multiplies the file's own codes and scales on
    the int4 expert kernel, as near ONNX Runtime as the bf16 build."""
    import tvm
    from tvm import relax

    from pass_checks import prepared_calls
    from relay_amp.onnx_nbits import unpacked
    from relay_amp.packed_int4 import pack_nibbles

    model, feeds = _qmoe_model(block=16, tokens=12)
    mod = relay_amp.frontend.from_onnx(model)
    floats = []
    relax.analysis.post_order_visit(mod["main"], lambda e: floats.append(e.value.numpy().size) if isinstance(
        e, tvm.ir.expr.Constant) and hasattr(e.value, "numpy") and e.value.dtype == "float32" else None)
    assert max(floats) < EXPERTS * HIDDEN * INTER  # the smaller projection's weights, had they been dequantized
    values = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    bf16 = relay_amp.to_mixed_precision(mod, "bfloat16")
    int4w = relay_amp.quantize_weights(bf16, "int4", group_size=32)  # the file's blocks of 16 are kept
    kernels = prepared_calls(int4w, "expert_matmul")
    assert len(kernels) == 2
    for kernel, name in zip(kernels, ("fc1", "fc2")):
        codes = values[f"{name}_weights"]
        nibbles = unpacked(codes, 4).reshape(EXPERTS * codes.shape[1], -1).T
        _, _, packed, scales = kernel.args[1].fields
        np.testing.assert_array_equal(packed.value.numpy().reshape(-1), pack_nibbles(nibbles).reshape(-1))
        np.testing.assert_array_equal(scales.value.numpy(), values[f"{name}_scales"].transpose(2, 0, 1).reshape(
            -1, nibbles.shape[1]))
    errors = [np.abs(relay_amp.run(module, list(feeds.values()))[0] - expected).max() for module in (bf16, int4w)]
    assert errors[1] <= 1.5 * errors[0]
