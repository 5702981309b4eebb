"""multiplier: a depthwise conv with a channel multiplier becomes a depthwise conv of repeated input channels."""

import numpy as np
import pytest
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.backend.cpu import pipeline
from relay_amp.backend.cpu.multiplier import RepeatMultiplierInputs
from relay_amp.compile.build import build
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms


@I.ir_module
class Multiplier:  # FastViT's downsampling conv: 8 channels to 16, two outputs per input channel
    @R.function
    def main(x: R.Tensor((1, 10, 10, 8), "float32"), w: R.Tensor((3, 3, 1, 16), "float32")):
        with R.dataflow():
            gv = R.nn.conv2d(x, w, strides=2, padding=1, groups=8, data_layout="NHWC", kernel_layout="HWIO")
            R.output(gv)
        return gv


def test_a_conv_with_two_outputs_per_input_channel_is_a_depthwise_conv_of_repeated_channels():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 10, 10, 8), "float32"), w: R.Tensor((3, 3, 1, 16), "float32")):
            with R.dataflow():
                repeated = R.repeat(x, 2, axis=3)
                gv = R.nn.conv2d(repeated, w, strides=2, padding=1, groups=16, data_layout="NHWC",
                                 kernel_layout="HWIO")
                R.output(gv)
            return gv

    assert_transforms(RepeatMultiplierInputs(), Multiplier, Expected)


def test_the_built_conv_computes_what_the_grouped_conv_computes():
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(shape).astype("float32") for shape in [(1, 10, 10, 8), (3, 3, 1, 16)]]
    got = run_executable(build(Multiplier, "cpu"), inputs)[0]
    np.testing.assert_allclose(got, relay_amp.run(Multiplier, inputs)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reason,groups,in_channels", [
    ("a depthwise conv already", 16, 16),
    ("several input channels per group", 4, 8),
    ("a dense conv", 1, 8),
])
def test_other_convs_stay(reason, groups, in_channels):
    x = relax.Var("x", relax.TensorType((1, 10, 10, in_channels), "float32"))
    w = relax.Var("w", relax.TensorType((3, 3, in_channels // groups, 16), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x, w]):
        with builder.dataflow():
            out = builder.emit_output(relax.op.nn.conv2d(x, w, padding=1, groups=groups, data_layout="NHWC",
                                                         kernel_layout="HWIO"))
        builder.emit_func_output(out)
    kept = builder.get()
    assert_transforms(RepeatMultiplierInputs(), kept, kept)


def test_the_cpu_pipeline_repeats_after_the_layout_change():
    names = [p.info.name for p in pipeline.prepare_passes(relay_amp.targets.get_target("cpu-avx512-bf16")).passes]
    assert names.index("relay_amp.RepeatMultiplierInputs") > names.index("relay_amp.Conv1dAsConv2d")
