"""FoldBatchNorm: conv2d -> batch_norm becomes one conv2d on scaled weights plus a bias add."""

import numpy as np
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import models

from pass_checks import assert_transforms

W = np.arange(8, dtype="float32").reshape(2, 1, 2, 2) / 8  # 2 output channels, 1 input channel, 2x2
GAMMA, BETA = np.array([2.0, 0.5], "float32"), np.array([1.0, -1.0], "float32")
MEAN, VAR = np.array([0.25, -0.5], "float32"), np.array([3.0, 0.0], "float32")
EPS = 1e-5
SCALE = GAMMA / np.sqrt(VAR + EPS)


@I.ir_module
class ConvBatchNorm:
    @R.function
    def main(x: R.Tensor((1, 1, 3, 3), "float32")) -> R.Tensor((1, 2, 2, 2), "float32"):
        with R.dataflow():
            c = R.nn.conv2d(x, R.const(W))
            bn = R.nn.batch_norm(c, R.const(GAMMA), R.const(BETA), R.const(MEAN), R.const(VAR), axis=1,
                                 epsilon=EPS)
            gv = bn[0]
            R.output(gv)
        return gv


@I.ir_module
class Folded:
    @R.function
    def main(x: R.Tensor((1, 1, 3, 3), "float32")) -> R.Tensor((1, 2, 2, 2), "float32"):
        with R.dataflow():
            c = R.nn.conv2d(x, R.const(W * SCALE.reshape(2, 1, 1, 1)))
            gv = R.add(c, R.const((BETA - MEAN * SCALE).reshape(1, 2, 1, 1)))
            R.output(gv)
        return gv


def test_conv_batch_norm_folds_into_scaled_weights_and_a_bias():
    assert_transforms(relay_amp.transform.FoldBatchNorm(), ConvBatchNorm, Folded)


def test_folded_model_computes_the_same():
    mod = models.small_cnn()  # conv -> batch_norm -> relu
    inputs = models.example_inputs(mod)
    folded = relay_amp.transform.FoldBatchNorm()(mod)
    assert "R.nn.batch_norm" in mod.script() and "R.nn.batch_norm" not in folded.script()
    expected = relay_amp.run(mod, inputs)[0]
    np.testing.assert_allclose(relay_amp.run(folded, inputs)[0], expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())  # the scale applied before the sum


B = np.array([0.75, -0.25], "float32").reshape(1, 2, 1, 1)  # the conv's own bias


@I.ir_module
class ConvBiasBatchNorm:
    @R.function
    def main(x: R.Tensor((1, 1, 3, 3), "float32")) -> R.Tensor((1, 2, 2, 2), "float32"):
        with R.dataflow():
            c = R.nn.conv2d(x, R.const(W))
            biased = R.add(c, R.const(B))
            bn = R.nn.batch_norm(biased, R.const(GAMMA), R.const(BETA), R.const(MEAN), R.const(VAR), axis=1,
                                 epsilon=EPS)
            gv = bn[0]
            R.output(gv)
        return gv


@I.ir_module
class FoldedWithBias:
    @R.function
    def main(x: R.Tensor((1, 1, 3, 3), "float32")) -> R.Tensor((1, 2, 2, 2), "float32"):
        with R.dataflow():
            c = R.nn.conv2d(x, R.const(W * SCALE.reshape(2, 1, 1, 1)))
            gv = R.add(c, R.const((BETA - (MEAN - B.reshape(2)) * SCALE).reshape(1, 2, 1, 1)))
            R.output(gv)
        return gv


def test_a_conv_bias_before_the_batch_norm_moves_into_its_statistics():
    assert_transforms(relay_amp.transform.FoldBatchNorm(), ConvBiasBatchNorm, FoldedWithBias)


M = np.arange(6, dtype="float32").reshape(3, 2) / 4  # a linear layer's [in, out] weight: 2 columns
SCALE64 = GAMMA.astype("float64") / np.sqrt(VAR.astype("float64") + EPS)  # the fold computes in float64


@I.ir_module
class MatmulBatchNorm:
    @R.function
    def main(x: R.Tensor((1, 4, 3), "float32")) -> R.Tensor((4, 2), "float32"):
        with R.dataflow():
            m = R.matmul(x, R.const(M))
            flat = R.reshape(m, (4, 2))
            bn = R.nn.batch_norm(flat, R.const(GAMMA), R.const(BETA), R.const(MEAN), R.const(VAR), axis=1,
                                 epsilon=EPS, training=False)
            gv = bn[0]
            R.output(gv)
        return gv


@I.ir_module
class MatmulFolded:
    @R.function
    def main(x: R.Tensor((1, 4, 3), "float32")) -> R.Tensor((4, 2), "float32"):
        with R.dataflow():
            m = R.matmul(x, R.const((M * SCALE64).astype("float32")))
            biased = R.add(m, R.const((BETA - MEAN * SCALE64).astype("float32")))
            gv = R.reshape(biased, (4, 2))
            R.output(gv)
        return gv


def test_a_batch_norm_after_a_linear_layer_folds_into_its_weight_columns_and_a_bias():
    """BatchNorm1d over a linear layer's outputs (LeViT's; exporters fold only a conv's), through the reshape that
    flattens its tokens."""
    assert_transforms(relay_amp.transform.FoldBatchNorm(), MatmulBatchNorm, MatmulFolded)
    x = np.random.default_rng(8).standard_normal((1, 4, 3)).astype("float32")
    expected = relay_amp.run(MatmulBatchNorm, [x])[0]
    np.testing.assert_allclose(relay_amp.run(MatmulFolded, [x])[0], expected, rtol=1e-5, atol=1e-5)


@I.ir_module
class SharedConvBatchNorm:
    @R.function
    def main(x: R.Tensor((1, 1, 3, 3), "float32")) -> R.Tensor((1, 2, 2, 2), "float32"):
        with R.dataflow():
            c = R.nn.conv2d(x, R.const(W))
            bn = R.nn.batch_norm(c, R.const(GAMMA), R.const(BETA), R.const(MEAN), R.const(VAR), axis=1,
                                 epsilon=EPS, training=False)
            gv = R.add(bn[0], R.nn.relu(c))
            R.output(gv)
        return gv


AFFINE_SCALE, AFFINE_SHIFT = SCALE64.astype("float32"), (BETA - MEAN * SCALE64).astype("float32")


@I.ir_module
class SharedConvScaled:
    @R.function
    def main(x: R.Tensor((1, 1, 3, 3), "float32")) -> R.Tensor((1, 2, 2, 2), "float32"):
        with R.dataflow():
            c = R.nn.conv2d(x, R.const(W))
            scaled = R.multiply(c, R.const(AFFINE_SCALE.reshape(1, 2, 1, 1)))
            gv = R.add(R.add(scaled, R.const(AFFINE_SHIFT.reshape(1, 2, 1, 1))), R.nn.relu(c))
            R.output(gv)
        return gv


def test_a_batch_norm_of_a_conv_output_read_elsewhere_becomes_a_scale_and_shift_not_a_second_conv():
    """RepGhost's fusion batch norm reads the conv output its cheap depthwise conv reads: folded, it was a copy
    of the conv with scaled weights."""
    assert_transforms(relay_amp.transform.FoldBatchNorm(), SharedConvBatchNorm, SharedConvScaled)


W2 = np.arange(4, dtype="float32").reshape(1, 1, 2, 2) / 4  # a second group's conv: 1 output channel
STATS = [np.append(v, extra).astype("float32") for v, extra in zip((GAMMA, BETA, MEAN, VAR), (3.0, 0.25, 1.0, 2.0))]


@I.ir_module
class MixedConvBatchNorm:  # MixNet's mixed conv: one conv per group of channels, concatenated, then one batch norm
    @R.function
    def main(x: R.Tensor((1, 1, 3, 3), "float32")) -> R.Tensor((1, 3, 2, 2), "float32"):
        with R.dataflow():
            first = R.nn.conv2d(x, R.const(W))
            second = R.nn.conv2d(x, R.const(W2))
            joined = R.concat((first, second), axis=1)
            bn = R.nn.batch_norm(joined, R.const(STATS[0]), R.const(STATS[1]), R.const(STATS[2]), R.const(STATS[3]),
                                 axis=1, epsilon=EPS, training=False)
            gv = bn[0]
            R.output(gv)
        return gv


def test_a_batch_norm_after_a_concat_of_convs_folds_into_each_conv():
    second_scale = np.float32(3.0) / np.sqrt(np.float32(2.0) + np.float32(EPS))

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 1, 3, 3), "float32")) -> R.Tensor((1, 3, 2, 2), "float32"):
            with R.dataflow():
                first = R.nn.conv2d(x, R.const(W * SCALE.reshape(2, 1, 1, 1)))
                first_shifted = R.add(first, R.const((BETA - MEAN * SCALE).reshape(1, 2, 1, 1)))
                second = R.nn.conv2d(x, R.const(W2 * second_scale))
                second_shifted = R.add(second, R.const(np.float32(0.25 - second_scale).reshape(1, 1, 1, 1)))
                gv = R.concat((first_shifted, second_shifted), axis=1)
                R.output(gv)
            return gv

    folded = relay_amp.transform.FoldBatchNorm()(MixedConvBatchNorm)
    assert_transforms(lambda mod: folded, MixedConvBatchNorm, Expected)
    x = np.random.default_rng(4).standard_normal((1, 1, 3, 3)).astype("float32")
    np.testing.assert_allclose(relay_amp.run(folded, [x])[0], relay_amp.run(MixedConvBatchNorm, [x])[0], rtol=1e-5,
                               atol=1e-5)
