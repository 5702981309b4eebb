"""conv3d: a channels-last conv3d becomes one conv2d over its frames, depth taps stacked as channels."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import targets
from relay_amp.backend.cpu.conv3d import Conv3dAsConv2d, depth_stacked_weight
from relay_amp.passes.layout import conv_layout_passes
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor
from pass_checks import assert_transforms

WEIGHT = np.arange(3 * 3 * 3 * 2 * 4, dtype="float32").reshape(3, 3, 3, 2, 4)  # DHWIO


def _conv3d(weight=WEIGHT, data_shape=(1, 4, 6, 6, 2), strides=1, padding=1, dilation=1):
    return single_output_module(
        lambda x: relax.op.nn.conv3d(x, relax.const(weight), strides=strides, padding=padding, dilation=dilation,
                                     data_layout="NDHWC", kernel_layout="DHWIO"),
        tensor("x", data_shape))


def test_a_conv3d_becomes_a_conv2d_over_frames_of_its_depth_taps_stacked_as_channels():
    stacked = depth_stacked_weight(WEIGHT)
    assert stacked.shape == (3, 3, 6, 4)
    np.testing.assert_array_equal(stacked[:, :, 2:4], WEIGHT[1])  # channels 2..3: depth tap 1

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 6, 6, 2), "float32")) -> R.Tensor((1, 4, 6, 6, 4), "float32"):
            with R.dataflow():
                padded = R.nn.pad(x, [0, 0, 1, 1, 0, 0, 0, 0, 0, 0])
                first = R.strided_slice(padded, axes=[1], begin=[0], end=[4], strides=[1])
                second = R.strided_slice(padded, axes=[1], begin=[1], end=[5], strides=[1])
                third = R.strided_slice(padded, axes=[1], begin=[2], end=[6], strides=[1])
                taps = R.concat([first, second, third], axis=4)
                conv = R.nn.conv2d(R.reshape(taps, R.shape([4, 6, 6, 6])), R.const(stacked), padding=[1, 1, 1, 1],
                                   data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC")
                gv = R.reshape(conv, R.shape([1, 4, 6, 6, 4]))
                R.output(gv)
            return gv

    assert_transforms(Conv3dAsConv2d(), _conv3d(), Expected)


def test_depth_taps_reading_only_padding_are_left_out():
    """Two frames at stride 2 (R3D-18's last downsampling): the one output frame's tap 0 reads frame -1."""
    after = Conv3dAsConv2d()(_conv3d(data_shape=(1, 2, 6, 6, 2), strides=2))
    calls = [b.value for b in after["main"].body.blocks[0].bindings]
    assert [c.op.name for c in calls] == ["relax.strided_slice", "relax.strided_slice", "relax.concat",
                                          "relax.reshape", "relax.nn.conv2d", "relax.reshape"]  # no pad
    assert tuple(int(d) for d in calls[4].args[1].ty.shape) == (3, 3, 4, 4)  # taps 1 and 2


@pytest.mark.parametrize("reason, module", [
    ("channels first", lambda: single_output_module(
        lambda x: relax.op.nn.conv3d(x, relax.const(np.ones((4, 2, 3, 3, 3), "float32"))),
        tensor("x", (1, 2, 4, 6, 6)))),
    ("grouped", lambda: single_output_module(
        lambda x: relax.op.nn.conv3d(x, relax.const(np.ones((3, 3, 3, 1, 4), "float32")), groups=2,
                                     data_layout="NDHWC", kernel_layout="DHWIO"), tensor("x", (1, 4, 6, 6, 2)))),
])
def test_conv3ds_the_rewrite_does_not_take_are_left_alone(reason, module):
    assert_transforms(Conv3dAsConv2d(), module(), module())


@pytest.mark.parametrize("shape, strides, padding, dilation", [
    ((1, 5, 7, 6, 3), 1, 1, 1), ((2, 6, 8, 8, 4), (2, 1, 2), (1, 0, 2), 1), ((1, 7, 6, 6, 2), 1, 2, (2, 1, 1)),
    ((1, 2, 6, 6, 2), 2, 1, 1), ((1, 3, 5, 5, 2), 1, (0, 1, 1), 1),
])
def test_frame_convs_compute_what_the_conv3d_did(shape, strides, padding, dilation):
    """On the Relax VM in fp32 (the same products summed in another order)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3, 3, 3, shape[-1], 8)).astype("float32")
    mod = _conv3d(weight, shape, strides, padding, dilation)
    data = [rng.standard_normal(shape).astype("float32")]
    expected = relay_amp.run(mod, data)[0]
    got = relay_amp.run(Conv3dAsConv2d()(mod), data)[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("dtype, feature, tolerance", [("float32", "avx512f", 1e-5), ("bfloat16", "avx512_bf16", 1e-2)])
def test_built_channels_first_conv3d_runs_on_the_kernels_and_matches_fp32(dtype, feature, tolerance):
    """A model's NCDHW conv3d is converted to NDHWC with the conv2ds, then to a conv2d on the kernels; bf16 under
    AMP (its rounding of operands) and the stride-2 conv over 2 frames whose taps read padding alone."""
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}")
    rng = np.random.default_rng(1)
    weights = [relax.const(rng.standard_normal(shape).astype("float32")) for shape in [(16, 3, 3, 3, 3),
                                                                                       (16, 16, 3, 3, 3)]]
    x = relax.Var("x", relax.TensorType((1, 3, 4, 8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            first = bb.emit(relax.op.nn.relu(bb.emit(relax.op.nn.conv3d(x, weights[0], strides=(2, 1, 1),
                                                                         padding=1))))
            out = bb.emit_output(relax.op.nn.conv3d(first, weights[1], strides=2, padding=1))
        bb.emit_func_output(out)
    mod = bb.get()
    converted = tvm.transform.Sequential(conv_layout_passes(["NHWC", "HWIO"]))(mod)
    assert [str(b.value.attrs.data_layout) for b in converted["main"].body.blocks[0].bindings
            if b.value.op.name == "relax.nn.conv3d"] == ["NDHWC", "NDHWC"]
    built = mod if dtype == "float32" else relay_amp.to_mixed_precision(mod, dtype)
    executable = relay_amp.build(built, "cpu-avx512-bf16")
    assert "relay_amp_dot_kernel" in executable.mod.imports[0].inspect_source("asm")
    data = [rng.standard_normal((1, 3, 4, 8, 8)).astype("float32")]
    expected = relay_amp.run(mod, data)[0]
    got = run_executable(executable, data)[0].astype("float64")
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()
