"""onnx_col2im: ONNX Col2Im nodes imported as moves (tiling blocks) or a grouped ConvTranspose (overlapping or
dilated blocks), computing what ONNX defines."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.onnx_col2im import col2ims_as_onnx

RNG = np.random.default_rng(0)
BATCH = 2


def _blocks(size: int, block: int, stride: int, dilation: int, begin: int, end: int) -> int:
    return (size + begin + end - dilation * (block - 1) - 1) // stride + 1


def _col2im_model(channels: int, image: list, block: list, constant_image: bool = True, **attributes):
    """One Col2Im node folding [BATCH, channels x prod(block), L] blocks into [BATCH, channels, *image]."""
    spatial = len(image)
    pads = attributes.get("pads", [0] * 2 * spatial)
    counts = [_blocks(size, kernel, stride, dilation, begin, end) for size, kernel, stride, dilation, begin, end in
              zip(image, block, attributes.get("strides", [1] * spatial), attributes.get("dilations", [1] * spatial),
                  pads, pads[spatial:])]
    shape = [BATCH, channels * int(np.prod(block)), int(np.prod(counts))]
    initializers = [numpy_helper.from_array(np.array(block, "int64"), "block_shape")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)]
    if constant_image:
        initializers.append(numpy_helper.from_array(np.array(image, "int64"), "image_shape"))
    else:
        inputs.append(helper.make_tensor_value_info("image_shape", TensorProto.INT64, [spatial]))
    node = helper.make_node("Col2Im", ["x", "image_shape", "block_shape"], ["y"], "fold", **attributes)
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, channels, *image])
    graph = helper.make_graph([node], "col2im", inputs, [output], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), shape


@pytest.mark.parametrize("image, block, attributes, rewritten_as", [
    ([8, 8], [2, 2], dict(strides=[2, 2]), "Transpose"),  # MobileViT's patches
    ([9, 7], [2, 2], dict(strides=[2, 2]), "Transpose"),  # a last row and column no block reaches
    ([8, 8], [2, 2], dict(strides=[2, 2], pads=[1, 0, 1, 0]), "Transpose"),
    ([12], [4], dict(strides=[4]), "Transpose"),
    ([7, 9], [3, 3], dict(strides=[1, 2]), "ConvTranspose"),  # overlapping blocks are added
    ([7, 9], [3, 2], dict(strides=[2, 2], dilations=[2, 1], pads=[1, 1, 0, 2]), "ConvTranspose"),
    ([10], [3], dict(strides=[2], pads=[1, 0]), "ConvTranspose"),
])
def test_col2im_imports_as_moves_or_a_conv_transpose_computing_what_onnx_defines(image, block, attributes,
                                                                                   rewritten_as):
    model, shape = _col2im_model(3, image, block, **attributes)
    blocks = RNG.standard_normal(shape).astype("float32")
    expected = ReferenceEvaluator(model).run(None, {"x": blocks})[0]
    assert rewritten_as in [node.op_type for node in col2ims_as_onnx(model).graph.node]
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), [blocks])[0]
    assert got.shape == expected.shape == (BATCH, 3, *image)
    assert np.abs(got - expected).max() <= 1e-6 * np.abs(expected).max()


def test_a_model_without_col2im_comes_back_as_it_was():
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]))
    assert col2ims_as_onnx(model) is model


@pytest.mark.parametrize("build, message", [
    (lambda: _col2im_model(2, [8, 8], [2, 2], constant_image=False, strides=[2, 2]),
     r"Col2Im node 'fold': its image_shape must be a constant"),
    (lambda: _col2im_model(2, [2, 8], [3, 2], strides=[1, 2]),
     r"Col2Im node 'fold': a block spanning 3 does not fit in an image axis of 2"),
])
def test_col2ims_it_cannot_write_are_refused_naming_the_node(build, message):
    model, _ = build()
    with pytest.raises(ModelLoadError, match=message):
        col2ims_as_onnx(model)


def test_a_fold_exported_by_the_dynamo_exporter_matches_pytorch(tmp_path):
    """torch's unfold and fold around a per-patch layer (MobileViT's patches), and an overlapping fold; the
    TorchScript exporter fails on fold, the dynamo one writes Col2Im."""
    torch = pytest.importorskip("torch")

    class Patches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = torch.nn.Linear(16, 16)

        def forward(self, x):
            patches = torch.nn.functional.unfold(x, kernel_size=2, stride=2)  # [1, 4 x 4, 36]
            tiled = torch.nn.functional.fold(self.mix(patches.transpose(1, 2)).transpose(1, 2), (12, 12), 2, stride=2)
            windows = torch.nn.functional.unfold(x, kernel_size=3, padding=1)  # [1, 4 x 9, 144]
            return tiled + torch.nn.functional.fold(windows, (12, 12), 3, padding=1)

    torch.manual_seed(0)
    module, x = Patches().eval(), torch.randn(1, 4, 12, 12)
    with torch.no_grad():
        expected = module(x).numpy()
    path = tmp_path / "patches.onnx"
    torch.onnx.export(module, (x,), str(path), dynamo=True)
    assert [node.op_type for node in onnx.load(str(path)).graph.node].count("Col2Im") == 2
    got = relay_amp.run(relay_amp.frontend.from_onnx(str(path)), [x.numpy()])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
