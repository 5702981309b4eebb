"""onnx_grouped_experts: transformers' ONNX export of its grouped expert matmul (a MatMul per expert of a Range of
sorted rows, concatenated) imported in the dense form, on the expert kernel, matching ONNX's own evaluation."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import relay_amp
from relay_amp.onnx_grouped_experts import grouped_matmuls_dense
from relay_amp.runtime import run_executable
from pass_checks import prepared_calls

RNG = np.random.default_rng(0)
ROWS, DEPTH, WIDTH, EXPERTS = 10, 16, 32, 3  # the expert kernel takes whole 16-column blocks


def _grouped(bias: bool = False, first: int = 0, starts: "list[int] | None" = None) -> onnx.ModelProto:
    """The exporter's form: the expert ends (a runtime [EXPERTS] int32 input, cumulated row counts) split into
    scalars, each expert's rows a Range from the previous end (the first from `first`; `starts` gives constant
    first rows instead: not the form), a Gather of those rows, a MatMul by the expert's slice of a weight stack
    (plus its bias), concatenated."""
    nodes = [helper.make_node("Cast", ["ends"], ["ends64"], to=TensorProto.INT64),
             helper.make_node("Split", ["ends64"], [f"end{g}" for g in range(EXPERTS)], axis=0,
                              num_outputs=EXPERTS),
             helper.make_node("Split", ["stack"], [f"slice{g}" for g in range(EXPERTS)], axis=0,
                              num_outputs=EXPERTS)]
    weights = [numpy_helper.from_array(RNG.standard_normal((EXPERTS, DEPTH, WIDTH)).astype("float32"), "stack"),
               numpy_helper.from_array(np.array([0], "int64"), "zero_axis"),
               numpy_helper.from_array(np.array(1, "int64"), "step"),
               numpy_helper.from_array(np.array(first, "int64"), "first")]
    parts = []
    for g in range(EXPERTS):
        start = f"limit{g - 1}" if g else "first"
        if starts is not None:
            start = f"start{g}"
            weights.append(numpy_helper.from_array(np.array(starts[g], "int64"), start))
        nodes += [helper.make_node("Squeeze", [f"end{g}", "zero_axis"], [f"limit{g}"]),
                  helper.make_node("Range", [start, f"limit{g}", "step"], [f"rows{g}"]),
                  helper.make_node("Gather", ["x", f"rows{g}"], [f"picked{g}"], axis=0),
                  helper.make_node("Squeeze", [f"slice{g}", "zero_axis"], [f"weight{g}"]),
                  helper.make_node("MatMul", [f"picked{g}", f"weight{g}"], [f"product{g}"])]
        parts.append(f"product{g}")
        if bias:
            weights.append(numpy_helper.from_array(RNG.standard_normal(WIDTH).astype("float32"), f"bias{g}"))
            nodes.append(helper.make_node("Add", [f"bias{g}", f"product{g}"], [f"biased{g}"]))
            parts[-1] = f"biased{g}"
    nodes.append(helper.make_node("Concat", parts, ["y"], axis=0))
    graph = helper.make_graph(nodes, "grouped", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, DEPTH]),
                                                 helper.make_tensor_value_info("ends", TensorProto.INT32, [EXPERTS])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, WIDTH])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


ROUTINGS = {"every expert": [3, 7, 10], "an expert without rows": [4, 4, 10], "one expert's rows": [0, 0, 10]}


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_the_grouped_matmul_imports_on_the_expert_kernel_and_matches_onnx(bias, routing):
    """Before, TVM's build failed on the rows' run-time counts ("CodeGenVM cannot emit this Relax operator")."""
    model = _grouped(bias)
    feeds = {"x": RNG.standard_normal((ROWS, DEPTH)).astype("float32"), "ends": np.array(ROUTINGS[routing], "int32")}
    expected = ReferenceEvaluator(model).run(None, feeds)[0]
    assert {node.op_type for node in grouped_matmuls_dense(model).graph.node} >= {"LessOrEqual", "ReduceSum"}
    mod = relay_amp.frontend.from_onnx(model)
    assert "relax.arange" not in mod.script() and len(prepared_calls(mod, "expert_matmul")) == 1
    got = run_executable(relay_amp.build(mod, relay_amp.targets.host_preset()), [feeds["x"], feeds["ends"]])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_ranges_that_do_not_follow_each_other_are_left_alone():
    """Experts whose rows do not start where the previous expert's end (or at 0 first) are not the grouped form."""
    for model in (_grouped(starts=[0, 2, 5]), _grouped(first=1)):
        assert grouped_matmuls_dense(model).graph.node[-1].op_type == "Concat"


def test_a_mixture_of_experts_from_transformers_onnx_exporter_builds_and_matches_pytorch(tmp_path):
    """transformers' own ONNX exporter on a Mixtral-style decoder (its default grouped_mm experts; the rewrite was
    written on Qwen3-MoE's export): the expert matmuls on the expert kernel, the floor division's Equal of bools
    (relay_amp.passes.booleans) built, fp32 within 1e-5 of PyTorch."""
    torch = pytest.importorskip("torch")
    exporter = pytest.importorskip("transformers.exporters.exporter_onnx")
    from transformers import MixtralConfig, MixtralModel

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, vocab_size=256)
    model = MixtralModel(config).eval()
    ids = torch.randint(3, 250, (1, 12))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False)[0].numpy()
    exporter.OnnxExporter().export(model, {"input_ids": ids}, exporter.OnnxConfig()).save_pretrained(tmp_path)
    mod = relay_amp.frontend.from_onnx(tmp_path / "model.onnx")
    assert len(prepared_calls(mod, "expert_matmul")) == 2 * config.num_hidden_layers
    got = run_executable(relay_amp.build(mod, relay_amp.targets.host_preset()), [ids.numpy()])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
