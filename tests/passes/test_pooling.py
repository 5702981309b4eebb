"""GlobalPoolWindows: a pool whose window covers the whole input is a spatial mean or max. SeparableMaxPools: a large
max-pool window is a pool of rows then one of columns."""

import numpy as np
import pytest
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor
from pass_checks import assert_transforms


@I.ir_module
class HugeWindow:  # Hugging Face EfficientNet's head: AvgPool2d(hidden_dim, ceil_mode=True) on a small map
    @R.function
    def main(x: R.Tensor((1, 8, 7, 7), "float32")) -> R.Tensor((1, 8, 1, 1), "float32"):
        with R.dataflow():
            gv = R.nn.avg_pool2d(x, pool_size=[1280, 1280], strides=[1280, 1280], ceil_mode=True,
                                 count_include_pad=True)
            R.output(gv)
        return gv


def test_a_window_covering_the_input_becomes_a_spatial_mean():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8, 7, 7), "float32")) -> R.Tensor((1, 8, 1, 1), "float32"):
            with R.dataflow():
                gv = R.mean(x, axis=[2, 3], keepdims=True)
                R.output(gv)
            return gv

    assert_transforms(relay_amp.transform.GlobalPoolWindows(), HugeWindow, Expected)


def test_an_nhwc_max_pool_over_the_whole_input_becomes_a_spatial_max():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 7, 7, 8), "float32")) -> R.Tensor((1, 1, 1, 8), "float32"):
            with R.dataflow():
                gv = R.nn.max_pool2d(x, pool_size=[7, 7], strides=[7, 7], layout="NHWC")
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 7, 7, 8), "float32")) -> R.Tensor((1, 1, 1, 8), "float32"):
            with R.dataflow():
                gv = R.max(x, axis=[1, 2], keepdims=True)
                R.output(gv)
            return gv

    assert_transforms(relay_amp.transform.GlobalPoolWindows(), Before, Expected)


@pytest.mark.parametrize("reason, pool", [
    ("a window smaller than the input", lambda x: R.nn.avg_pool2d(x, pool_size=[3, 3], strides=[3, 3])),
    ("padding counts in the average", lambda x: R.nn.avg_pool2d(x, pool_size=[9, 9], padding=[1, 1, 1, 1],
                                                                 count_include_pad=True)),
])
def test_other_pools_are_left_alone(reason, pool):
    mod = single_output_module(pool, tensor("x", (1, 8, 7, 7)))
    assert_transforms(relay_amp.transform.GlobalPoolWindows(), mod, mod)


def test_the_build_computes_the_huge_window_as_tvm_does():
    x = np.random.default_rng(0).standard_normal((1, 8, 7, 7)).astype("float32")
    expected = relay_amp.run(HugeWindow, [x])[0]  # TVM's own pooling: the slow, exact reference
    got = run_executable(relay_amp.build(HugeWindow, "cpu"), [x])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)  # 49 values summed in another order


@I.ir_module
class SpatialPyramidPool:  # YOLOv3-SPP's 13x13 window at stride 1, and a 3x3 one, too small to separate
    @R.function
    def main(x: R.Tensor((1, 20, 20, 8), "float32")) -> R.Tensor((1, 20, 20, 8), "float32"):
        with R.dataflow():
            big = R.nn.max_pool2d(x, pool_size=[13, 13], strides=[1, 1], padding=[6, 6, 6, 6], layout="NHWC")
            gv = R.nn.max_pool2d(big, pool_size=[3, 3], strides=[1, 1], padding=[1, 1, 1, 1], layout="NHWC")
            R.output(gv)
        return gv


def test_a_large_max_pool_window_becomes_a_pool_of_rows_then_of_columns():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 20, 20, 8), "float32")) -> R.Tensor((1, 20, 20, 8), "float32"):
            with R.dataflow():
                rows = R.nn.max_pool2d(x, pool_size=[1, 13], strides=[1, 1], padding=[0, 6, 0, 6], layout="NHWC",
                                       out_layout="NHWC")
                big = R.nn.max_pool2d(rows, pool_size=[13, 1], strides=[1, 1], padding=[6, 0, 6, 0], layout="NHWC",
                                      out_layout="NHWC")
                gv = R.nn.max_pool2d(big, pool_size=[3, 3], strides=[1, 1], padding=[1, 1, 1, 1], layout="NHWC")
                R.output(gv)
            return gv

    assert_transforms(relay_amp.transform.SeparableMaxPools(), SpatialPyramidPool, Expected)


@pytest.mark.parametrize("window, strides, padding, ceil_mode", [
    ((5, 5), (1, 1), (2, 2, 2, 2), False),  # YOLOv5's SPPF
    ((9, 9), (1, 1), (4, 4, 4, 4), False),
    ((7, 5), (2, 3), (3, 1, 2, 2), True),  # unequal sides, strides and pads, the last window partial
])
def test_separated_max_pools_compute_the_same_values(window, strides, padding, ceil_mode):
    def pool(x):
        return relax.op.nn.max_pool2d(x, window, strides, padding, ceil_mode=ceil_mode, layout="NHWC")

    before = single_output_module(pool, tensor("x", (1, 23, 19, 16)))
    after = relay_amp.transform.SeparableMaxPools()(before)
    relax.analysis.well_formed(after)
    assert after.script().count("R.nn.max_pool2d") == 2
    x = np.random.default_rng(0).standard_normal((1, 23, 19, 16)).astype("float32")
    exact = run_executable(relax.build(before, target="llvm"), [x])[0]  # TVM's own pool, before any rewrite
    np.testing.assert_array_equal(run_executable(relay_amp.build(after, "cpu"), [x])[0], exact)


@pytest.mark.parametrize("window", [9, 13])
def test_a_bf16_max_pool_of_a_large_window_builds_and_matches_fp32(window):
    """bf16 max pools of windows over MAX_WINDOW (64) values left the CPU schedules' window path and failed to
    build (a vectorized bf16 store): YOLOv3-SPP's 9x9 and 13x13 pools."""
    def pool(x):
        return relax.op.nn.max_pool2d(x, (window, window), (1, 1), (window // 2,) * 4, layout="NHWC")

    x = np.random.default_rng(0).standard_normal((1, 20, 20, 64)).astype("float32")
    wide = run_executable(relay_amp.build(single_output_module(pool, tensor("x", x.shape)), "cpu"), [x])[0]
    narrow = relay_amp.build(single_output_module(pool, tensor("x", x.shape, "bfloat16")), "cpu")
    got = run_executable(narrow, [x.astype("bfloat16")])[0].astype("float32")
    np.testing.assert_array_equal(got, wide.astype("bfloat16").astype("float32"))  # a maximum of rounded values
