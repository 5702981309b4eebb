"""conv1d: a channels-last conv1d becomes a conv2d of height 1, which the kernels take."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.backend.cpu import pipeline
from relay_amp.backend.cpu.conv1d import Conv1dAsConv2d
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms


def test_a_channels_last_conv1d_is_a_unit_height_conv2d_between_reshapes():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 20, 8), "float32"), w: R.Tensor((3, 4, 16), "float32")) -> R.Tensor((1, 10, 16), "float32"):
            with R.dataflow():
                gv = R.nn.conv1d(x, w, strides=2, padding=[1, 0], dilation=1, groups=2, data_layout="NWC",
                                 kernel_layout="WIO", out_layout="NWC")
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 20, 8), "float32"), w: R.Tensor((3, 4, 16), "float32")) -> R.Tensor((1, 10, 16), "float32"):
            with R.dataflow():
                conv = R.nn.conv2d(R.reshape(x, (1, 1, 20, 8)), R.reshape(w, (1, 3, 4, 16)), strides=[1, 2],
                                   padding=[0, 1, 0, 0], dilation=[1, 1], groups=2, data_layout="NHWC",
                                   kernel_layout="HWIO", out_layout="NHWC")
                gv = R.reshape(conv, (1, 10, 16))
                R.output(gv)
            return gv

    assert_transforms(Conv1dAsConv2d(), Before, Expected)


def test_a_channels_first_conv1d_is_left_as_it_is():
    @I.ir_module
    class ChannelsFirst:
        @R.function
        def main(x: R.Tensor((1, 8, 20), "float32"), w: R.Tensor((16, 8, 3), "float32")) -> R.Tensor((1, 16, 18), "float32"):
            with R.dataflow():
                gv = R.nn.conv1d(x, w)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(Conv1dAsConv2d()(ChannelsFirst), ChannelsFirst)


def audio_front_end() -> tvm.IRModule:
    """wav2vec2's feature encoder in small: conv1d (stride 5), GroupNorm(C, C), GELU, conv1d (stride 2), GELU."""
    rng = np.random.default_rng(0)
    weights = [relax.const((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype("float32"))
               for shape in [(32, 1, 10), (32, 32, 3)]]
    gamma, beta = relax.const(rng.uniform(0.5, 1.5, 32).astype("float32")), relax.const(np.zeros(32, "float32"))
    x = relax.Var("x", relax.TensorType((1, 1, 400), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            first = bb.emit(relax.op.nn.conv1d(x, weights[0], strides=5))
            norm = bb.emit(relax.op.nn.gelu(bb.emit(relax.op.nn.group_norm(first, gamma, beta, 32, 1, [2]))))
            out = bb.emit_output(relax.op.nn.gelu(bb.emit(relax.op.nn.conv1d(norm, weights[1], strides=2))))
        bb.emit_func_output(out)
    return bb.get()


def test_an_audio_front_ends_conv1ds_all_reach_the_kernels():
    target = relay_amp.targets.get_target("cpu-avx512-bf16")
    with target, tvm.transform.PassContext(opt_level=3):
        prepared = pipeline.prepare_passes(target)(relay_amp.to_mixed_precision(audio_front_end(), "bfloat16"))
    script = prepared.script()
    assert "conv1d" not in script and script.count("relay_amp_dot_kernel") >= 2


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_an_audio_front_end_builds_and_matches_tvms_build(dtype, tolerance):
    fp32 = audio_front_end()
    mod = fp32 if dtype == "float32" else relay_amp.to_mixed_precision(fp32, dtype)
    data = np.random.default_rng(1).standard_normal((1, 1, 400)).astype("float32")
    built = run_executable(relay_amp.build(mod, relay_amp.targets.host_preset()), [data])[0]
    reference = relay_amp.run(fp32, [data])[0]
    np.testing.assert_allclose(built.astype("float32"), reference, atol=tolerance * np.abs(reference).max())
