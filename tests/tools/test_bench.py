"""Benchmarks: every variant built, timed and checked against fp32 in one run (no timing asserted)."""

import json

import numpy as np
import pytest

import relay_amp
from relay_amp import models
from relay_amp.tools import digits
from relay_amp.tools.bench import benchmark, format_rows, logs_for, max_relative_error, rows_to_json, variant
from relay_amp.tools.cli import main


@pytest.fixture(scope="module")
def rows():
    return benchmark(models.small_cnn(), ["bfloat16", "float16"], "cpu", repeat=3, model="small_cnn")


def test_benchmark_measures_fp32_first_then_each_dtype(rows):
    assert [r.dtype for r in rows] == ["float32", "bfloat16", "float16"]
    assert rows[0].speedup == 1.0 and rows[0].max_rel_error == 0.0
    assert all(r.median_ms > 0 and r.speedup > 0 and not r.tuned for r in rows)
    # same tolerances as the AMP numeric tests
    assert rows[1].max_rel_error < 2e-2 and rows[2].max_rel_error < 5e-3


def test_rows_print_as_table_and_json(rows):
    table = format_rows(rows)
    assert "speed-up vs fp32" in table and "bfloat16" in table and "torch" not in table and "runner" not in table
    data = json.loads(rows_to_json(rows, model="small_cnn"))
    assert data["model"] == "small_cnn" and len(data["rows"]) == 3


def test_missing_log_directory_means_an_untuned_build(tmp_path):
    rows = benchmark(models.small_cnn(), ["float32"], "cpu", tune_logs=tmp_path, model="small_cnn", repeat=2)
    assert [r.tuned for r in rows] == [False]


def test_bench_command_prints_json(capsys):
    assert main(["bench", "small_cnn", "--dtypes", "fp32,bf16", "--repeat", "2", "--json", "--exact-math"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [row["dtype"] for row in data["rows"]] == ["float32", "bfloat16"]


def test_bench_command_rejects_unknown_target(capsys):
    assert main(["bench", "small_cnn", "--target", "tpu"]) == 1
    assert "unknown target preset 'tpu'" in capsys.readouterr().err


def test_bench_command_rejects_a_missing_log_directory(capsys):
    assert main(["bench", "small_cnn", "--tune-logs", "no/such/dir"]) == 1
    assert "tuning log directory no/such/dir does not exist" in capsys.readouterr().err


def test_int8_variant_in_nhwc_with_torch_columns():
    pytest.importorskip("torch")
    mod = models.resnet18_conv(channels=16, image_size=8)
    rows = benchmark(mod, ["int8"], "cpu", repeat=2, layout="NHWC", torch_twin="resnet18_conv")
    assert [r.dtype for r in rows] == ["float32", "int8"]
    assert rows[0].torch_ms > 0 and rows[1].torch_ms is None  # PyTorch has no int8 twin
    assert "TVM speed-up vs torch" in format_rows(rows)


def test_unknown_layout_is_an_option_error():
    with pytest.raises(relay_amp.OptionError, match="NCHW4c"):
        benchmark(models.small_cnn(), ["float32"], "cpu", layout="NCHW4c")


def test_int8q_is_calibrated_and_close_to_fp32_where_int8_recast_is_not():
    mod = models.resnet18_conv(channels=16, image_size=8)
    rows = benchmark(mod, ["int8", "int8q"], "cpu", repeat=2)
    errors = {r.dtype: r.max_rel_error for r in rows}
    assert errors["int8q"] < 0.05 < errors["int8"]


def test_int4w_packs_the_weights_of_bf16_matmuls_and_keeps_int4_error():
    mod = models.linear(size=256)
    assert "relay_amp_int4_matmul" in variant(mod, "int4w").script()
    (_, row) = benchmark(mod, ["int4w"], "cpu", repeat=2)
    assert row.dtype == "int4w" and 0.01 < row.max_rel_error < 0.3  # int4 rounding of Gaussian weights


def test_max_relative_error_is_the_largest_difference_over_the_largest_reference_value():
    reference = np.array([[2.0, -4.0], [1.0, 0.0]])
    assert max_relative_error(reference + [[0.5, 0.0], [0.0, -1.0]], reference) == 0.25
    assert max_relative_error(reference, reference) == 0.0
    assert max_relative_error(np.ones(2), np.zeros(2)) == 1e12  # an all-zero reference: no division by zero


def test_onnxruntime_runs_beside_relay_amp_on_the_same_file_in_fp32_and_its_own_int8():
    pytest.importorskip("onnxruntime")
    rows = benchmark(digits.load_model(batch=4), ["int8q"], "cpu", repeat=2, rounds=2, onnx_file=digits.MODEL_FILE)
    assert [(r.runner, r.dtype) for r in rows] == [
        ("relay_amp", "float32"), ("relay_amp", "int8q"), ("onnxruntime", "float32"),
        ("onnxruntime", "int8 (static QDQ)")]  # a CNN: static QDQ, calibrated on relay_amp's int8q batches
    errors = {(r.runner, r.dtype): r.max_rel_error for r in rows}
    assert errors[("onnxruntime", "float32")] < 1e-5  # the same model, another runtime
    # random images, calibrated on other random images: 0.19 for both when written
    assert errors[("relay_amp", "int8q")] < 0.3 and errors[("onnxruntime", "int8 (static QDQ)")] < 0.3
    assert all(r.median_ms > 0 and r.speedup > 0 for r in rows)
    table = format_rows(rows)
    assert table.splitlines()[0].split()[0] == "runner" and "onnxruntime" in table


def test_bench_command_times_onnxruntime_on_an_onnx_file(capsys):
    pytest.importorskip("onnxruntime")
    assert main(["bench", str(digits.MODEL_FILE), "--dtypes", "fp32", "--repeat", "1", "--rounds", "1", "--ort",
                 "--dim", "N=2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(row["runner"], row["dtype"]) for row in data["rows"]] == [("relay_amp", "float32"),
                                                                        ("onnxruntime", "float32")]
    assert data["rounds"] == 1


def test_bench_command_rejects_ort_for_a_built_in_model(capsys):
    assert main(["bench", "small_cnn", "--ort"]) == 1
    assert "--ort times ONNX Runtime on an ONNX file; 'small_cnn' is a built-in model" in capsys.readouterr().err


def test_bench_command_calibrates_int8q_and_onnxruntimes_int8_on_the_given_data(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    calib = tmp_path / "calib.npz"  # ranges 1000x the benchmark's random images: both int8 models lose them
    np.savez(calib, image=np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype("float32") * 1000)
    assert main(["bench", str(digits.MODEL_FILE), "--dtypes", "int8q", "--repeat", "1", "--rounds", "1", "--ort",
                 "--dim", "N=2", "--calib", str(calib), "--json"]) == 0
    errors = {row["runner"]: row["max_rel_error"] for row in json.loads(capsys.readouterr().out)["rows"]
              if row["dtype"] != "float32"}
    assert errors["relay_amp"] > 0.5 and errors["onnxruntime"] > 0.5  # random calibration: 0.19 for both


def test_a_peer_that_fails_leaves_its_row_out_with_a_warning(tmp_path):
    pytest.importorskip("onnxruntime")
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an ONNX file")
    with pytest.warns(UserWarning, match=f"ONNX Runtime cannot run {broken} .*; its row is left out"):
        rows = benchmark(models.small_cnn(), ["float32"], "cpu", repeat=1, rounds=1, onnx_file=broken)
    assert [(r.runner, r.dtype) for r in rows] == [("relay_amp", "float32")]


def test_logs_for_takes_a_log_or_its_model_dtype_target_log_under_a_root(tmp_path):
    from relay_amp.compile.tuning import LOG_FILES, log_dir

    one = tmp_path / "one"
    one.mkdir()
    for name in LOG_FILES:
        (one / name).write_text("")
    nested = log_dir(tmp_path, "bert", "bfloat16", "cpu")
    nested.mkdir()
    assert logs_for(None, "bert", "bfloat16", "cpu") is None
    assert logs_for(one, "bert", "bfloat16", "cpu") == one
    assert logs_for(tmp_path, "bert", "bfloat16", "cpu") == nested
    assert logs_for(tmp_path, "bert", "float32", "cpu") is None
    with pytest.raises(relay_amp.TuningError, match="does not exist"):
        logs_for(tmp_path / "missing", "bert", "bfloat16", "cpu")
