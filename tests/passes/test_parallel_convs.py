"""MergeParallelConvs: parallel convs of one tensor, summed (RepVGG, MobileOne, FastViT branches), as one conv."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp.transform import MergeParallelConvs

from builders import relu_module, timm_through_onnx
from pass_checks import assert_transforms

RNG = np.random.default_rng(0)
C = 4
W3 = RNG.standard_normal((C, C, 3, 3)).astype("float32")
W1 = RNG.standard_normal((C, C, 1, 1)).astype("float32")
B3, B1 = (RNG.standard_normal((1, C, 1, 1)).astype("float32") for _ in range(2))
GAMMA, BETA, MEAN = (RNG.standard_normal(C).astype("float32") for _ in range(3))
VAR = RNG.uniform(0.5, 1.5, C).astype("float32")
EPSILON = 1e-5


def _module(body, channels: int = C, size: int = 6) -> tvm.IRModule:
    """main(x [1, channels, size, size]) = relu(body(bb, x))."""
    return relu_module(body, (1, channels, size, size))


def _conv(bb, x, weight, bias=None, padding=0, strides=1, groups=1, dilation=1):
    """A conv of `x` by a constant weight, then its bias add when given (ONNX's Conv as TVM imports it)."""
    conv = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), strides=strides, padding=padding, groups=groups,
                                      dilation=dilation))
    return conv if bias is None else bb.emit(relax.op.add(conv, relax.const(bias)))


def _batch_norm(bb, x):
    """An inference batch norm of `x` (the identity branch), its normalized output."""
    norm = bb.emit(relax.op.nn.batch_norm(x, *(relax.const(v) for v in (GAMMA, BETA, MEAN, VAR)), axis=1,
                                          epsilon=EPSILON, training=False))
    return bb.emit(relax.TupleGetItem(norm, 0))


def _repvgg(bb, x):
    """RepVGG's block before its ReLU: conv3x3 + conv1x1 + batch norm of x."""
    branches = bb.emit(relax.op.add(_conv(bb, x, W3, B3, padding=1), _conv(bb, x, W1, B1)))
    return bb.emit(relax.op.add(branches, _batch_norm(bb, x)))


def test_a_repvgg_block_becomes_one_3x3_conv_whose_kernel_adds_the_branches_at_its_centre():
    scale = GAMMA.astype("float64") / np.sqrt(VAR.astype("float64") + EPSILON)
    kernel = W3.astype("float64")
    kernel[:, :, 1, 1] += W1[:, :, 0, 0]
    kernel[np.arange(C), np.arange(C), 1, 1] += scale
    bias = (B3.reshape(C).astype("float64") + B1.reshape(C)) + (BETA - MEAN * scale)

    def merged(bb, x):
        conv = bb.emit(relax.op.nn.conv2d(x, relax.const(kernel.astype("float32")), padding=[1, 1, 1, 1]))
        return bb.emit(relax.op.add(conv, relax.const(bias.reshape(1, C, 1, 1).astype("float32"))))

    after = assert_transforms(MergeParallelConvs(), _module(_repvgg), _module(merged))
    assert after["main"].body.blocks[0].bindings[0].value.op.name == "relax.nn.conv2d"


def _run_both(before: tvm.IRModule, channels: int = C, size: int = 6) -> tuple:
    """The outputs of `before` and of its merged module on one random input, and the merged module."""
    after = MergeParallelConvs()(before)
    relax.analysis.well_formed(after)
    data = RNG.standard_normal((1, channels, size, size)).astype("float32")
    return relay_amp.run(before, [data])[0], relay_amp.run(after, [data])[0], after


def _conv_count(mod: tvm.IRModule) -> int:
    return [b.value.op.name for b in mod["main"].body.blocks[0].bindings
            if isinstance(b.value, relax.Call)].count("relax.nn.conv2d")


def test_a_fastvit_repmixer_of_depthwise_branches_scaled_and_subtracted_becomes_one_conv():
    """FastViT's RepMixer: x + layer_scale * (mixer(x) - norm(x)), mixer a depthwise 3x3 + depthwise 1x1 + batch
    norm, norm a depthwise 1x1: five terms, one of them x itself, scaled per channel and subtracted."""
    depthwise3, depthwise1, other1 = (RNG.standard_normal((C, 1, k, k)).astype("float32") for k in (3, 1, 1))
    layer_scale = RNG.standard_normal((C, 1, 1)).astype("float32")

    def repmixer(bb, x):
        mixer = bb.emit(relax.op.add(_conv(bb, x, depthwise1, B1, groups=C), _batch_norm(bb, x)))
        mixer = bb.emit(relax.op.add(mixer, _conv(bb, x, depthwise3, B3, padding=1, groups=C)))
        difference = bb.emit(relax.op.subtract(mixer, _conv(bb, x, other1, B3, groups=C)))
        return bb.emit(relax.op.add(x, bb.emit(relax.op.multiply(difference, relax.const(layer_scale)))))

    before, after, merged = _run_both(_module(repmixer))
    assert _conv_count(merged) == 1
    # fp32 sums in another order: a few ulps of values around 10
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def test_a_batch_norm_read_by_two_sums_is_merged_into_each():
    """torch.export's RepMixer: one batch norm of x read by the mixer's sum and, plus 0.0, by the norm branch."""
    depthwise3 = RNG.standard_normal((C, 1, 3, 3)).astype("float32")

    def shared_norm(bb, x):
        norm = _batch_norm(bb, x)
        mixer = bb.emit(relax.op.add(_conv(bb, x, depthwise3, B3, padding=1, groups=C), norm))
        difference = bb.emit(relax.op.subtract(mixer, bb.emit(relax.op.add(norm, relax.const(0.0, "float32")))))
        return bb.emit(relax.op.add(x, bb.emit(relax.op.multiply(difference, relax.const(0.5, "float32")))))

    before, after, merged = _run_both(_module(shared_norm))
    assert _conv_count(merged) == 1 and "batch_norm" not in merged.script()
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def test_branches_of_a_tensor_that_is_a_scale_of_another_merge_as_branches_of_it():
    """A GELU's output is x * 0.5 (a scale of its product): the branches read it, not the product."""
    def scaled_source(bb, x):
        source = bb.emit(relax.op.multiply(bb.emit(relax.op.nn.relu(x)), relax.const(0.5, "float32")))
        return bb.emit(relax.op.add(_conv(bb, source, W3, B3, padding=1), _batch_norm(bb, source)))

    before, after, merged = _run_both(_module(scaled_source))
    assert _conv_count(merged) == 1 and "batch_norm" not in merged.script()
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def test_kernels_of_different_sizes_strided_and_grouped_merge_into_the_largest():
    """FastViT's patch embedding: a strided 7x7 and 3x3 of 2 channels per group, two outputs per group."""
    large, small = (RNG.standard_normal((2 * C, 2, k, k)).astype("float32") for k in (7, 3))

    def embed(bb, x):
        return bb.emit(relax.op.add(_conv(bb, x, large, padding=3, strides=2, groups=C // 2),
                                    _conv(bb, x, small, padding=1, strides=2, groups=C // 2)))

    before, after, merged = _run_both(_module(embed, size=9), size=9)
    assert _conv_count(merged) == 1
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def _unmerged(body):
    before = _module(body)
    tvm.ir.assert_structural_equal(MergeParallelConvs()(before), before)


def test_convs_of_different_strides_groups_or_dilations_are_left_apart():
    _unmerged(lambda bb, x: bb.emit(relax.op.add(_conv(bb, x, W3, padding=1), _conv(bb, x, W3[:, :1], padding=1,
                                                                                      groups=C))))
    _unmerged(lambda bb, x: bb.emit(relax.op.add(_conv(bb, x, W3, padding=2, dilation=2), _conv(bb, x, W1))))
    _unmerged(lambda bb, x: bb.emit(relax.op.add(_conv(bb, x, W3), _conv(bb, x, W1, padding=[0, 0, 1, 1],
                                                                          strides=2))))


def test_convs_of_different_tensors_and_a_conv_read_elsewhere_are_left_apart():
    def two_sources(bb, x):
        y = bb.emit(relax.op.nn.relu(x))
        return bb.emit(relax.op.add(_conv(bb, x, W3, padding=1), _conv(bb, y, W1)))

    def shared_branch(bb, x):
        branch = _conv(bb, x, W1)
        return bb.emit(relax.op.multiply(bb.emit(relax.op.add(_conv(bb, x, W3, padding=1), branch)), branch))

    _unmerged(two_sources)
    _unmerged(shared_branch)


@pytest.mark.parametrize("model", ["repvit_m0_9", "repghostnet_050"])
def test_an_exported_reparameterizable_model_imports_with_the_convs_of_timms_reparameterized_one(model, tmp_path):
    """timm's reparameterize_model is the reference (these models were not the ones the merge was written on):
    the training-form export imports with as many convs as the reparameterized model has, and computes what torch
    does (RepGhost's fusion batch norms read a conv output that its depthwise conv reads too)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("timm")
    from timm.utils.model import reparameterize_model

    module, imported, x, expected = timm_through_onnx(model, tmp_path)
    reparameterized = reparameterize_model(module)
    assert _conv_count(imported) == sum(isinstance(m, torch.nn.Conv2d) for m in reparameterized.modules())
    np.testing.assert_allclose(relay_amp.run(imported, [x])[0], expected, rtol=1e-4, atol=1e-4)
