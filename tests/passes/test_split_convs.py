"""GroupSplitConvs: the convs of a split's parts, concatenated in order (timm's MixedConv2d), as one grouped conv."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp.transform import GroupSplitConvs

from builders import relu_module, timm_through_onnx
from pass_checks import assert_transforms

RNG = np.random.default_rng(0)
C, OUT = 8, 6  # the split's input channels; each part's output channels


def _weights(parts: int, kernel: int = 1, depth: int = C // 2, out: int = OUT) -> list[np.ndarray]:
    return [RNG.standard_normal((out, depth, kernel, kernel)).astype("float32") for _ in range(parts)]


def _bias(out: int = OUT) -> np.ndarray:
    return RNG.standard_normal((1, out, 1, 1)).astype("float32")


def _mixed(weights, biases, groups=1, order=None, split_axis=1):
    """A split of x into len(weights) parts, each convolved by its weight (same-size output) and its bias added
    where given, concatenated in `order` (the parts' own by default)."""
    def body(bb, x):
        parts = bb.emit(relax.op.split(x, len(weights), axis=split_axis))
        outs = []
        for index, (weight, bias) in enumerate(zip(weights, biases)):
            part = bb.emit(relax.TupleGetItem(parts, index))
            conv = bb.emit(relax.op.nn.conv2d(part, relax.const(weight), padding=weight.shape[-1] // 2, groups=groups))
            outs.append(conv if bias is None else bb.emit(relax.op.add(conv, relax.const(bias))))
        return bb.emit(relax.op.concat([outs[i] for i in (order or range(len(outs)))], axis=1))
    return body


def _module(body, channels: int = C, size: int = 6) -> tvm.IRModule:
    return relu_module(body, (1, channels, size, size))


def test_a_split_convolved_part_by_part_and_concatenated_becomes_one_grouped_conv():
    weights, biases = _weights(2), [_bias(), None]

    def grouped(bb, x):
        conv = bb.emit(relax.op.nn.conv2d(x, relax.const(np.concatenate(weights)), groups=2))
        bias = np.concatenate([biases[0].reshape(-1), np.zeros(OUT, "float32")]).reshape(1, -1, 1, 1)
        return bb.emit(relax.op.add(conv, relax.const(bias)))

    assert_transforms(GroupSplitConvs(), _module(_mixed(weights, biases)), _module(grouped))


def _run_both(before: tvm.IRModule, shape: tuple) -> tuple:
    """The outputs of `before` and of its grouped module on one random input, and the grouped module."""
    after = GroupSplitConvs()(before)
    relax.analysis.well_formed(after)
    data = RNG.standard_normal(shape).astype("float32")
    return relay_amp.run(before, [data])[0], relay_amp.run(after, [data])[0], after


def _ops(mod: tvm.IRModule) -> list[str]:
    return [b.value.op.name for b in mod["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]


@pytest.mark.parametrize("parts, kernel, groups, depth", [(3, 3, 1, 4), (2, 5, 4, 1)],
                         ids=["three-3x3-parts", "depthwise-5x5-parts"])
def test_grouped_parts_compute_what_the_split_did(parts, kernel, groups, depth):
    """Three 3x3 parts, the middle one without bias; two depthwise parts of one kernel size (a depthwise conv)."""
    channels = 4 * parts
    out = OUT if groups == 1 else 4
    body = _mixed(_weights(parts, kernel, depth, out), [_bias(out), None, _bias(out)][:parts], groups=groups)
    before, after, mod = _run_both(_module(body, channels), (1, channels, 6, 6))
    assert _ops(mod) == ["relax.nn.conv2d", "relax.add", "relax.nn.relu"]
    assert int(mod["main"].body.blocks[0].bindings[0].value.attrs.groups) == parts * groups
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def test_nhwc_parts_group_along_the_channels_last_axis():
    weights = _weights(2)

    def body(bb, x):
        parts = bb.emit(relax.op.split(x, 2, axis=3))
        outs = [bb.emit(relax.op.nn.conv2d(bb.emit(relax.TupleGetItem(parts, i)),
                                           relax.const(w.transpose(0, 2, 3, 1)), data_layout="NHWC",
                                           kernel_layout="OHWI")) for i, w in enumerate(weights)]
        return bb.emit(relax.op.concat(outs, axis=3))

    before, after, mod = _run_both(relu_module(body, (1, 6, 6, C)), (1, 6, 6, C))
    assert _ops(mod) == ["relax.nn.conv2d", "relax.nn.relu"]
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def _untouched(before: tvm.IRModule) -> None:
    tvm.ir.assert_structural_equal(GroupSplitConvs()(before), before)


def test_parts_of_different_kernels_order_or_axis_are_left_apart():
    """MixNet's depthwise parts (3x3 and 5x5), parts concatenated out of order, a split of the rows."""
    three, five = _weights(1, 3)[0], _weights(1, 5)[0]
    _untouched(_module(_mixed([three, five], [None, None])))
    _untouched(_module(_mixed(_weights(2), [None, None], order=[1, 0])))
    _untouched(_module(_mixed(_weights(2, depth=C), [None, None], split_axis=2), size=8))


def test_parts_read_elsewhere_and_biases_off_the_channels_are_left_apart():
    weights = _weights(2)

    def part_read_twice(bb, x):
        parts = bb.emit(relax.op.split(x, 2, axis=1))
        first, second = (bb.emit(relax.TupleGetItem(parts, i)) for i in range(2))
        convs = [bb.emit(relax.op.nn.conv2d(p, relax.const(w))) for p, w in zip((first, second), weights)]
        joined = bb.emit(relax.op.concat(convs, axis=1))
        return bb.emit(relax.op.add(joined, bb.emit(relax.op.mean(first, keepdims=True))))

    def conv_read_twice(bb, x):
        parts = bb.emit(relax.op.split(x, 2, axis=1))
        convs = [bb.emit(relax.op.nn.conv2d(bb.emit(relax.TupleGetItem(parts, i)), relax.const(w)))
                 for i, w in enumerate(weights)]
        joined = bb.emit(relax.op.concat(convs, axis=1))
        return bb.emit(relax.op.add(joined, bb.emit(relax.op.concat([convs[0], convs[0]], axis=1))))

    row_bias = RNG.standard_normal((1, 1, 6, 1)).astype("float32")
    _untouched(_module(part_read_twice))
    _untouched(_module(conv_read_twice))
    _untouched(_module(_mixed(weights, [row_bias, None])))


def _expected_convs(module) -> int:
    """The convs of a timm model once each MixedConv2d whose parts are alike (one kernel, equal widths) is one."""
    torch = pytest.importorskip("torch")
    from timm.layers import MixedConv2d

    count = 0
    for layer in module.modules():
        if isinstance(layer, MixedConv2d):
            shapes = {conv.weight.shape for conv in layer.values()}
            count += 1 if len(shapes) == 1 else len(layer)
        elif isinstance(layer, torch.nn.Conv2d) and not any(layer is part for mixed in module.modules()
                                                             if isinstance(mixed, MixedConv2d)
                                                             for part in mixed.values()):
            count += 1
    return count


@pytest.mark.parametrize("model", ["mixnet_m", "tf_mixnet_s"])
def test_an_exported_mixnet_imports_with_one_conv_for_each_mixed_conv_of_alike_parts(model, tmp_path):
    """Models the grouping was not written on (MixNet-M's 3- and 4-part layers, TF-padded MixNet-S): as many convs
    as the model has once each MixedConv2d of alike parts is one, computing what torch does."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("timm")
    module, imported, x, expected = timm_through_onnx(model, tmp_path)
    convs = [op for op in _ops(imported) if op == "relax.nn.conv2d"]
    assert len(convs) == _expected_convs(module) < sum(isinstance(m, torch.nn.Conv2d) for m in module.modules())
    np.testing.assert_allclose(relay_amp.run(imported, [x])[0], expected, rtol=1e-4, atol=1e-4)
