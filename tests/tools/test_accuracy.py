"""Accuracy-aware conversion on a real model: the digits CNN and its held-out split."""

import numpy as np
import pytest

import relay_amp
from relay_amp import digits, metrics, tune_precision
from relay_amp.runtime import run_executable

# fp32 accuracy of the shipped model on its 450 held-out digits (9 batches of 50)
FP32_ACCURACY = 0.98


@pytest.fixture(scope="module")
def test_batches():
    images, labels = digits.load_test_split()
    return digits.batches(images, labels, 50)


@pytest.fixture(scope="module")
def overflowing():
    return digits.load_overflowing_model()


def test_shipped_model_has_its_stated_fp32_accuracy(test_batches):
    mod = digits.load_model()
    outputs = np.concatenate([relay_amp.run(mod, [x])[0] for x, _ in test_batches])
    labels = np.concatenate([y for _, y in test_batches])
    assert metrics.top1_accuracy(outputs, labels) == pytest.approx(FP32_ACCURACY, abs=1e-9)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tune_precision_meets_tolerance_on_held_out_split(test_batches, dtype):
    converted, plan, report = tune_precision(digits.load_model(), test_batches, metrics.top1_accuracy, dtype,
                                             tolerance=0.01, progress=False)
    assert report.met and report.final >= report.goal == pytest.approx(FP32_ACCURACY * 0.99)
    assert plan.target_dtype == dtype and relay_amp.precision_plan(converted) == plan
    assert report.evaluations >= 1


def test_overflowing_layer_is_the_one_kept_in_fp32(test_batches, overflowing):
    converted, plan, report = tune_precision(overflowing, test_batches, metrics.top1_accuracy, "float16",
                                             tolerance=0.01, progress=False)
    assert report.met and report.final >= report.goal
    assert [layer.index for layer in report.kept_layers] == [1]
    assert relay_amp.list_layers(converted)[1].input_dtypes == ("float32", "float32")
    assert relay_amp.list_layers(converted)[0].input_dtypes == ("float16", "float16")


def test_without_fallback_the_overflowing_layer_breaks_float16(test_batches, overflowing):
    converted = relay_amp.to_mixed_precision(overflowing, "float16")
    outputs = np.concatenate([relay_amp.run(converted, [x])[0] for x, _ in test_batches[:3]])
    labels = np.concatenate([y for _, y in test_batches[:3]])
    assert metrics.top1_accuracy(outputs, labels) < 0.5


@pytest.mark.parametrize("strategy", ["sensitivity", "bisect"])
def test_other_strategies_find_the_same_layer_and_record_sensitivity(test_batches, overflowing, strategy):
    _, _, report = tune_precision(overflowing, [x for x, _ in test_batches[:3]], None, "float16",
                                  tolerance=0.01, strategy=strategy, progress=False)
    assert report.met and [layer.index for layer in report.kept_layers] == [1]
    if strategy == "sensitivity":
        sensitivity = {layer.index: layer.sensitivity for layer in report.layers}
        assert max(sensitivity, key=sensitivity.get) == 1


def test_unreachable_goal_returns_the_all_fp32_plan_and_says_so(test_batches):
    # max_pool2d forced into low precision is no layer a search can fall back, so bit-exact
    # agreement with the fp32 logits cannot be reached
    mod = digits.load_model()
    fp32 = relay_amp.build(mod, "cpu")  # the build the search compares against, bit for bit
    pairs = [(x, run_executable(fp32, [x])[0]) for x, _ in test_batches[:2]]

    def bit_exact(outputs, reference):
        return float(np.array_equal(outputs, reference))

    converted, plan, report = tune_precision(mod, pairs, bit_exact, "float16", tolerance=0.0, progress=False,
                                             target_dtype_ops=["nn.conv2d", "matmul", "nn.max_pool2d"])
    assert not report.met and "cannot be met" in report.message
    assert {e.dtype for e in plan.entries} == {"float32"}
    assert len(report.kept_layers) == 4


def test_max_trials_stops_the_search_with_a_clear_report(test_batches, overflowing):
    converted, plan, report = tune_precision(overflowing, test_batches[:2], metrics.top1_accuracy, "float16",
                                             tolerance=0.0, max_trials=1, progress=False)
    assert not report.met and "max_trials=1" in report.message and "all-fp32" in report.message
    assert {e.dtype for e in plan.entries} == {"float32"}
    assert relay_amp.list_layers(converted)[1].input_dtypes == ("float32", "float32")


def test_report_plot_writes_a_png(test_batches, overflowing, tmp_path):
    _, _, report = tune_precision(overflowing, test_batches[:2], metrics.top1_accuracy, "float16",
                                  strategy="sensitivity", progress=False)
    report.plot(tmp_path / "sensitivity.png")
    assert (tmp_path / "sensitivity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "layers in float32" in report.summary()


def test_int8_search_keeps_the_outlier_layer_in_the_fallback_dtype(test_batches):
    # conv2 reads one channel 1000x larger than the rest: per-tensor int8 codes round the others to zero
    outlier = digits.load_outlier_model()
    broken = relay_amp.quantize(outlier, [x for x, _ in test_batches[:2]])
    outputs = np.concatenate([relay_amp.run(broken, [x])[0] for x, _ in test_batches[:2]])
    assert metrics.top1_accuracy(outputs, np.concatenate([y for _, y in test_batches[:2]])) < 0.5
    converted, plan, report = tune_precision(outlier, test_batches, metrics.top1_accuracy, "int8", tolerance=0.01,
                                             calibration=[x for x, _ in test_batches[:2]], progress=False)
    assert report.met and report.final >= report.goal and report.kept_dtype == "bfloat16"
    assert [layer.index for layer in report.kept_layers] == [1]
    assert isinstance(plan, relay_amp.QuantPlan) and relay_amp.quant_plan(converted) == plan
    assert [entry.quantized for entry in plan.entries] == [True, False, True, True]
    assert plan.entries[1].reason == "kept by tune_precision"


def test_int8_search_that_cannot_meet_its_goal_returns_fp32(test_batches):
    mod = digits.load_model()
    fp32 = relay_amp.build(mod, "cpu")
    pairs = [(x, run_executable(fp32, [x])[0]) for x, _ in test_batches[:1]]

    def bit_exact(outputs, reference):
        return float(np.array_equal(outputs, reference))

    converted, plan, report = tune_precision(mod, pairs, bit_exact, "int8", tolerance=0.0, strategy="bisect",
                                             progress=False)
    assert not report.met and "all-fp32" in report.message and report.kept_dtype == "float32"
    assert len(report.kept_layers) == 4 and plan.fallback_dtype == "float32"
    assert not any(entry.quantized for entry in plan.entries)
    assert all(layer.input_dtypes == ("float32", "float32") for layer in relay_amp.list_layers(converted))


def test_bad_input_is_a_clear_error(test_batches):
    mod = digits.load_model()
    with pytest.raises(relay_amp.OptionError, match="empty"):
        tune_precision(mod, [], metrics.top1_accuracy, progress=False)
    with pytest.raises(relay_amp.OptionError, match="NaN"):
        tune_precision(mod, test_batches[:1], lambda out, labels: float("nan"), progress=False)
    with pytest.raises(relay_amp.OptionError, match=r"must be \(50, 1, 8, 8\) float32"):
        tune_precision(mod, [(np.zeros((10, 1, 8, 8), "float32"), np.zeros(10))], metrics.top1_accuracy,
                       progress=False)
    with pytest.raises(relay_amp.OptionError, match="pairs"):
        tune_precision(mod, [x for x, _ in test_batches[:1]], metrics.top1_accuracy, progress=False)
    with pytest.raises(relay_amp.OptionError, match="strategy"):
        tune_precision(mod, test_batches[:1], metrics.top1_accuracy, strategy="greedy", progress=False)
    with pytest.raises(relay_amp.OptionError, match="calibration is for target_dtype='int8'"):
        tune_precision(mod, test_batches[:1], metrics.top1_accuracy, calibration=[], progress=False)
    with pytest.raises(relay_amp.OptionError, match="observer"):
        tune_precision(mod, test_batches[:1], metrics.top1_accuracy, "int8", observer="median", progress=False)
