"""resize: bilinear NCHW resizes as a resize along W and one along H, with TVM's results to an fp32 rounding; the
transpose of an
enlarging NHWC resize's result to NCHW moved before it."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp.backend.cpu import resize
from relay_amp.backend.cpu.resize import SeparableResizes
from relay_amp.dtypes import numpy_dtype
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms, prepared_module

NCHW, SIZE = (2, 5, 8, 6), (20, 15)


def _resized(shape=NCHW, size=SIZE, layout="NCHW", method="linear", mode="half_pixel", dtype="float32",
             transpose_after=False, cast_after="") -> tvm.IRModule:
    data = relax.Var("data", relax.TensorType(shape, dtype))
    builder = relax.BlockBuilder()
    with builder.function("main", [data]):
        with builder.dataflow():
            out = builder.emit(relax.op.image.resize2d(data, size, layout=layout, method=method,
                                                       coordinate_transformation_mode=mode))
            if cast_after:
                out = builder.emit(relax.op.astype(out, cast_after))
            if transpose_after:
                out = builder.emit(relax.op.permute_dims(out, [0, 3, 1, 2]))
            out = builder.emit_output(out)
        builder.emit_func_output(out)
    return builder.get()


def _separated(data: relax.Var, builder: relax.BlockBuilder, attrs, shape, size, dtype) -> relax.Var:
    batch, channels, height, width = shape
    rows = builder.emit(relax.op.reshape(data, (batch, channels * height, width)))
    along_w = builder.emit(builder.call_te(resize._resize1d(attrs, "NCW", size[1], "float32"), rows,
                                           primfunc_name_hint="resize_w"))
    columns = builder.emit(relax.op.reshape(along_w, (batch * channels, height, size[1])))
    along_h = builder.emit(builder.call_te(resize._resize1d(attrs, "NWC", size[0], dtype), columns,
                                           primfunc_name_hint="resize_h"))
    return builder.emit(relax.op.reshape(along_h, (batch, channels, *size)))


def test_a_bilinear_nchw_resize_runs_along_w_and_then_along_h():
    before = _resized()
    (data,) = before["main"].params
    attrs = before["main"].body.blocks[0].bindings[0].value.attrs
    builder = relax.BlockBuilder()
    with builder.function("main", [data]):
        with builder.dataflow():
            out = builder.emit_output(_separated(data, builder, attrs, NCHW, SIZE, "float32"))
        builder.emit_func_output(out)
    assert_transforms(SeparableResizes(), before, builder.get())


def test_an_enlarging_nhwc_resizes_transpose_to_nchw_moves_before_it_through_its_cast():
    """A bf16 model's logits upsampled at its end: NHWC resize, cast back to fp32, transpose to NCHW. The small input
    is transposed, and the resize runs in NCHW, separated."""
    nhwc = (2, 8, 6, 5)
    before = _resized(nhwc, layout="NHWC", dtype="bfloat16", transpose_after=True, cast_after="float32")
    (data,) = before["main"].params
    attrs = before["main"].body.blocks[0].bindings[0].value.attrs
    builder = relax.BlockBuilder()
    with builder.function("main", [data]):
        with builder.dataflow():
            moved = builder.emit(relax.op.permute_dims(data, [0, 3, 1, 2]))
            resized = _separated(moved, builder, attrs, NCHW, SIZE, "bfloat16")
            cast = builder.emit(relax.op.astype(resized, "float32"))
            out = builder.emit_output(cast)
        builder.emit_func_output(out)
    assert_transforms(SeparableResizes(), before, builder.get())


@pytest.mark.parametrize("before", [
    _resized(method="nearest_neighbor"),  # one gather each already; made separable it measured 2x slower
    _resized(method="cubic"),
    _resized(mode="tf_crop_and_resize"),  # its region of interest
    _resized((2, 8, 6, 5), layout="NHWC"),  # lanes along the channels, contiguous
    _resized(size=NCHW[2:]),  # resizes nothing
    _resized((2, 40, 30, 5), size=(10, 6), layout="NHWC", transpose_after=True),  # shrinks: transposed after
], ids=["nearest", "cubic", "crop_and_resize", "nhwc", "same_size", "shrinking_nhwc"])
def test_other_resizes_stay_tvms(before):
    assert_transforms(SeparableResizes(), before, before)


def test_a_resize_read_by_more_than_its_transpose_keeps_its_layout():
    data = relax.Var("data", relax.TensorType((2, 8, 6, 5), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [data]):
        with builder.dataflow():
            resized = builder.emit(relax.op.image.resize2d(data, SIZE, layout="NHWC"))
            moved = builder.emit(relax.op.permute_dims(resized, [0, 3, 1, 2]))
            out = builder.emit_output(relax.Tuple([moved, resized]))
        builder.emit_func_output(out)
    before = builder.get()
    assert_transforms(SeparableResizes(), before, before)


@pytest.mark.parametrize("mode", ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"])
@pytest.mark.parametrize("dtype, layout, size", [
    ("float32", "NCHW", SIZE), ("bfloat16", "NCHW", SIZE), ("float32", "NCHW", (8, 15)), ("float32", "NCHW", (3, 6)),
    ("float32", "NHWC", SIZE), ("bfloat16", "NHWC", (20, 6))])
def test_separated_resizes_give_tvms_results_to_a_rounding(mode, dtype, layout, size, monkeypatch):
    """Enlarging, along one axis, shrinking; an NHWC resize transposed to NCHW after it (moved before it); the CPU
    build against the same build with TVM's resize2d: the same arithmetic in the same order, but LLVM contracts a
    product and a sum into an FMA in one function and not the other, so fp32 results differ by an fp32 rounding
    (values of order 1: 2e-6) and bf16 ones by at most one bf16 step (2^-7 of the value); and within 1e-5 of TVM's
    default build (fp32)."""
    shape = NCHW if layout == "NCHW" else (2, 8, 6, 5)
    before = _resized(shape, size, layout, mode=mode, dtype=dtype, transpose_after=layout == "NHWC")
    rng = np.random.default_rng(0)
    data = rng.standard_normal(shape).astype("float32")
    inputs = [data.astype(numpy_dtype(dtype))]
    target = relay_amp.targets.host_preset()
    got = run_executable(relay_amp.build(before, target), inputs)[0]
    monkeypatch.setattr(resize, "_separable", lambda call, builder: None)
    monkeypatch.setattr(resize, "_resized_first", lambda call, builder, reads: None)
    tvms = run_executable(relay_amp.build(before, target), inputs)[0]
    got, tvms = np.asarray(got, "float32"), np.asarray(tvms, "float32")
    if dtype == "float32":
        np.testing.assert_allclose(got, tvms, rtol=0, atol=2e-6)
    else:
        assert (np.abs(got - tvms) <= 2.0 ** -7 * np.abs(tvms)).all()
    if dtype == "float32":
        np.testing.assert_allclose(got, relay_amp.run(before, inputs)[0], rtol=1e-5, atol=1e-6)


def test_a_segmentation_model_upsamples_its_logits_in_two_passes_and_matches_pytorch(tmp_path):
    """A model the change was not written on (torchvision's DeepLabV3-MobileNetV3 through ONNX; LR-ASPP was): its
    logits' bilinear upsampling to the image's size, NHWC after the convs and transposed to NCHW at the end, runs in
    NCHW as a pass along W and one along H, in fp32 and bf16, and the builds match PyTorch. (Its pooling branch's
    upsampling from one pixel, between NHWC ops, stays TVM's NHWC resize.)"""
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    net = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                        num_classes=3, aux_loss=False).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)["out"]

    logits, x = Logits().eval(), torch.randn(1, 3, 64, 64)
    torch.onnx.export(logits, (x,), str(tmp_path / "deeplab.onnx"), opset_version=17, dynamo=False)
    mod = relay_amp.frontend.from_onnx(tmp_path / "deeplab.onnx")
    with torch.no_grad():
        expected = logits(x).numpy()
    for variant, tolerance in ((mod, 1e-4), (relay_amp.to_mixed_precision(mod, "bfloat16"), 0.05)):
        last = prepared_module(variant)["main"].body.blocks[-1].bindings[-1].value  # the output: the logits upsampled
        assert "resize_w" in last.args[0].name_hint and "resize_h" in last.args[0].name_hint
        built = run_executable(relay_amp.build(variant, relay_amp.targets.host_preset()), [x.numpy()])[0]
        np.testing.assert_allclose(built, expected, atol=tolerance * np.abs(expected).max())
