"""GroupNormsAsOps: the ONNX exporters' group norm spelling becomes one relax.nn.group_norm."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp.transform import GroupNormsAsOps

from builders import relu_module
from pass_checks import assert_transforms

SCALE = np.array([[1.5], [0.5]], dtype="float32")  # per group, as the exporter's InstanceNormalization scale
SHIFT = np.array([[0.25], [-1.0]], dtype="float32")


def _module(build_norm) -> tvm.IRModule:
    """main(x [1, 8, 2, 2]) = relu(build_norm(bb, x))."""
    return relu_module(build_norm, (1, 8, 2, 2))


def _exported(bb: relax.BlockBuilder, x: relax.Expr, grouped_shape=(1, 2, 16), affine: bool = True) -> relax.Expr:
    """GroupNorm(2, 8) as TVM's ONNX importer writes the exporters' Reshape, InstanceNormalization, Reshape."""
    grouped = bb.emit(relax.op.reshape(x, grouped_shape))
    mean = bb.emit(relax.op.mean(grouped, axis=[2], keepdims=True))
    centered = bb.emit(relax.op.subtract(grouped, mean))
    variance = bb.emit(relax.op.variance(grouped, axis=[2], keepdims=True))
    deviation = bb.emit(relax.op.sqrt(bb.emit(relax.op.add(variance, relax.const(1e-5, "float32")))))
    normalized = bb.emit(relax.op.divide(centered, deviation))
    if affine:
        scaled = bb.emit(relax.op.multiply(normalized, relax.const(SCALE)))
        normalized = bb.emit(relax.op.add(scaled, relax.const(SHIFT)))
    return bb.emit(relax.op.reshape(normalized, (1, 8, 2, 2)))


def _group_norm(gamma: np.ndarray, beta: np.ndarray):
    def build(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Expr:
        norm = relax.op.nn.group_norm(x, relax.const(gamma), relax.const(beta), 2, channel_axis=1, axes=[2, 3],
                                      epsilon=float(np.float32(1e-5)))
        return bb.emit(norm)
    return build


def test_the_exporters_spelling_becomes_one_group_norm_with_per_channel_scale_and_shift():
    expected = _module(_group_norm(np.repeat(SCALE, 4), np.repeat(SHIFT, 4)))
    assert_transforms(GroupNormsAsOps(), _module(_exported), expected)


def test_without_its_affine_step_the_scale_is_one_and_the_shift_zero():
    expected = _module(_group_norm(np.ones(8, "float32"), np.zeros(8, "float32")))
    assert_transforms(GroupNormsAsOps(), _module(lambda bb, x: _exported(bb, x, affine=False)), expected)


def test_a_reshape_that_does_not_group_channels_is_left_alone():
    """[1, 16, 2] splits each channel's pixels over two rows: a norm over it is no group norm."""
    mod = _module(lambda bb, x: _exported(bb, x, grouped_shape=(1, 16, 2), affine=False))
    tvm.ir.assert_structural_equal(GroupNormsAsOps()(mod), mod)


@pytest.mark.parametrize("affine", [True, False])
def test_the_group_norm_computes_what_the_exporters_spelling_did(affine):
    before = _module(lambda bb, x: _exported(bb, x, affine=affine))
    data = np.random.default_rng(0).standard_normal((1, 8, 2, 2)).astype("float32") * 3 + 1
    np.testing.assert_allclose(relay_amp.run(GroupNormsAsOps()(before), [data])[0], relay_amp.run(before, [data])[0],
                               rtol=1e-5, atol=1e-5)


def test_a_group_per_channel_of_a_sequence_needs_no_reshape_back():
    """GroupNorm(C, C) of [N, C, W] (wav2vec2's first conv): the grouping keeps the shape, and the exporter's
    simplified graph has no reshape back."""
    x = relax.Var("x", relax.TensorType((1, 4, 6), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            grouped = bb.emit(relax.op.reshape(x, (1, 4, 6)))
            mean = bb.emit(relax.op.mean(grouped, axis=[2], keepdims=True))
            variance = bb.emit(relax.op.variance(grouped, axis=[2], keepdims=True))
            deviation = bb.emit(relax.op.sqrt(bb.emit(relax.op.add(variance, relax.const(1e-5, "float32")))))
            out = bb.emit_output(relax.op.divide(bb.emit(relax.op.subtract(grouped, mean)), deviation))
        bb.emit_func_output(out)
    after = GroupNormsAsOps()(bb.get())
    assert [b.value.op.name for b in after["main"].body.blocks[0].bindings] == ["relax.nn.group_norm"]
    data = np.random.default_rng(0).standard_normal((1, 4, 6)).astype("float32")
    np.testing.assert_allclose(relay_amp.run(after, [data])[0], relay_amp.run(bb.get(), [data])[0], rtol=1e-5, atol=1e-5)
