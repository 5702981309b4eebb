"""as_qdq: QOperator ops and dynamic integer patterns written as QDQ pairs around float ops (node lists), computing
what ONNX Runtime computes on the original file; ONNX Runtime's own QOperator and dynamic files compiled to int8."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import relay_amp
from relay_amp import ModelLoadError, digits, metrics
from relay_amp.onnx_quantized import as_qdq, constant_dequantizes_folded
from relay_amp.passes.quantize.plan import DYNAMIC

onnxruntime = pytest.importorskip("onnxruntime")
RNG = np.random.default_rng(3)
X_SCALE, Y_SCALE = np.float32(4 / 255), np.float32(8 / 255)
W_CODES = RNG.integers(-127, 128, (4, 3, 3, 3)).astype("int8")
W_SCALES = np.array([0.01, 0.02, 0.005, 0.03], "float32")
BIAS_CODES = RNG.integers(-500, 500, 4).astype("int32")


def _model(nodes: list, initializers: dict, inputs: dict, outputs: dict, domains=("",)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "quantized", [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in
                             inputs.items()],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in outputs.items()],
        [numpy_helper.from_array(np.asarray(value), name) for name, value in initializers.items()])
    opsets = [helper.make_opsetid(domain, 17 if domain == "" else 1) for domain in domains]
    return helper.make_model(graph, opset_imports=opsets)


def qlinear_conv_model(bias: str = "b_q", **conv_attributes) -> onnx.ModelProto:
    """x -> QuantizeLinear -> QLinearConv (3x3, ReLU folded into its uint8 output) -> MaxPool -> DequantizeLinear."""
    zero = np.uint8(0)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["x_q"]),
        helper.make_node("QLinearConv", ["x_q", "xs", "xz", "w_q", "ws", "wz", "ys", "yz", bias], ["y_q"],
                         pads=[1, 1, 1, 1], **conv_attributes),
        helper.make_node("MaxPool", ["y_q"], ["p_q"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("DequantizeLinear", ["p_q", "ys", "yz"], ["y"]),
    ]
    initializers = {"xs": X_SCALE, "xz": zero, "w_q": W_CODES, "ws": W_SCALES, "wz": np.zeros(4, "int8"),
                    "ys": Y_SCALE, "yz": zero, "b_q": BIAS_CODES}
    return _model(nodes, initializers, {"x": [1, 3, 8, 8]}, {"y": [1, 4, 4, 4]})


def dynamic_matmul_model() -> onnx.ModelProto:
    """ONNX Runtime's dynamic int8 matmul: DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(x scale x w scale)."""
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["x_q", "x_s", "x_z"]),
        helper.make_node("Mul", ["x_s", "ws"], ["scales"]),
        helper.make_node("MatMulInteger", ["x_q", "w_q", "x_z", "wz"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["acc_f", "scales"], ["y"]),
    ]
    initializers = {"w_q": RNG.integers(-127, 128, (16, 8)).astype("int8"), "ws": np.float32(0.02),
                    "wz": np.int8(0)}
    return _model(nodes, initializers, {"x": [4, 16]}, {"y": [4, 8]})


def _op_types(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """ONNX Runtime's output, its graph run as written (not fused back into integer ops)."""
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_qlinear_conv_becomes_a_float_conv_between_pairs_and_moves_run_on_real_values():
    model = qlinear_conv_model()
    rewritten = as_qdq(model)
    assert _op_types(rewritten) == ["QuantizeLinear", "DequantizeLinear", "Conv", "QuantizeLinear",
                                    "DequantizeLinear", "MaxPool", "QuantizeLinear", "DequantizeLinear"]
    constants = {init.name: numpy_helper.to_array(init) for init in rewritten.graph.initializer}
    conv = rewritten.graph.node[2]
    np.testing.assert_allclose(constants[conv.input[1]], W_CODES * W_SCALES.reshape(4, 1, 1, 1), rtol=1e-6)
    np.testing.assert_allclose(constants[conv.input[2]], BIAS_CODES * X_SCALE * W_SCALES, rtol=1e-6)
    assert _op_types(model)[1] == "QLinearConv"  # the input model is left as it was


def test_the_qdq_form_computes_what_onnxruntime_computes_on_the_qoperator_model():
    model = qlinear_conv_model()
    x = RNG.uniform(0, 1, (1, 3, 8, 8)).astype("float32")
    # ONNX Runtime accumulates in int32, the QDQ form in float: the two may round a tie apart, by one code
    np.testing.assert_allclose(_run(as_qdq(model), x), _run(model, x), atol=Y_SCALE * 1.01)


def test_dynamic_integer_matmul_becomes_a_pair_whose_scale_is_computed_at_run_time():
    model = dynamic_matmul_model()
    rewritten = as_qdq(model)
    assert _op_types(rewritten) == ["DynamicQuantizeLinear", "DequantizeLinear", "MatMul"]
    x = RNG.standard_normal((4, 16)).astype("float32")
    # ONNX's reference evaluator: ONNX Runtime's MatMulInteger saturates pairs of u8 x s8 products in int16 on
    # AVX2 without VNNI (vpmaddubsw), so on such hosts it is not the exact integer product
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(_run(rewritten, x), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    realized = relay_amp.realize_qdq(relay_amp.frontend.from_onnx(model))
    [entry] = relay_amp.quant_plan(realized).entries
    assert (entry.dtype, entry.reason) == (DYNAMIC, "dynamic: per-row scales at run time")
    ours = relay_amp.run(realized, [x])[0]
    assert np.abs(ours - expected).max() <= 0.02 * np.abs(expected).max()  # two int8 roundings of each operand


def test_a_model_without_quantized_ops_is_returned_as_it_is():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], {}, {"x": [2]}, {"y": [2]})
    assert as_qdq(model) is model


def test_what_cannot_be_written_in_qdq_form_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="QLinearConv node 'conv': its bias and scales must be constants"):
        model = qlinear_conv_model(bias="x")  # a runtime tensor as the bias
        model.graph.node[1].name = "conv"
        as_qdq(model)
    pooled = _model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                     helper.make_node("QLinearGlobalAveragePool", ["q", "s", "z", "s", "z"], ["p"],
                                      domain="com.microsoft", channels_last=1, name="pool"),
                     helper.make_node("DequantizeLinear", ["p", "s", "z"], ["y"])],
                    {"s": np.float32(0.1), "z": np.uint8(0)}, {"x": [1, 4, 4, 3]}, {"y": [1, 1, 1, 3]},
                    ("", "com.microsoft"))
    with pytest.raises(ModelLoadError, match="QLinearGlobalAveragePool node 'pool': channels_last=1"):
        as_qdq(pooled)


def _quantized_by_onnxruntime(path_in, path_out, images, dynamic: bool) -> None:
    quantization = pytest.importorskip("onnxruntime.quantization")
    if dynamic:
        quantization.quantize_dynamic(str(path_in), str(path_out), weight_type=quantization.QuantType.QInt8)
        return
    feeds = iter(images)

    class Batches(quantization.CalibrationDataReader):
        def get_next(self):
            return next(feeds, None)

    quantization.quantize_static(str(path_in), str(path_out), Batches(),
                                 quant_format=quantization.QuantFormat.QOperator, per_channel=True)


def test_onnxruntime_qoperator_digits_model_runs_int8_with_its_accuracy(tmp_path):
    images, labels = digits.load_test_split()
    path = tmp_path / "digits_qoperator.onnx"
    _quantized_by_onnxruntime(digits.MODEL_FILE, path, [{"image": images[i:i + 50]} for i in (0, 50)], dynamic=False)
    realized = relay_amp.realize_qdq(relay_amp.frontend.from_onnx(path, shape_dict={"image": [len(images), 1, 8, 8]}))
    assert [e.dtype for e in relay_amp.quant_plan(realized).entries] == ["uint8"] * 4
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    theirs = session.run(None, {"image": images})[0]
    ours = relay_amp.run(realized, [images])[0]
    assert metrics.top1_accuracy(ours, labels) == pytest.approx(metrics.top1_accuracy(theirs, labels), abs=0.005)


@pytest.mark.parametrize("name, dynamic", [("resnet18", False), ("bert", True)])
def test_onnxruntime_files_of_zoo_models_import_as_onnxruntime_runs_them(tmp_path, name, dynamic):
    """Models the rewrite was not written for: a tiny zoo ResNet-18 in QOperator form (QLinearAdd, QGemm, pooling,
    MaxPool on codes) and a tiny BERT quantized dynamically (MatMulInteger)."""
    zoo = pytest.importorskip("relay_amp.tools.zoo")
    path = zoo.export_onnx(name, tmp_path / f"{name}.onnx", tiny=True)
    inputs = zoo.example_inputs(name, tiny=True)
    names = [i.name for i in onnx.load(str(path)).graph.input]
    calibration = [dict(zip(names, zoo.example_inputs(name, True, seed))) for seed in (1, 2)]
    quantized = tmp_path / f"{name}_int8.onnx"
    _quantized_by_onnxruntime(path, quantized, calibration, dynamic)
    session = onnxruntime.InferenceSession(str(quantized), providers=["CPUExecutionProvider"])
    theirs = session.run(None, dict(zip(names, inputs)))[0]
    mod = relay_amp.frontend.from_onnx(quantized)
    # the same arithmetic but for where ONNX Runtime rounds in int32: a few codes of the output's range
    np.testing.assert_allclose(relay_amp.run(mod, inputs)[0], theirs, atol=0.01 * np.abs(theirs).max())
    dtypes = {e.dtype for e in relay_amp.quant_plan(relay_amp.realize_qdq(mod)).entries}
    assert (DYNAMIC in dtypes) == dynamic and ("uint8" in dtypes) != dynamic


def test_onnxruntime_dynamic_digits_model_keeps_its_convs_in_float_and_its_accuracy(tmp_path):
    images, labels = digits.load_test_split()
    path = tmp_path / "digits_dynamic.onnx"
    _quantized_by_onnxruntime(digits.MODEL_FILE, path, [], dynamic=True)  # ConvInteger and MatMulInteger
    realized = relay_amp.realize_qdq(relay_amp.frontend.from_onnx(path, shape_dict={"image": [len(images), 1, 8, 8]}))
    entries = relay_amp.quant_plan(realized).entries
    assert [(e.op, e.dtype) for e in entries] == [("relax.nn.conv2d", "fallback")] * 2 + [("relax.matmul", DYNAMIC)] * 2
    assert entries[0].reason == "its input's scale is computed at run time: dynamic int8 covers matmuls"
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    theirs = session.run(None, {"image": images})[0]
    ours = relay_amp.run(realized, [images])[0]
    assert metrics.top1_accuracy(ours, labels) == pytest.approx(metrics.top1_accuracy(theirs, labels), abs=0.005)


def test_a_pads_dequantized_constant_value_is_a_float_constant_the_importer_reads():
    """ONNX Runtime's quantizer dequantizes a Pad's constant value too; TVM's importer reads it only as a constant."""
    nodes = [helper.make_node("DequantizeLinear", ["v_q", "vs", "vz"], ["v"]),
             helper.make_node("Pad", ["x", "pads", "v"], ["y"])]
    initializers = {"v_q": np.uint8(30), "vs": np.float32(0.1), "vz": np.uint8(20), "pads": np.array([0, 0, 1, 1] * 2)}
    model = _model(nodes, initializers, {"x": [1, 2, 3, 3]}, {"y": [1, 2, 5, 5]})
    folded = constant_dequantizes_folded(model)
    assert _op_types(folded) == ["Pad"] and _op_types(model) == ["DequantizeLinear", "Pad"]
    x = RNG.standard_normal((1, 2, 3, 3)).astype("float32")
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), [x])[0]
    np.testing.assert_allclose(got, _run(model, x), rtol=1e-6)
    assert got[0, 0, 0, 0] == pytest.approx(1.0)  # (30 - 20) x 0.1


def test_a_per_tensor_dequantized_constant_ignores_an_axis_past_its_rank():
    """ONNX Runtime's quantizer writes its per-channel default axis (1) on rank-1 weights it quantizes per tensor
    (PoolFormer's scalar constants); ONNX ignores the axis of a per-tensor scale, and so does the fold."""
    nodes = [helper.make_node("DequantizeLinear", ["v_q", "vs", "vz"], ["v"], axis=1),
             helper.make_node("Mul", ["x", "v"], ["y"])]
    initializers = {"v_q": np.array([30], "uint8"), "vs": np.float32(0.1), "vz": np.uint8(20)}
    model = _model(nodes, initializers, {"x": [1, 2, 3, 3]}, {"y": [1, 2, 3, 3]})
    folded = constant_dequantizes_folded(model)
    assert _op_types(folded) == ["Mul"]
    x = RNG.standard_normal((1, 2, 3, 3)).astype("float32")
    np.testing.assert_allclose(relay_amp.run(relay_amp.frontend.from_onnx(model), [x])[0], x * 1.0, rtol=1e-6)


@pytest.mark.parametrize("name", ["efficientnet_b0", "poolformer_s12"])
def test_onnxruntime_qdq_file_of_a_zoo_model_imports_and_runs_as_onnxruntime_does(tmp_path, name):
    """EfficientNet-B0's stride-2 depthwise convs pad by a Pad op, whose value ONNX Runtime's static QDQ quantizer
    dequantizes: the file failed to import until those dequantizes were folded. PoolFormer's file has dequantized
    scalar weights of rank 1 with an axis past it, which failed to fold."""
    zoo = pytest.importorskip("relay_amp.tools.zoo")
    from relay_amp.tools.peers import ort_quantized

    path = zoo.export_onnx(name, tmp_path / f"{name}.onnx", tiny=True)
    calibration = [zoo.example_inputs(name, True, seed) for seed in (1, 2)]
    quantized = ort_quantized(path, calibration, static=True, work_dir=tmp_path)
    inputs = zoo.example_inputs(name, tiny=True)
    ours = relay_amp.run(relay_amp.realize_qdq(relay_amp.frontend.from_onnx(quantized), fallback_dtype="float32"),
                         inputs)[0]
    fp32 = relay_amp.run(relay_amp.frontend.from_onnx(path), inputs)[0]
    # against fp32: ONNX Runtime's own output of EfficientNet-B0's file is all zeros (its logits' pair, from 2
    # calibration inputs, rounds them away; realize_qdq drops the pair on the logits)
    assert metrics.cosine_similarity(ours, fp32) > 0.95
