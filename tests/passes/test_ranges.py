"""Calibration and the float16 range guard."""

import numpy as np
import pytest
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import calibrate, digits
from relay_amp.compile.build import build_for_host
from relay_amp.passes.ranges import RangeStats, _probe, layer_input

from pass_checks import assert_transforms


@pytest.fixture(scope="module")
def images():
    test_images, labels = digits.load_test_split()
    return [x for x, _ in digits.batches(test_images, labels, 50)[:3]]


@pytest.fixture(scope="module")
def overflowing():
    return digits.load_overflowing_model()


def test_calibrate_records_each_layer_max_against_numpy(images):
    mod = digits.load_model()
    stats = calibrate(mod, images)
    assert [(l.index, l.name) for l in stats.layers] == [(l.index, l.name) for l in relay_amp.list_layers(mod)]
    # layer 0 is the first conv: its output is what the fp32 model computes before the first relu
    first_conv = relay_amp.run(relay_amp.frontend.from_onnx(_first_conv_model(), {"image": [50, 1, 8, 8]}),
                               [images[0]])[0]
    assert stats.layers[0].max_abs >= float(np.abs(first_conv).max()) - 1e-5


def test_calibration_compiles_its_probe_with_the_host_compiler_and_records_the_same_ranges(images):
    plain_compiles = []

    def plain(mod):
        plain_compiles.append(mod)
        return relay_amp.runtime.compile_module(mod)

    relay_amp.runtime.set_host_compiler(plain)
    try:
        unscheduled = calibrate(digits.load_model(), images)
    finally:
        relay_amp.runtime.set_host_compiler(build_for_host)
    assert len(plain_compiles) == 1
    kernels = calibrate(digits.load_model(), images)  # the probe on relay_amp's kernels and schedules
    np.testing.assert_allclose([l.max_abs for l in kernels.layers], [l.max_abs for l in unscheduled.layers],
                               rtol=1e-5)


@I.ir_module
class TwoConvs:
    @R.function
    def main(x: R.Tensor((1, 2, 4, 4), "float32")) -> R.Tensor((1, 2, 4, 4), "float32"):
        with R.dataflow():
            a = R.nn.conv2d(x, R.const(np.ones((2, 2, 1, 1), "float32")))
            b = R.nn.relu(a)
            c = R.nn.conv2d(b, R.const(np.ones((2, 2, 1, 1), "float32")))
            R.output(c)
        return c


@I.ir_module
class TwoConvsProbed:  # each conv's input; b leaves the dataflow block through an output var
    @R.function
    def main(x: R.Tensor((1, 2, 4, 4), "float32")) -> R.Tuple(R.Tensor((1, 2, 4, 4), "float32"),
                                                           R.Tensor((1, 2, 4, 4), "float32")):
        with R.dataflow():
            a = R.nn.conv2d(x, R.const(np.ones((2, 2, 1, 1), "float32")))
            b = R.nn.relu(a)
            c = R.nn.conv2d(b, R.const(np.ones((2, 2, 1, 1), "float32")))
            b_observed = b
            R.output(c, b_observed)
        return (x, b_observed)


def test_a_host_compiler_that_is_not_a_function_is_an_option_error():
    with pytest.raises(relay_amp.OptionError, match="host compiler must be a function"):
        relay_amp.runtime.set_host_compiler("llvm")


def test_the_probe_keeps_the_dataflow_block_and_hands_each_observed_value_out_of_it():
    assert_transforms(lambda mod: _probe(mod, ["relax.nn.conv2d"], "main", layer_input), TwoConvs, TwoConvsProbed)


def _first_conv_model():
    import onnx
    from onnx import helper

    model = onnx.load(digits.MODEL_FILE)
    graph = model.graph
    del graph.node[1:]
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("c1", onnx.TensorProto.FLOAT, ["N", 8, 8, 8]))
    return model


def test_range_guard_keeps_exactly_the_overflowing_layer_without_a_metric(images, overflowing):
    stats = calibrate(overflowing, images)
    assert [l.index for l in stats.over("float16")] == [1]
    assert stats.over("bfloat16") == []
    converted = relay_amp.to_mixed_precision(overflowing, "float16", ranges=stats)
    reasons = [e for e in relay_amp.precision_plan(converted).entries if e.reason.startswith("range")]
    assert [(e.op, e.dtype) for e in reasons] == [("relax.nn.conv2d", "float32")]
    layers = relay_amp.list_layers(converted)
    assert layers[1].input_dtypes == ("float32", "float32") and layers[0].input_dtypes == ("float16", "float16")
    test_images, labels = digits.load_test_split()
    outputs = np.concatenate([relay_amp.run(converted, [x])[0] for x in images])
    assert relay_amp.metrics.top1_accuracy(outputs, labels[:150]) > 0.95


def test_range_stats_round_trip_and_reject_another_module(images, overflowing, tmp_path):
    stats = calibrate(overflowing, images)
    stats.save(tmp_path / "ranges.json")
    assert RangeStats.load(tmp_path / "ranges.json") == stats
    with pytest.raises(relay_amp.LayerIndexError, match="calibrate this module"):
        relay_amp.to_mixed_precision(relay_amp.models.small_cnn(), "float16", ranges=stats)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(relay_amp.ModelLoadError, match="bad.json"):
        RangeStats.load(tmp_path / "bad.json")


def test_calibrate_rejects_empty_data_and_wrong_shapes():
    mod = digits.load_model()
    with pytest.raises(relay_amp.OptionError, match="empty"):
        calibrate(mod, [])
    with pytest.raises(relay_amp.OptionError, match="'image'"):
        calibrate(mod, [np.zeros((3, 1, 8, 8), "float32")])


def test_calibrating_a_model_with_symbolic_inputs_names_the_dim_to_bind(tmp_path):
    from tvm import relax, tirx

    from builders import single_output_module, tensor
    from relay_amp.tools.calibration import load_batches

    weight = relax.const(np.ones((4, 8), "float32"))
    mod = single_output_module(lambda x: relax.op.matmul(x, weight), tensor("x", (tirx.Var("batch", "int64"), 4)))
    with pytest.raises(relay_amp.OptionError, match=r"input 'x' has symbolic dim 'batch'.*--dim batch=N"):
        calibrate(mod, [np.ones((2, 4), "float32")])
    np.savez(tmp_path / "calib.npz", x=np.ones((2, 4), "float32"))
    with pytest.raises(relay_amp.OptionError, match=r"input 'x' has symbolic dim 'batch'.*--dim batch=N"):
        load_batches(mod, tmp_path / "calib.npz")
