"""_onnx_graph: the shapes the rewrites before import read."""

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from relay_amp._onnx_graph import (COMPUTED_LOCATION, SKELETON_VALUES, Writer, constant_values, held_value,
                                   importing_file, importing_model, inferred_values, read_names, rename_values,
                                   rewrite_nodes, tensor_value, weights_as_inputs, writable)


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


def _if_model():
    """y = If(cond) then x + w else x - w: the weight is read inside the branches only."""
    def branch(op: str):
        out = helper.make_tensor_value_info(f"{op}_out", TensorProto.FLOAT, [2, 8])
        return helper.make_graph([helper.make_node(op, ["x", "w"], [f"{op}_out"])], op, [], [out])

    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=branch("Add"), else_branch=branch("Sub"))]
    weights = [numpy_helper.from_array(np.ones((2, 8), "float32"), "w"),
               numpy_helper.from_array(np.ones((SKELETON_VALUES + 1,), "float32"), "unread"),
               numpy_helper.from_array(np.array(True), "cond")]
    return _model(nodes, weights, "y")


def test_values_read_inside_subgraphs_count_as_read_and_are_renamed_there():
    model = _if_model()
    assert read_names(model.graph) == {"cond", "x", "w"}
    rename_values(model.graph, {"w": "weight", "y": "out"})
    branches = [attribute.g for attribute in model.graph.node[0].attribute]
    assert [list(graph.node[0].input) for graph in branches] == [["x", "weight"], ["x", "weight"]]
    assert list(model.graph.node[0].output) == ["out"] and model.graph.output[0].name == "out"


def test_weights_as_inputs_types_the_large_weights_and_leaves_out_those_no_node_reads():
    model = _if_model()
    skeleton = weights_as_inputs(model, limit=8)
    assert [tensor.name for tensor in skeleton.graph.initializer] == ["cond"]
    assert [value.name for value in skeleton.graph.input] == ["x", "w"]
    assert [tensor.name for tensor in model.graph.initializer] == ["w", "unread", "cond"], "the input model changed"


def test_rewrites_change_a_copy_unless_the_importer_owns_the_model():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [], "y")
    copy = writable(model)
    assert copy is not model and copy == model
    with importing_file(""):
        assert writable(model) is model
        rewritten = rewrite_nodes(model, ["Relu"], lambda node, writer: writer.op("Sigmoid", "x", out="y"))
        assert rewritten is model and [node.op_type for node in model.graph.node] == ["Sigmoid"]
    assert writable(model) is not model
    untouched = _model([helper.make_node("Relu", ["x"], ["y"])], [], "y")
    rewrite_nodes(untouched, ["Relu"], lambda node, writer: writer.op("Sigmoid", "x", out="y"))
    assert [node.op_type for node in untouched.graph.node] == ["Relu"]
    with importing_model():  # a model given in memory: its rewrites copy it
        assert writable(model) is not model


def test_a_computed_constant_is_computed_when_read_and_may_have_a_held_form():
    """Within an import a derived weight is computed when the importer binds it, or taken in the form it holds
    (packed int4); outside one it is computed at once."""
    computed = []
    with importing_model():
        writer = Writer("w")
        name = writer.computed_const(lambda: computed.append(1) or np.ones((2, 3)), [2, 3], "float32",
                                     held=lambda: "held form")
        (tensor,) = writer.constants
        assert tensor.name == name and tensor.external_data[0].value == COMPUTED_LOCATION and not computed
        assert held_value(tensor) == "held form"
        np.testing.assert_array_equal(tensor_value(tensor), np.ones((2, 3), "float32"))
        assert computed
    writer = Writer("w")
    writer.computed_const(lambda: np.zeros(2), [2], "float32", held=lambda: "held form")
    assert held_value(writer.constants[0]) is None
    np.testing.assert_array_equal(numpy_helper.to_array(writer.constants[0]), np.zeros(2, "float32"))
