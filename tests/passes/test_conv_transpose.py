"""TransposedConvsAsConvs: a transposed conv as a stride-1 conv of its output phases, interleaved and cropped."""

import itertools

import numpy as np
import pytest
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.passes.conv_transpose import phase_weight
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor
from pass_checks import assert_transforms

torch = pytest.importorskip("torch")

WEIGHT = np.arange(2 * 3 * 4 * 4, dtype="float32").reshape(2, 3, 4, 4)  # IOHW: 2 inputs, 3 outputs, 4x4


def _transposed(weight=WEIGHT, data_shape=(1, 2, 5, 5), strides=2, padding=1, output_padding=0, **attrs):
    return single_output_module(
        lambda x: relax.op.nn.conv2d_transpose(x, relax.const(weight), strides=strides, padding=padding,
                                               output_padding=output_padding, **attrs),
        tensor("x", data_shape))


def test_a_stride_2_transposed_conv_becomes_four_phases_of_a_2x2_conv_interleaved():
    """GAN generators' 4x4, stride 2, padding 1: each phase reads 2x2 taps; the 6x6 phase grid interleaves to
    12x12, cropped by the padding to 10x10."""
    phases_weight = phase_weight(WEIGHT.transpose(2, 3, 0, 1), (2, 2))
    assert phases_weight.shape == (2, 2, 2, 12)

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 5, 5), "float32")) -> R.Tensor((1, 3, 10, 10), "float32"):
            with R.dataflow():
                phases = R.nn.conv2d(x, R.const(phases_weight), padding=[1, 1, 1, 1], data_layout="NCHW",
                                     kernel_layout="HWIO", out_layout="NCHW")
                split = R.reshape(phases, R.shape([1, 2, 2, 3, 6, 6]))
                moved = R.permute_dims(split, axes=[0, 3, 4, 1, 5, 2])
                whole = R.reshape(moved, R.shape([1, 3, 12, 12]))
                gv = R.strided_slice(whole, axes=[2, 3], begin=[1, 1], end=[11, 11])
                R.output(gv)
            return gv

    assert_transforms(relay_amp.transform.TransposedConvsAsConvs(), _transposed(), Expected)


def test_phase_taps_are_the_weights_taps_a_stride_apart_reversed():
    hwio = np.arange(3 * 3, dtype="float32").reshape(3, 3, 1, 1)  # taps numbered row * 3 + column
    phases = phase_weight(hwio, (2, 2)).reshape(2, 2, 2, 2)  # taps (m, n), phases (a, b)
    np.testing.assert_array_equal(phases[:, :, 0, 0], [[8, 6], [2, 0]])  # phase (0, 0): taps 0, 2 of each axis
    np.testing.assert_array_equal(phases[:, :, 1, 1], [[0, 0], [0, 4]])  # phase (1, 1): tap 1 only, the rest zero


@pytest.mark.parametrize("reason, module", [
    ("a runtime weight", lambda: single_output_module(
        lambda x, w: relax.op.nn.conv2d_transpose(x, w, strides=2), tensor("x", (1, 2, 5, 5)),
        tensor("w", (2, 3, 4, 4)))),
    ("groups", lambda: _transposed(np.ones((2, 1, 4, 4), "float32"), groups=2)),
    ("dilation", lambda: _transposed(dilation=2)),
])
def test_transposed_convs_the_rewrite_does_not_take_are_left_alone(reason, module):
    assert_transforms(relay_amp.transform.TransposedConvsAsConvs(), module(), module())


CASES = [(k, s, p, op) for k, s, p, op in itertools.product((1, 2, 3, 4, 5), (1, 2, 3), (0, 1, 2), (0, 1))
         if op < s and p < k]


@pytest.mark.parametrize("kernel, stride, padding, output_padding", CASES)
def test_phase_convs_compute_what_torch_conv_transpose2d_does(kernel, stride, padding, output_padding):
    """Every kernel size, stride, padding and output padding up to 5, 3, 2, 1, on the Relax VM in fp32 (the same
    products summed in another order)."""
    rng = np.random.default_rng(kernel * 100 + stride * 10 + padding)
    weight = rng.standard_normal((6, 5, kernel, kernel)).astype("float32")
    data = rng.standard_normal((2, 6, 7, 9)).astype("float32")
    expected = torch.nn.functional.conv_transpose2d(torch.from_numpy(data), torch.from_numpy(weight), stride=stride,
                                                    padding=padding, output_padding=output_padding).numpy()
    mod = relay_amp.transform.TransposedConvsAsConvs()(
        _transposed(weight, data.shape, stride, padding, output_padding))
    assert "conv2d_transpose" not in mod.script()
    got = relay_amp.run(mod, [data])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_built_nhwc_transposed_conv_matches_torch(dtype, tolerance):
    """Channels-last with an HWIO weight (which TVM's own legalization does not take), built for the CPU (its phase
    conv on the kernels) in fp32 and under AMP's bf16 (its rounding of operands and products)."""
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((3, 3, 16, 16)).astype("float32")
    mod = single_output_module(
        lambda x: relax.op.nn.conv2d_transpose(x, relax.const(weight), strides=2, padding=1, output_padding=1,
                                               data_layout="NHWC", kernel_layout="HWIO"),
        tensor("x", (1, 6, 6, 16)))
    data = [rng.standard_normal((1, 6, 6, 16)).astype("float32")]
    built = mod if dtype == "float32" else relay_amp.to_mixed_precision(mod, dtype)
    got = run_executable(relay_amp.build(built), data)[0].astype("float64")
    expected = torch.nn.functional.conv_transpose2d(
        torch.from_numpy(data[0].transpose(0, 3, 1, 2)), torch.from_numpy(weight.transpose(2, 3, 0, 1)), stride=2,
        padding=1, output_padding=1).numpy().transpose(0, 2, 3, 1)
    assert got.shape == (1, 12, 12, 16)
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


@pytest.mark.parametrize("layout", ["NCW", "NWC"])
@pytest.mark.parametrize("kernel, stride, padding, output_padding", [(8, 4, 2, 0), (3, 2, 1, 1), (4, 1, 0, 0)])
def test_a_1d_transposed_conv_becomes_the_phase_conv_of_one_row(layout, kernel, stride, padding, output_padding):
    """A vocoder's upsampling (HiFi-GAN: kernel 8, stride 4), in both layouts, as a conv2d of one row, squeezed."""
    rng = np.random.default_rng(kernel + stride)
    weight = rng.standard_normal((6, 5, kernel)).astype("float32")  # IOW
    data = rng.standard_normal((2, 6, 11)).astype("float32")
    expected = torch.nn.functional.conv_transpose1d(torch.from_numpy(data), torch.from_numpy(weight), stride=stride,
                                                    padding=padding, output_padding=output_padding).numpy()
    attrs = dict(strides=stride, padding=padding, output_padding=output_padding)
    if layout == "NWC":
        data, expected = data.transpose(0, 2, 1), expected.transpose(0, 2, 1)
        attrs.update(data_layout="NWC", kernel_layout="WIO")
        weight = weight.transpose(2, 0, 1)
    mod = relay_amp.transform.TransposedConvsAsConvs()(single_output_module(
        lambda x: relax.op.nn.conv1d_transpose(x, relax.const(np.ascontiguousarray(weight)), **attrs),
        tensor("x", data.shape)))
    ops = [b.value.op.name for b in mod["main"].body.blocks[0].bindings]
    assert "relax.nn.conv2d" in ops and ops[-1] == "relax.squeeze" and "relax.nn.conv1d_transpose" not in ops
    got = relay_amp.run(mod, [np.ascontiguousarray(data)])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
