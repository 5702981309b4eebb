"""onnx_legacy: ONNX Upsample (opsets 7 and 9) imported as ONNX computes it; TopK of sorted=0 imported."""

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm.script import relax as R

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.onnx_legacy import nearest_upsamples_rounded_down
from builders import lraspp_logits
from pass_checks import assert_transforms

RNG = np.random.default_rng(0)
SHAPE = (1, 2, 6, 7)


def _upsample(mode: str, scales: list[float], opset: int = 9, scales_input: str | None = None):
    """One Upsample node over a float input of SHAPE: scales as an initializer (opset 9), a graph input named
    `scales_input`, or an attribute (opset 7)."""
    out = [int(d * s) for d, s in zip(SHAPE, scales)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)]
    if opset < 9:
        node = helper.make_node("Upsample", ["x"], ["y"], "up", mode=mode, scales=[float(s) for s in scales])
        initializers = []
    else:
        name = scales_input or "scales"
        node = helper.make_node("Upsample", ["x", name], ["y"], "up", mode=mode)
        initializers = [] if scales_input else [numpy_helper.from_array(np.array(scales, "float32"), name)]
        inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, [4])] if scales_input else []
    graph = helper.make_graph([node], "upsample", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _source_indices(size: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """ONNX Upsample's source coordinate of each output index (asymmetric: out / scale) as floor and fraction."""
    where = np.arange(int(size * scale)) / scale
    return np.floor(where).astype(int), where - np.floor(where)


def _onnx_upsample(x: np.ndarray, mode: str, scales: list[float]) -> np.ndarray:
    """What ONNX Runtime computes (nearest rounds the source index down; linear interpolates from it)."""
    for axis in (2, 3):
        low, fraction = _source_indices(x.shape[axis], scales[axis])
        if mode == "nearest":
            x = np.take(x, low, axis)
            continue
        high = np.minimum(low + 1, x.shape[axis] - 1)
        weight = fraction.reshape([-1 if a == axis else 1 for a in range(4)])
        x = np.take(x, low, axis) * (1 - weight) + np.take(x, high, axis) * weight
    return x


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 1.5, 3], [1, 1, 3, 1]])
@pytest.mark.parametrize("opset", [7, 9])
def test_upsample_imports_as_onnx_computes_it(mode, scales, opset):
    """Opset 9's scales input did not import at all; nearest rounded its source index to nearest (both opsets)."""
    x = RNG.standard_normal(SHAPE).astype("float32")
    got = relay_amp.run(relay_amp.frontend.from_onnx(_upsample(mode, scales, opset)), [x])[0]
    np.testing.assert_allclose(got, _onnx_upsample(x, mode, scales), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scales, scales_input, message", [
    ([1, 1, 2, 2], "scales", r"its scales \('scales'\) are computed at run time"),
    ([2, 1, 2, 2], None, r"scales \[2.0, 1.0, 2.0, 2.0\]; relay_amp imports upsampling of the last two axes"),
    ([1, 1, 1.5, 2.5], None, r"scales \[1.0, 1.0, 1.5, 2.5\] of a tensor of shape \[1, 2, 6, 7\] give outputs of "
                             "fractional size"),
])
def test_upsamples_the_import_cannot_compute_are_refused_naming_the_node(scales, scales_input, message):
    with pytest.raises(ModelLoadError, match=f"Upsample node 'up': {message}"):
        relay_amp.frontend.from_onnx(_upsample("nearest", scales, scales_input=scales_input))


@tvm.script.ir_module
class NearestRoundingToNearest:
    @R.function
    def main(x: R.Tensor((1, 2, 3, 4), "float32")) -> R.Tensor((1, 2, 6, 8), "float32"):
        with R.dataflow():
            near = R.image.resize2d(x, R.shape([6, 8]), roi=[0.0, 0.0, 0.0, 0.0], method="nearest_neighbor",
                                    coordinate_transformation_mode="asymmetric", rounding_method="round")
            resize = R.image.resize2d(near, R.shape([6, 8]), method="nearest_neighbor",  # an ONNX Resize's: kept
                                      coordinate_transformation_mode="asymmetric", rounding_method="round_prefer_ceil")
            gv = R.image.resize2d(resize, R.shape([6, 8]), method="linear", coordinate_transformation_mode="asymmetric")
            R.output(gv)
        return gv


@tvm.script.ir_module
class NearestRoundingDown:
    @R.function
    def main(x: R.Tensor((1, 2, 3, 4), "float32")) -> R.Tensor((1, 2, 6, 8), "float32"):
        with R.dataflow():
            near = R.image.resize2d(x, R.shape([6, 8]), roi=[0.0, 0.0, 0.0, 0.0], method="nearest_neighbor",
                                    coordinate_transformation_mode="asymmetric", rounding_method="floor")
            resize = R.image.resize2d(near, R.shape([6, 8]), method="nearest_neighbor",
                                      coordinate_transformation_mode="asymmetric", rounding_method="round_prefer_ceil")
            gv = R.image.resize2d(resize, R.shape([6, 8]), method="linear", coordinate_transformation_mode="asymmetric")
            R.output(gv)
        return gv


def test_nearest_upsamples_round_down_and_other_resizes_are_kept():
    after = assert_transforms(nearest_upsamples_rounded_down, NearestRoundingToNearest, NearestRoundingDown)
    x = np.arange(24, dtype="float32").reshape(1, 2, 3, 4)
    rows = [relay_amp.run(mod, [x])[0][0, 0, 0] for mod in (NearestRoundingToNearest, after)]
    np.testing.assert_array_equal(rows[1], [0, 0, 1, 1, 2, 2, 3, 3])  # each source twice, as ONNX's Upsample
    np.testing.assert_array_equal(rows[0], [0, 0, 1, 2, 2, 2, 3, 3])  # 0.5, 1.5, 2.5 rounded half to even


def test_an_opset_9_segmentation_model_with_bilinear_upsampling_matches_onnx_runtime(tmp_path):
    """torchvision's LR-ASPP exported at opset 9: its Upsamples' scales are computed from shapes and folded."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    onnxruntime = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 64)
    path = tmp_path / "lraspp.onnx"
    torch.onnx.export(lraspp_logits(), (x,), str(path), opset_version=9, dynamo=False)  # warns: Upsample is not PyTorch's
    session = onnxruntime.InferenceSession(str(path))
    expected = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    got = relay_amp.run(relay_amp.frontend.from_onnx(path), [x.numpy()])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_an_unsorted_topk_imports_as_a_sorted_one():
    """TVM's importer refused TopK's sorted=0 (Dots1's and GLM-4-MoE's routers, dynamo-exported); ONNX leaves that
    order unspecified, and the import gives the k largest values (and their indices) in descending order."""
    values = [helper.make_tensor_value_info("values", TensorProto.FLOAT, [2, 3]),
              helper.make_tensor_value_info("indices", TensorProto.INT64, [2, 3])]
    node = helper.make_node("TopK", ["x", "k"], ["values", "indices"], "router", axis=-1, sorted=0)
    graph = helper.make_graph([node], "topk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])], values,
                              [numpy_helper.from_array(np.array([3], "int64"), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = RNG.standard_normal((2, 8)).astype("float32")
    got_values, got_indices = relay_amp.run(relay_amp.frontend.from_onnx(model), [x])
    order = np.argsort(-x, axis=-1)[:, :3]
    np.testing.assert_array_equal(got_indices, order)
    np.testing.assert_array_equal(got_values, np.take_along_axis(x, order, axis=-1))


@pytest.mark.parametrize("shape, repeats, broadcast", [([6, 1, 8], [1, 3, 1], True),  # a token per routed expert
                                                       ([6, 2, 8], [1, 3, 1], False),  # whole blocks repeated
                                                       (["tokens", 1, 8], [1, 3, 1], True)],  # sized at import
                         ids=["unit-axis", "axis-of-2", "symbolic-tokens"])
def test_a_tile_of_axes_of_extent_1_imports_as_a_broadcast(shape, repeats, broadcast):
    """TVM imports a Tile as an opaque call of topi's tile; one of a static shape that repeats only axes of extent 1
    is an Expand, imported as broadcast_to (which relay_amp's expert matmuls read through); others stay tiles. Each
    computes what numpy's tile does."""
    output = [None if isinstance(dim, str) else dim * repeat for dim, repeat in zip(shape, repeats)]
    graph = helper.make_graph([helper.make_node("Tile", ["x", "repeats"], ["y"], "repeat")], "tile",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, output)],
                              [numpy_helper.from_array(np.array(repeats, "int64"), "repeats")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    mod = relay_amp.frontend.from_onnx(model, dims={"tokens": 6} if "tokens" in shape else None)
    text = mod.script()
    assert ("broadcast_to" in text and "tile" not in text) if broadcast else "tile" in text
    x = RNG.standard_normal([6 if isinstance(dim, str) else dim for dim in shape]).astype("float32")
    np.testing.assert_array_equal(relay_amp.run(mod, [x])[0], np.tile(x, repeats))
