"""The relay-amp command line."""

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import models
from relay_amp.runtime import run_executable
from relay_amp.tools.cli import main

from builders import mismatched_projection


def test_layers_prints_the_layer_table(capsys):
    assert main(["layers", "small_cnn"]) == 0
    out = capsys.readouterr().out
    assert "nn.conv2d" in out and "matmul" in out
    assert "3 layers, longest chain 3" in out


def test_recast_writes_tvmscript_atomically(tmp_path, capsys):
    target = tmp_path / "out" / "recast.py"
    assert main(["recast", "small_cnn", "--dtype", "float16", "--out-dtype", "float32", "--skip", "0",
                 "-o", str(target)]) == 0
    text = target.read_text()
    assert 'R.astype(' in text and 'dtype="float16"' in text
    assert [p.name for p in target.parent.iterdir()] == ["recast.py"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["layers", "missing.onnx"], "not found: missing.onnx"),
        (["layers", "small_cnn", "--ops", "nn.conv9d"], "unknown op 'nn.conv9d'"),
        (["recast", "small_cnn", "--skip", "7"], "layer index 7 is out of range"),
        (["layers", "small_cnn", "--dim", "batch=2"], "built-in model 'small_cnn' takes --batch"),
    ],
)
def test_errors_print_one_line_and_exit_nonzero(argv, fragment, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_model_tvm_cannot_import_prints_one_line_naming_the_node(tmp_path, capsys):
    path = tmp_path / "mismatch.onnx"
    onnx.save(mismatched_projection(), path)
    assert main(["layers", str(path)]) == 1
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.count("\n") == 1
    assert printed.err.startswith("relay-amp: error: cannot import ONNX model 'mismatch': node 'proj' (MatMul): ")


def test_bad_option_value_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["recast", "small_cnn", "--skip", "a,b"])
    assert exit_info.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_convert_prints_plan_and_writes_plan_and_module(tmp_path, capsys):
    plan_path, module_path = tmp_path / "plan.json", tmp_path / "model.json"
    assert main(["convert", "small_cnn", "--dtype", "fp16", "--exclude", "0",
                 "--plan", str(plan_path), "-o", str(module_path)]) == 0
    out = capsys.readouterr().out
    assert "excluded" in out and "casts inserted" in out
    from relay_amp import PrecisionPlan, load, precision_plan

    plan = PrecisionPlan.load(plan_path)
    assert plan.target_dtype == "float16"
    assert precision_plan(load(module_path)) == plan
    assert main(["convert", "small_cnn", "--apply-plan", str(plan_path)]) == 0
    assert "plan" in capsys.readouterr().out


def test_convert_rejects_unsupported_dtype(capsys):
    assert main(["convert", "small_cnn", "--dtype", "int4"]) == 1
    assert "target_dtype: 'int4' is not supported" in capsys.readouterr().err


def test_tune_rejects_a_bad_trial_count(capsys):
    assert main(["tune", "small_cnn", "--trials", "0", "--work-dir", "unused"]) == 1
    assert "trials must be a positive integer" in capsys.readouterr().err


def test_quantize_calibrates_on_a_npz_prints_the_plan_and_writes_plan_and_module(tmp_path, capsys):
    import numpy as np

    from relay_amp import QuantPlan, load, quant_plan

    calib, plan_path, module_path = tmp_path / "calib.npz", tmp_path / "quant.json", tmp_path / "q.json"
    np.savez(calib, x=np.random.default_rng(0).standard_normal((4, 3, 16, 16)))
    assert main(["quantize", "small_cnn", "--calib", str(calib), "--observer", "percentile", "--exclude", "-1",
                 "--fallback", "fp32", "--plan", str(plan_path), "-o", str(module_path)]) == 0
    out = capsys.readouterr().out
    assert "2 of 3 layers in int8 (percentile observer" in out and "excluded" in out
    plan = QuantPlan.load(plan_path)
    assert quant_plan(load(module_path)) == plan and plan.fallback_dtype == "float32"
    assert plan.quantized_residuals and "residual adds read uint8 codes" in out
    assert main(["quantize", "small_cnn", "--apply-plan", str(plan_path)]) == 0
    assert "2 of 3 layers in int8" in capsys.readouterr().out
    assert main(["quantize", "small_cnn", "--float-residuals", "--plan", str(plan_path)]) == 0
    assert "residual adds read floating point" in capsys.readouterr().out
    assert not QuantPlan.load(plan_path).quantized_residuals
    assert main(["quantize", "small_cnn", "--activation-bits", "7", "--plan", str(plan_path)]) == 0
    assert ("3 of 3 layers in int8 (minmax observer, per_channel weights; 3 with 7-bit activation codes; 3 correct "
            "their weights' rounding error)") in capsys.readouterr().out
    assert {entry.bits for entry in QuantPlan.load(plan_path).entries} == {7}
    assert main(["quantize", "small_cnn", "--no-bias-correction", "--plan", str(plan_path)]) == 0
    assert "; 0 correct their weights' rounding error" in capsys.readouterr().out
    assert not any(entry.input_means for entry in QuantPlan.load(plan_path).entries)


def test_quantize_shares_a_range_between_layers_reading_one_tensor_unless_told_not_to(tmp_path, capsys):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype("float32"), name) for name in "ab"]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "a"], ["ya"]), helper.make_node("Conv", ["x", "b"], ["yb"]),
         helper.make_node("Mul", ["ya", "yb"], ["y"])], "two_convs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], weights)
    path = tmp_path / "two_convs.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main(["quantize", str(path)]) == 0
    assert "2 layers share a range with others" in capsys.readouterr().out
    assert main(["quantize", str(path), "--separate-ranges"]) == 0
    assert "0 layers share a range with others" in capsys.readouterr().out
    assert main(["quantize", str(path), "--from-qdq", "--separate-ranges"]) == 1
    assert "--separate-ranges does not apply with --from-qdq" in capsys.readouterr().err


def test_quantize_errors_are_one_line(tmp_path, capsys):
    assert main(["quantize", "small_cnn", "--calib", str(tmp_path / "none.npz")]) == 1
    err = capsys.readouterr().err
    assert "none.npz" in err and err.count("\n") == 1


def test_quantize_from_qdq_runs_a_quantized_onnx_file_with_its_ranges(tmp_path, capsys):
    quantization = pytest.importorskip("onnxruntime.quantization")
    from relay_amp import digits, load, quant_plan

    class OneBatch(quantization.CalibrationDataReader):
        def __init__(self):
            self.batches = [{"image": digits.load_test_split()[0][:50]}]

        def get_next(self):
            return self.batches.pop() if self.batches else None

    qdq_file, module_path = tmp_path / "digits_qdq.onnx", tmp_path / "int8.json"
    quantization.quantize_static(str(digits.MODEL_FILE), str(qdq_file), OneBatch(), per_channel=True)
    assert main(["quantize", str(qdq_file), "--from-qdq", "-o", str(module_path)]) == 0
    assert "4 of 4 layers in int8 (qdq observer" in capsys.readouterr().out
    assert quant_plan(load(module_path)).entries[0].reason == "from the model's QuantizeLinear"
    assert main(["quantize", str(qdq_file), "--from-qdq", "--calib", "x.npz"]) == 1
    assert "--calib does not apply with --from-qdq" in capsys.readouterr().err
    assert main(["quantize", "small_cnn", "--from-qdq"]) == 1
    assert "not a QDQ model" in capsys.readouterr().err


def test_dim_sizes_an_onnx_files_dynamic_axes(tmp_path, capsys):
    import onnx

    from builders import positions_onnx

    path = tmp_path / "positions.onnx"
    onnx.save(positions_onnx(), path)
    assert main(["bench", str(path), "--dtypes", "fp32", "--repeat", "1"]) == 1
    err = capsys.readouterr().err
    assert "symbolic dim 'batch'" in err and "--dim batch=N" in err and err.count("\n") == 1
    assert main(["bench", str(path), "--dtypes", "fp32", "--repeat", "1", "--dim", "batch=2,seq=4"]) == 0
    assert "float32" in capsys.readouterr().out
    assert main(["bench", str(path), "--dim", "sequence=4"]) == 1
    assert "no symbolic input dim 'sequence'; its symbolic dims: batch, seq" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", str(path), "--dim", "batch"])
    assert "expected NAME=SIZE" in capsys.readouterr().err


def _run_library(path, inputs):
    """The main of the library at `path` on `inputs`, through the TVM runtime alone."""
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()


def _built_in_process(mod):
    """The output of `mod` built for the host's preset and run on the small CNN's example inputs."""
    return run_executable(relay_amp.build(mod, relay_amp.targets.host_preset()), models.example_inputs(mod))[0]


def test_build_writes_a_library_of_the_converted_model(tmp_path, capsys):
    path = tmp_path / "small_cnn.so"
    assert main(["build", "small_cnn", "--dtype", "bf16", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}" in out and '["main"](data: float32[1, 3, 16, 16])' in out  # what main takes
    mod = models.small_cnn()
    got = _run_library(path, models.example_inputs(mod))
    np.testing.assert_allclose(got, _built_in_process(relay_amp.to_mixed_precision(mod, "bfloat16")), rtol=1e-6)
    fp32 = _built_in_process(mod)
    assert 1e-4 < np.abs(got - fp32).max() / np.abs(fp32).max() < 2e-2  # converted: bf16 AMP's error


def test_build_takes_a_module_saved_by_convert_as_it_is(tmp_path, capsys):
    saved, path = tmp_path / "small_cnn_fp16.json", tmp_path / "small_cnn_fp16.so"
    assert main(["convert", "small_cnn", "--dtype", "fp16", "-o", str(saved)]) == 0
    assert main(["build", str(saved), "-o", str(path)]) == 0
    converted = relay_amp.load(saved)
    np.testing.assert_allclose(_run_library(path, models.example_inputs(converted)), _built_in_process(converted),
                               rtol=1e-6)


def test_build_of_int8q_without_calibration_data_says_it_used_random_inputs(tmp_path, capsys):
    assert main(["build", "small_cnn", "--dtype", "int8q", "-o", str(tmp_path / "q.so")]) == 0
    assert "int8q calibrated on random inputs" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["build", "small_cnn", "-o", "model.zip"], "written as .so or .tar, got 'model.zip'"),
    (["build", "small_cnn", "--calib", "calib.npz", "-o", "model.so"], "--calib calibrates --dtype int8q"),
    (["build", "missing.json", "-o", "model.so"], "cannot load a module from missing.json"),
])
def test_build_errors_are_one_line_before_anything_is_built(argv, fragment, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
