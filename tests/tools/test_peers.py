"""Peers: rotating timing blocks, and ONNX Runtime sessions and int8 models of a file."""

from pathlib import Path

import numpy as np
import onnx
import pytest

from relay_amp import OptionError
from relay_amp.tools import peers

pytest.importorskip("onnxruntime")


def test_rotating_medians_time_every_runner_in_turn():
    order = []
    medians = peers.rotating_medians({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                     rounds=2, repeat=2)
    assert order == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3  # a warm-up run, then the block, in turn
    assert set(medians) == {"a", "b"} and all(ms >= 0 for ms in medians.values())
    with pytest.raises(OptionError, match="at least 1"):
        peers.rotating_medians({"a": lambda: None}, rounds=0, repeat=1)


def _matmul_file(path):
    weight = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype("float32"), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])], [weight])
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), path)
    return path


def test_ort_runner_feeds_the_inputs_by_the_sessions_names(tmp_path):
    x = np.ones((2, 8), "float32")
    (y,) = peers.ort_runner(peers.ort_session(_matmul_file(tmp_path / "m.onnx")), [x])()
    weight = onnx.numpy_helper.to_array(onnx.load(tmp_path / "m.onnx").graph.initializer[0])
    np.testing.assert_allclose(y, x @ weight, rtol=1e-6)


@pytest.mark.parametrize("static, op", [(True, "QuantizeLinear"), (False, "DynamicQuantizeLinear")])
def test_ort_quantized_writes_onnxruntimes_int8_model_into_the_work_dir(tmp_path, static, op, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the paths relative to it
    path = _matmul_file(Path("m.onnx"))
    work_dir = Path("work")
    work_dir.mkdir()
    calibration = [[np.random.default_rng(seed).standard_normal((2, 8)).astype("float32")] for seed in range(4)]
    quantized = peers.ort_quantized(path, calibration, static, work_dir)
    assert quantized.parent == tmp_path / "work" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "work"]
    assert op in {node.op_type for node in onnx.load(quantized).graph.node}
    (y,) = peers.ort_runner(peers.ort_session(quantized), calibration[0])()
    assert y.shape == (2, 4)


def test_ort_quantized_leaves_what_onnxruntimes_preprocessing_writes_in_the_work_dir(tmp_path, monkeypatch):
    """ONNX Runtime's shape inference writes a temporary model into the current directory and leaves it where it
    fails (Swin-V2-T): the preprocessing runs in the work dir, so the failure leaves the caller's directory as it
    was."""
    quantization = pytest.importorskip("onnxruntime.quantization")

    def failing_preprocessing(model, output, **options):
        open("sym_shape_infer_temp.onnx", "w").close()
        raise RuntimeError("Incomplete symbolic shape inference")

    monkeypatch.setattr(quantization, "quant_pre_process", failing_preprocessing)
    work_dir, caller = tmp_path / "work", tmp_path / "caller"
    work_dir.mkdir()
    caller.mkdir()
    monkeypatch.chdir(caller)
    with pytest.raises(RuntimeError, match="symbolic shape"):
        peers.ort_quantized(_matmul_file(tmp_path / "m.onnx"), [], True, work_dir)
    assert list(caller.iterdir()) == [] and [p.name for p in work_dir.iterdir()] == ["sym_shape_infer_temp.onnx"]


def test_ort_quantized_preprocesses_again_without_symbolic_shapes_where_their_inference_fails(tmp_path, monkeypatch):
    """ONNX Runtime's symbolic shape inference fails on Swin-T's file ("Incomplete symbolic shape inference", a bare
    Exception); the preprocessing without it goes through, and so does the quantization."""
    quantization = pytest.importorskip("onnxruntime.quantization")
    preprocess, calls = quantization.quant_pre_process, []

    def preprocessing(model, output, skip_symbolic_shape=False):
        calls.append(skip_symbolic_shape)
        if not skip_symbolic_shape:
            raise Exception("Incomplete symbolic shape inference")  # the type ONNX Runtime raises
        preprocess(model, output, skip_symbolic_shape=True)

    monkeypatch.setattr(quantization, "quant_pre_process", preprocessing)
    calibration = [[np.random.default_rng(seed).standard_normal((2, 8)).astype("float32")] for seed in range(4)]
    quantized = peers.ort_quantized(_matmul_file(tmp_path / "m.onnx"), calibration, True, tmp_path)
    assert calls == [False, True]
    assert "QuantizeLinear" in {node.op_type for node in onnx.load(quantized).graph.node}
