"""DropPaddingTaps: conv taps that read only padding are cut from the window, the padding with them."""

import numpy as np
import pytest
import tvm_ffi
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.passes.padding_taps import live_taps
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor
from pass_checks import assert_transforms

WEIGHT = np.arange(3 * 3 * 4 * 8, dtype="float32").reshape(3, 3, 4, 8)  # HWIO


def _atrous(rate: int, data_shape=(1, 6, 6, 4), weight=WEIGHT, strides=1):
    """A same-padded atrous conv, as DeepLab's ASPP has them, over a small NHWC map."""
    return single_output_module(
        lambda x: relax.op.nn.conv2d(x, relax.const(weight), strides=strides, padding=rate, dilation=rate,
                                     data_layout="NHWC", kernel_layout="HWIO"),
        tensor("x", data_shape))


def test_an_atrous_conv_reaching_past_the_map_becomes_its_centre_tap_undilated():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 6, 6, 4), "float32")) -> R.Tensor((1, 6, 6, 8), "float32"):
            with R.dataflow():
                gv = R.nn.conv2d(x, R.const(WEIGHT[1:2, 1:2]), padding=[0, 0, 0, 0], dilation=[1, 1],
                                 data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC")
                R.output(gv)
            return gv

    assert_transforms(relay_amp.transform.DropPaddingTaps(), _atrous(6), Expected)


def test_only_the_axis_whose_outer_taps_read_padding_is_cut():
    """Rate 5 over a 4-row, 8-column map: a row 5 away from any output row is padding, a column need not be."""
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 8, 4), "float32")) -> R.Tensor((1, 4, 8, 8), "float32"):
            with R.dataflow():
                gv = R.nn.conv2d(x, R.const(WEIGHT[1:2]), padding=[0, 5, 0, 5], dilation=[1, 5],
                                 data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC")
                R.output(gv)
            return gv

    assert_transforms(relay_amp.transform.DropPaddingTaps(), _atrous(5, (1, 4, 8, 4)), Expected)


@pytest.mark.parametrize("reason, module", [
    ("every tap reads the image for some output", lambda: _atrous(2)),
    ("a runtime weight", lambda: single_output_module(
        lambda x, w: relax.op.nn.conv2d(x, w, padding=6, dilation=6, data_layout="NHWC", kernel_layout="HWIO"),
        tensor("x", (1, 6, 6, 4)), tensor("w", (3, 3, 4, 8)))),
])
def test_convs_without_taps_to_cut_are_left_alone(reason, module):
    assert_transforms(relay_amp.transform.DropPaddingTaps(), module(), module())


def test_live_taps_are_those_reading_the_image_for_some_output():
    assert live_taps(size=6, taps=3, stride=1, dilation=6, before=6, outputs=6) == (1, 1)
    assert live_taps(size=6, taps=3, stride=1, dilation=5, before=5, outputs=6) == (0, 2)  # row 5 reads row 0
    assert live_taps(size=4, taps=3, stride=2, dilation=3, before=0, outputs=1) == (0, 1)  # tap 2 reads row 6
    assert live_taps(size=2, taps=3, stride=1, dilation=1, before=4, outputs=1) is None  # all padding


@pytest.mark.parametrize("rate, strides, layout", [(6, 1, "NHWC"), (5, 1, "NHWC"), (6, 2, "NHWC"), (9, 1, "NCHW")])
def test_cut_convs_compute_what_the_whole_windows_did(rate, strides, layout):
    """On the Relax VM in fp32 (taps of zeros dropped: the same sums, within rounding), and built for the CPU."""
    weight = np.random.default_rng(0).standard_normal((3, 3, 4, 8)).astype("float32")
    if layout == "NHWC":
        mod, shape = _atrous(rate, (1, 7, 5, 4), weight, strides), (1, 7, 5, 4)
    else:
        shape = (1, 4, 7, 5)
        mod = single_output_module(
            lambda x: relax.op.nn.conv2d(x, relax.const(weight.transpose(3, 2, 0, 1)), padding=rate, dilation=rate),
            tensor("x", shape))
    data = [np.random.default_rng(1).standard_normal(shape).astype("float32")]
    cut = relay_amp.transform.DropPaddingTaps()(mod)
    assert not tvm_ffi.structural_equal(cut, mod)
    expected = relay_amp.run(mod, data)[0]
    for got in (relay_amp.run(cut, data)[0], run_executable(relay_amp.build(mod), data)[0]):
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
