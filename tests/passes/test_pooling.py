"""GlobalPoolWindows: a pool whose window covers the whole input is a spatial mean or max."""

import numpy as np
import pytest
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
