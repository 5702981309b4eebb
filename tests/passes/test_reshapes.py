"""SinkReshapes: elementwise ops of reshaped tensors move before the reshape; numerics unchanged."""

import numpy as np
import pytest
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.passes.reshapes import SinkReshapes

from builders import segformer_through_onnx
from pass_checks import assert_transforms, prepared_function_names

WEIGHT = np.random.default_rng(0).standard_normal((3, 3, 1, 8)).astype("float32")


@I.ir_module
class MixFfn:  # a depthwise conv of tokens made an image, its result made tokens for the exporter's GELU
    @R.function
    def main(tokens: R.Tensor((1, 16, 8), "float32")) -> R.Tensor((1, 16, 8), "float32"):
        with R.dataflow():
            image = R.reshape(tokens, R.shape([1, 4, 4, 8]))
            conv = R.nn.conv2d(image, R.const(WEIGHT), padding=[1, 1, 1, 1], groups=8, data_layout="NHWC",
                               kernel_layout="HWIO")
            x = R.reshape(conv, R.shape([1, 16, 8]))
            erf = R.erf(R.divide(x, R.const(1.4142135, "float32")))
            gv = R.multiply(R.multiply(x, R.add(erf, R.const(1.0, "float32"))), R.const(0.5, "float32"))
            R.output(gv)
        return gv


def test_the_gelu_moves_before_the_reshape_of_the_conv():
    """Also reachable as relay_amp.transform.SinkReshapes."""
    @I.ir_module
    class Expected:
        @R.function
        def main(tokens: R.Tensor((1, 16, 8), "float32")) -> R.Tensor((1, 16, 8), "float32"):
            with R.dataflow():
                image = R.reshape(tokens, R.shape([1, 4, 4, 8]))
                conv = R.nn.conv2d(image, R.const(WEIGHT), padding=[1, 1, 1, 1], groups=8, data_layout="NHWC",
                                   kernel_layout="HWIO")
                erf = R.erf(R.divide(conv, R.const(1.4142135, "float32")))
                gelu = R.multiply(R.multiply(conv, R.add(erf, R.const(1.0, "float32"))), R.const(0.5, "float32"))
                gv = R.reshape(gelu, R.shape([1, 16, 8]))
                R.output(gv)
            return gv

    assert_transforms(SinkReshapes(), MixFfn, Expected)
    assert_transforms(relay_amp.transform.SinkReshapes(), MixFfn, Expected)


def test_the_values_do_not_change():
    x = np.random.default_rng(1).standard_normal((1, 16, 8)).astype("float32")
    np.testing.assert_array_equal(relay_amp.run(SinkReshapes()(MixFfn), [x])[0], relay_amp.run(MixFfn, [x])[0])


def test_the_built_conv_computes_the_gelu():
    names = prepared_function_names(MixFfn)
    assert [name for name in names if "conv2d" in name and "erf" in name], names


@pytest.mark.parametrize("reason,op", [
    ("an operand reshaped from another shape", lambda x, y: R.add(x, R.reshape(y, R.shape([1, 16, 8])))),
    ("an operand that is no reshape", lambda x, y: R.add(x, R.const(np.ones((1, 16, 8), "float32")))),
    ("a broadcast operand", lambda x, y: R.add(x, R.const(np.ones((8,), "float32")))),
    ("a reduction", lambda x, y: R.sum(x, axis=[2])),
    ("a widening cast an op that stays reads (a kernel's epilogue widens its operand as it loads)",
     lambda x, y: R.add(R.astype(x, "float64"), R.const(np.ones((1, 16, 8)), "float64"))),
])
def test_ops_that_cannot_move_stay(reason, op):
    @I.ir_module
    class Before:
        @R.function
        def main(image: R.Tensor((1, 4, 4, 8), "float32"), other: R.Tensor((2, 8, 8), "float32")):
            with R.dataflow():
                x = R.reshape(image, R.shape([1, 16, 8]))
                gv = op(x, other)
                R.output(gv)
            return gv

    assert_transforms(SinkReshapes(), Before, Before)


def test_segformer_computes_its_gelus_in_its_convs(tmp_path):
    """transformers' SegFormer (a model this was not written on): its Mix-FFN's GELU, exported as erf arithmetic
    after the depthwise conv's result is made tokens again, runs in the conv's function, and the build matches
    PyTorch."""
    pytest.importorskip("transformers")
    imported, pixels, expected = segformer_through_onnx(tmp_path)
    names = prepared_function_names(imported)
    assert len([name for name in names if "conv2d" in name and "erf" in name]) == 2, names
    assert not [name for name in names if "erf" in name and "conv2d" not in name], names
    got = relay_amp.runtime.run_executable(relay_amp.build(imported, relay_amp.targets.host_preset()), [pixels])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_a_function_the_module_lacks_is_a_module_error():
    with pytest.raises(relay_amp.ModuleError, match="forward"):
        SinkReshapes(func="forward")(MixFfn)
