"""Bias correction: calibration's channel means, the weights' mean rounding error, and what taking it out does."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import LayerIndexError
from relay_amp.passes.quantize import QuantPlan
from relay_amp.passes.quantize.bias import ChannelMeans, input_channel_axis, rounding_shift, weight_axes

from builders import single_output_module, tensor

GROUPED = np.random.default_rng(0).normal(size=(8, 3, 3, 3)).astype("float32")  # 2 groups of 3 input channels


def conv_module(weight: np.ndarray, padding: int = 1) -> tvm.IRModule:
    """main(x) = relu(x) convolved with `weight` (in groups of its input depth), then a ReLU."""
    groups = 6 // weight.shape[1]
    return single_output_module(lambda x: relax.op.nn.relu(relax.op.nn.conv2d(
        relax.op.nn.relu(x), relax.const(weight), padding=padding, groups=groups)), tensor("x", (1, 6, 12, 12)))


def test_channel_means_average_each_channel_over_every_batch():
    rng = np.random.default_rng(1)
    batches = [rng.normal(size=(n, 4, 5, 5)) + np.arange(4).reshape(1, 4, 1, 1) for n in (1, 3)]
    means = ChannelMeans(1)
    for batch in batches:
        means.add(batch.astype("float32"))
    expected = np.concatenate(batches).mean(axis=(0, 2, 3))
    np.testing.assert_allclose(means.means, expected, rtol=1e-6)
    rows = ChannelMeans(-1)
    rows.add(np.array([[1.0, 2.0], [3.0, 6.0]], "float32"))
    assert rows.means == (2.0, 4.0)


def test_input_channel_axis_is_a_convs_c_and_a_matmuls_last_and_weight_axes_read_o_and_i():
    conv = relax.op.nn.conv2d(tensor("x", (1, 8, 8, 6)), relax.const(GROUPED.transpose(2, 3, 1, 0)),
                              data_layout="NHWC", kernel_layout="HWIO", groups=2)
    assert input_channel_axis(conv) == 3 and weight_axes(conv) == (3, 2)
    matmul = relax.op.matmul(tensor("x", (4, 2)), relax.const(np.ones((2, 3), "float32")))
    assert input_channel_axis(matmul) == -1 and weight_axes(matmul) == (1, 0)


def test_the_rounding_shift_is_what_a_conv_of_the_error_makes_of_an_input_at_its_channel_means():
    """Each output channel's shift equals TVM's conv of the weight error (groups of 3 channels) over a map holding
    each input channel's mean, away from the padding."""
    error = np.random.default_rng(2).normal(scale=0.01, size=GROUPED.shape).astype("float32")
    means = (0.5, 1.0, 2.0, -1.0, 0.25, 3.0)
    conv = relax.op.nn.conv2d(tensor("x", (1, 6, 5, 5)), relax.const(GROUPED), groups=2)
    shift = rounding_shift(conv, GROUPED, GROUPED + error, means)
    flat = np.broadcast_to(np.array(means, "float32").reshape(1, 6, 1, 1), (1, 6, 5, 5)).copy()
    error_conv = single_output_module(lambda x: relax.op.nn.conv2d(x, relax.const(error), groups=2),
                                      tensor("x", (1, 6, 5, 5)))
    np.testing.assert_allclose(relay_amp.run(error_conv, [flat])[0][0, :, 1, 1], shift, rtol=1e-4)
    weight = np.array([[1.0, 2.0], [3.0, 4.0]], "float32")
    matmul = relax.op.matmul(tensor("x", (4, 2)), relax.const(weight))
    np.testing.assert_allclose(rounding_shift(matmul, weight, weight + [[0.1, 0.0], [0.0, -0.2]], (2.0, 1.0)),
                               [0.2, -0.2])


def _calibration(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(1, 6, 12, 12)) + 0.5).astype("float32") for _ in range(count)]


def test_bias_correction_takes_out_most_of_a_conv_outputs_mean_error():
    """Over 16 inputs that calibration never saw, each output channel's mean error against fp32 (a ReLU's inputs
    have positive means, so the weights' rounding shifts every pixel alike): at most a third of it is left, and the
    largest error is no worse than 1.1x. Weights are scaled so their codes round coarsely (a few per channel)."""
    weight = np.round(GROUPED * 2) / 2 + 0.01 * np.random.default_rng(3).normal(size=GROUPED.shape).astype("float32")
    mod = conv_module(weight.astype("float32"), padding=0)
    inputs = _calibration(16, 7)
    reference = np.stack([relay_amp.run(mod, [x])[0] for x in inputs])
    errors = {}
    for corrected in (False, True):
        quantized = relay_amp.quantize(mod, _calibration(16, 5), fallback_dtype="float32", bias_correction=corrected)
        errors[corrected] = np.stack([relay_amp.run(quantized, [x])[0] for x in inputs]) - reference
    channel_mean = {key: np.abs(error.mean(axis=(0, 1, 3, 4))).max() for key, error in errors.items()}
    assert channel_mean[True] <= channel_mean[False] / 3
    assert np.abs(errors[True]).max() <= 1.1 * np.abs(errors[False]).max()


def test_the_plan_holds_each_quantized_layers_input_means_and_a_mismatch_is_refused():
    mod = conv_module(GROUPED)
    quantized = relay_amp.quantize(mod, _calibration(4, 5), fallback_dtype="float32")
    [entry] = relay_amp.quant_plan(quantized).entries
    relu = np.maximum(np.stack(_calibration(4, 5)), 0)
    np.testing.assert_allclose(entry.input_means, relu.mean(axis=(0, 1, 3, 4)), rtol=1e-5)
    plan = relay_amp.quant_plan(quantized)
    assert QuantPlan.from_json(plan.to_json()) == plan and "1 correct their weights' rounding error" in plan.summary()
    off = relay_amp.quantize(mod, _calibration(4, 5), fallback_dtype="float32", bias_correction=False)
    assert relay_amp.quant_plan(off).entries[0].input_means == ()
    plan.entries[0] = type(entry)(**{**entry.__dict__, "input_means": entry.input_means[:4]})
    with pytest.raises(LayerIndexError, match="entry 0 .* has 4 input means; the layer's input has 6 channels"):
        relay_amp.apply_quant_plan(mod, plan)


def test_per_row_matmuls_take_the_rounding_error_out_after_the_rows_scale():
    """Dynamic matmuls (per-row codes): each output column's mean error over 8 unseen batches falls to at most a
    third. Weights are coarse enough that their codes' rounding dominates."""
    rng = np.random.default_rng(8)
    weight = (np.round(rng.normal(size=(16, 8)) * 2) / 2 + 0.01 * rng.normal(size=(16, 8))).astype("float32")
    mod = single_output_module(lambda x: relax.op.matmul(x, relax.const(weight)), tensor("x", (64, 16)))

    def batches(count, seed):
        generator = np.random.default_rng(seed)
        return [(generator.normal(size=(64, 16)) + 1.0).astype("float32") for _ in range(count)]

    inputs = batches(8, 9)
    reference = np.stack([relay_amp.run(mod, [x])[0] for x in inputs])
    column_mean = {}
    for corrected in (False, True):
        quantized = relay_amp.quantize(mod, batches(8, 10), dynamic_matmuls=True, fallback_dtype="float32",
                                       bias_correction=corrected)
        error = np.stack([relay_amp.run(quantized, [x])[0] for x in inputs]) - reference
        column_mean[corrected] = np.abs(error.mean(axis=(0, 1))).max()
    assert column_mean[True] <= column_mean[False] / 3
