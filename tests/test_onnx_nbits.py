"""onnx_nbits: ONNX Runtime's MatMulNBits imported as a MatMul by its dequantized weights, checked against ONNX
Runtime's kernels computing in fp32 (accuracy_level 0)."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.onnx_nbits import CONTRIB

onnxruntime = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)
ROWS, COLUMNS = 3, 24


def _packed(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes along the last axis packed into bytes, lowest bits first (the last axis a multiple of 8 / bits)."""
    per_byte = 8 // bits
    grouped = codes.astype("uint8").reshape(*codes.shape[:-1], -1, per_byte)
    return np.bitwise_or.reduce(grouped << (np.arange(per_byte, dtype="uint8") * bits), axis=-1).astype("uint8")


def _model(depth: int, block: int, bits: int, zero_points: "str | None", bias: bool, columns: int = COLUMNS,
           **attributes):
    """One MatMulNBits node over [ROWS, depth] inputs, its weights random codes of `bits` bits."""
    blocks = -(-depth // block)
    codes = RNG.integers(0, 2 ** bits, (columns, blocks, block))
    constants = {"B": _packed(codes, bits),
                 "scales": (RNG.standard_normal((columns, blocks)) * 0.1).astype("float32")}
    if zero_points == "packed":
        per_byte = 8 // bits
        points = RNG.integers(0, 2 ** bits, (columns, -(-blocks // per_byte) * per_byte))
        constants["zero_points"] = _packed(points, bits)
    elif zero_points == "float":
        constants["zero_points"] = RNG.uniform(0, 2 ** bits, (columns, blocks)).astype("float32")
    inputs = ["A", "B", "scales", "zero_points" if zero_points else ""]
    if bias:
        constants["bias"] = RNG.standard_normal(columns).astype("float32")
        inputs += ["", "bias"]
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain=CONTRIB, K=depth, N=columns, bits=bits,
                            block_size=block, **attributes)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [ROWS, depth])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [ROWS, columns])],
                              [numpy_helper.from_array(value, name) for name, value in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CONTRIB, 1)])


@pytest.mark.parametrize("depth, block, bits, zero_points, bias", [
    (64, 32, 4, None, False),  # GenAI's int4: symmetric, the middle code the zero point
    (64, 16, 4, "packed", True),
    (48, 32, 4, "float", False),  # K not a whole number of blocks
    (64, 32, 8, None, True),
    (64, 16, 8, "packed", False),
])
def test_matmul_nbits_matches_onnx_runtime(depth, block, bits, zero_points, bias):
    model = _model(depth, block, bits, zero_points, bias, accuracy_level=0)
    a = RNG.standard_normal((ROWS, depth)).astype("float32")
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"A": a})[0]
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), [a])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_files_dequantized_weights_are_computed_when_bound_and_import_the_same(tmp_path):
    """From a file, the rewrite writes no dequantized weights into the model: each is computed as the importer
    binds it (an int4 LLM's weights are not held twice in fp32), and the import equals the in-memory one's."""
    import onnx
    import tvm

    from relay_amp._onnx_graph import COMPUTED_LOCATION, importing_file, tensor_value
    from relay_amp.onnx_nbits import dequantized, nbits_matmuls_as_onnx

    model = _model(64, 16, 4, "packed", True)
    onnx.save(model, tmp_path / "nbits.onnx")
    tvm.ir.assert_structural_equal(relay_amp.frontend.from_onnx(tmp_path / "nbits.onnx"),
                                   relay_amp.frontend.from_onnx(model))
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    expected = dequantized(constants["B"], constants["scales"], constants["zero_points"],
                           {"bits": 4, "block_size": 16, "K": 64, "N": COLUMNS}).T
    with importing_file(str(tmp_path)):
        rewritten = nbits_matmuls_as_onnx(model)
        (weight,) = [tensor for tensor in rewritten.graph.initializer if list(tensor.dims) == [64, COLUMNS]]
        assert not weight.raw_data and weight.external_data[0].value == COMPUTED_LOCATION
        np.testing.assert_array_equal(tensor_value(weight), expected)


def test_weights_it_cannot_dequantize_are_refused_naming_the_node():
    model = _model(64, 32, 4, None, False)
    model.graph.node[0].input.append("g_idx")
    with pytest.raises(ModelLoadError, match="MatMulNBits node 'Y': .* this one has g_idx"):
        relay_amp.frontend.from_onnx(model)
    odd = _model(64, 32, 4, None, False)
    odd.graph.node[0].attribute[2].i = 3  # bits
    with pytest.raises(ModelLoadError, match="MatMulNBits node 'Y': relay_amp unpacks codes of 2, 4, 8 bits, not 3"):
        relay_amp.frontend.from_onnx(odd)


@pytest.mark.parametrize("zero_points", [None, "packed", "float"])
def test_int4_weights_from_onnx_runtime_pack_as_their_own_codes(zero_points):
    """An int4 file's weights (GenAI's symmetric blocks of 32, or ONNX Runtime's quantizer's with zero points) are
    held packed through import, and quantize_weights takes their codes, scales and zero points as they are, so the
    int4 model computes what ONNX Runtime's does."""
    model = _model(128, 32, 4, zero_points, False, columns=32, accuracy_level=0)  # int4 packs columns by 16
    packed = relay_amp.quantize_weights(relay_amp.frontend.from_onnx(model))
    assert "relay_amp_int4_matmul" in packed.script()
    a = RNG.standard_normal((ROWS, 128)).astype("float32")
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"A": a})[0]
    np.testing.assert_allclose(relay_amp.run(packed, [a])[0], expected, rtol=1e-5, atol=1e-5)


def _constants(mod) -> list:
    import tvm

    found = []
    tvm.relax.analysis.post_order_visit(
        mod["main"], lambda expr: found.append(expr.value) if isinstance(expr, tvm.ir.expr.GenericConst) else None)
    return found


@pytest.mark.parametrize("zero_points", [None, "packed", "float"])
def test_a_files_int4_weights_are_held_packed_until_a_backend_needs_them(tmp_path, zero_points):
    """An int4 LLM's weights imported dense were 8x the file's bytes in fp32; held packed, the module holds the
    file's codes (uint32 words), fp32 scales and zero points, and computes what ONNX Runtime does."""
    import onnx
    import tvm

    model = _model(128, 32, 4, zero_points, True, columns=32, accuracy_level=0)
    onnx.save(model, tmp_path / "nbits.onnx")
    mod = relay_amp.frontend.from_onnx(tmp_path / "nbits.onnx")
    tvm.ir.assert_structural_equal(mod, relay_amp.frontend.from_onnx(model))
    shapes = sorted((str(value.dtype), tuple(value.shape)) for value in _constants(mod))
    assert ("uint32", (2, 16, 16)) in shapes and not [shape for _, shape in shapes if shape == (128, 32)]
    a = RNG.standard_normal((ROWS, 128)).astype("float32")
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"A": a})[0]
    np.testing.assert_allclose(relay_amp.run(mod, [a])[0], expected, rtol=1e-5, atol=1e-5)
    executable = relay_amp.build(relay_amp.to_mixed_precision(mod, "bfloat16"), relay_amp.targets.host_preset())
    got = relay_amp.runtime.run_executable(executable, [a])[0].astype("float32")
    np.testing.assert_allclose(got, expected, atol=0.02 * np.abs(expected).max())  # bf16 weights and activations


@pytest.mark.parametrize("changes", [{"columns": 24}, {"bits": 8}, {"depth": 48}],
                         ids=["columns-off-16", "8-bit", "partial-block"])
def test_weights_off_the_packed_layout_import_dense(changes):
    options = {"depth": 128, "bits": 4, "columns": 32, **changes}
    model = _model(options["depth"], 32, options["bits"], None, False, columns=options["columns"])
    shapes = [tuple(value.shape) for value in _constants(relay_amp.frontend.from_onnx(model))]
    assert (options["depth"], options["columns"]) in shapes


@pytest.mark.parametrize("element, axis, block, zero_point", [
    (TensorProto.INT4, 0, 32, False),  # blocks along K: ONNX Runtime's QDQ int4 weights
    (TensorProto.INT4, 1, 16, False),
    (TensorProto.UINT4, 0, 16, True),
    (TensorProto.INT4, 1, 0, False),  # per output column
    (TensorProto.UINT4, None, 0, True),  # per tensor
])
def test_a_dequantize_of_int4_weights_is_folded_and_matches_onnx(element, axis, block, zero_point):
    """TVM cannot hold a 4-bit tensor: such files failed to import. Checked against ONNX's reference evaluator
    (ONNX Runtime's optimizer fuses the dequantize and MatMul into its MatMulNBits, which moves the product)."""
    from onnx.reference import ReferenceEvaluator

    depth, columns = 64, 32
    low, high = (-8, 8) if element == TensorProto.INT4 else (0, 16)
    scale_shape = ([depth // block, columns] if axis == 0 else [depth, columns // block]) if block else (
        [] if axis is None else [columns])
    constants = [helper.make_tensor("w", element, [depth, columns], RNG.integers(low, high, depth * columns).tolist()),
                 numpy_helper.from_array(RNG.uniform(0.05, 0.2, scale_shape).astype("float32"), "scale")]
    if zero_point:
        constants.append(helper.make_tensor("zero", element, scale_shape,
                                            RNG.integers(low, high, max(int(np.prod(scale_shape)), 1)).tolist()))
    attributes = {**({"axis": axis} if axis is not None else {}), **({"block_size": block} if block else {})}
    nodes = [helper.make_node("DequantizeLinear", ["w", "scale", *(["zero"] if zero_point else [])], ["weight"],
                              **attributes), helper.make_node("MatMul", ["A", "weight"], ["Y"])]
    graph = helper.make_graph(nodes, "int4", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [ROWS, depth])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [ROWS, columns])], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    a = RNG.standard_normal((ROWS, depth)).astype("float32")
    expected = ReferenceEvaluator(model).run(None, {"A": a})[0]
    np.testing.assert_allclose(relay_amp.run(relay_amp.frontend.from_onnx(model), [a])[0], expected, rtol=1e-5,
                               atol=1e-5)


def test_a_dequantize_of_int4_codes_by_a_computed_scale_is_refused_naming_the_node():
    nodes = [helper.make_node("DequantizeLinear", ["w", "scale"], ["Y"], name="dq")]
    graph = helper.make_graph(nodes, "int4", [helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])],
                              [helper.make_tensor("w", TensorProto.INT4, [4], [1, -2, 3, -4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    with pytest.raises(ModelLoadError, match="DequantizeLinear node 'dq': .* scale and zero point are constants"):
        relay_amp.frontend.from_onnx(model)


def _gather_model(bits: int, block: int, zero_points: bool, vocabulary: int = 20, width: int = 64, **attributes):
    """One GatherBlockQuantized node as GenAI writes a tied embedding: a Reshape of the LM head's packed codes
    [vocabulary, blocks, block x bits / 8] to [vocabulary, width x bits / 8], token ids [1, 5], fp32 scales."""
    blocks = width // block
    codes = RNG.integers(0, 2 ** bits, (vocabulary, blocks, block))
    constants = [numpy_helper.from_array(_packed(codes, bits), "codes"),
                 numpy_helper.from_array(np.array([vocabulary, -1], "int64"), "rows"),
                 numpy_helper.from_array((RNG.random((vocabulary, blocks)) * 0.1 + 0.01).astype("float32"), "scales")]
    if zero_points:
        points = RNG.integers(0, 2 ** bits, (vocabulary, blocks))
        constants.append(numpy_helper.from_array(_packed(points, bits), "points"))
    nodes = [helper.make_node("Reshape", ["codes", "rows"], ["table"]),
             helper.make_node("GatherBlockQuantized", ["table", "ids", "scales", *(["points"] if zero_points else [])],
                              ["Y"], domain=CONTRIB, bits=bits, block_size=block, **attributes)]
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 5])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 5, width])], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(CONTRIB, 1)])


@pytest.mark.parametrize("bits, block, zero_points", [(4, 32, False), (4, 16, True), (8, 32, False), (8, 16, True),
                                                      (2, 32, False)])
def test_gather_block_quantized_matches_onnx_runtime(bits, block, zero_points):
    """GenAI's int4 files of tied-embedding models look tokens up in the LM head's codes (did not import)."""
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _gather_model(bits, block, zero_points)
    ids = RNG.integers(0, 20, (1, 5)).astype("int64")
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"ids": ids})[0]
    np.testing.assert_array_equal(relay_amp.run(relay_amp.frontend.from_onnx(model), [ids])[0], expected)


def test_a_gather_block_quantized_it_does_not_unpack_is_refused_naming_the_node():
    for attribute, value, reason in (("gather_axis", 1, "gather_axis 1 and quantize_axis 1"),
                                     ("block_size", 48, "rows of 64 codes in blocks of 48")):
        model = _gather_model(4, 32, False)
        node = model.graph.node[1]
        kept = [existing for existing in node.attribute if existing.name != attribute]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute(attribute, value)])
        with pytest.raises(ModelLoadError, match=f"GatherBlockQuantized node 'Y': .*{reason}"):
            relay_amp.frontend.from_onnx(model)
