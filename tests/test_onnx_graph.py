"""_onnx_graph: the shapes the rewrites before import read."""

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from relay_amp._onnx_graph import SKELETON_VALUES, constant_values, inferred_values


def _model(nodes, initializers, output: str):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info(output, TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "graph", [x], [y], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])


def test_large_weights_infer_by_their_type_alone():
    """Shape inference reads a large initializer's dims, not its values (a model of gigabytes infers as fast as
    its graph, and under protobuf's 2 GB)."""
    weights = np.zeros((8, SKELETON_VALUES // 8 + 1), "float32")
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(weights, "w")], "y")
    values = inferred_values(model)
    assert values["w"][0] == list(weights.shape) and values["y"] == ([2, weights.shape[1]], np.float32)
    assert len(model.graph.initializer[0].raw_data) == weights.nbytes, "the input model changed"


def test_outputs_of_ops_the_inference_does_not_know_come_from_the_callback_and_flow_on():
    nodes = [helper.make_node("Twice", ["x"], ["t"], domain="custom"), helper.make_node("Relu", ["t"], ["y"])]
    model = _model(nodes, [], "y")
    assert "y" not in inferred_values(model) or None in inferred_values(model)["y"][0]

    def outputs_of(graph_nodes, known):
        return [helper.make_tensor_value_info("t", TensorProto.FLOAT, [dim * 2 for dim in known["x"][0]])
                for node in graph_nodes if node.op_type == "Twice" and "x" in known]

    assert inferred_values(model, outputs_of)["y"] == ([4, 16], np.float32)


def test_constants_are_read_by_name_from_initializers_and_constant_nodes():
    weights = np.arange(6, dtype="float32").reshape(2, 3)
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array([7], "int64"))),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    constants = constant_values(_model(nodes, [numpy_helper.from_array(weights, "w")], "y").graph)
    assert "w" in constants and "c" in constants and "x" not in constants and sorted(constants) == ["c", "w"]
    assert constants.dims("w") == [2, 3]
    np.testing.assert_array_equal(constants["w"], weights)
    np.testing.assert_array_equal(constants["c"], [7])
