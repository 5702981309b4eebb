"""realize_qdq: a QDQ model's pairs removed (Before/Expected), its ranges planned, and ONNX Runtime's own QDQ file
compiled on relay_amp's int8 layers with its accuracy."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import DTypeError, ModuleError, OptionError, digits, metrics
from relay_amp.passes.quantize import QuantEntry, QuantPlan
from relay_amp.passes.quantize.plan import DYNAMIC
from relay_amp.passes.quantize.qdq import _zero_point, code_range, strip_qdq
from relay_amp.passes.quantize.realize import QUANTIZABLE_OPS

from builders import tensor
from pass_checks import assert_transforms

CODES = np.array([[127, -127, 127], [-64, 64, 64]], "int8")  # [K=2, N=3], symmetric per output column
COLUMN_SCALES = np.array([0.5, 1.0, 0.25], "float32") / 127


def _weight() -> relax.Expr:
    return relax.op.dequantize(relax.const(CODES), relax.const(COLUMN_SCALES), relax.const(np.zeros(3, "int8")),
                               axis=1)


def qdq_linear(scale: float, zero: int, dtype: str) -> tvm.IRModule:
    """main(x[4, 2]) = dequantize(quantize(x)) @ dequantize(CODES): an activation pair and a weight dequantize."""
    bb = relax.BlockBuilder()
    x = tensor("x", (4, 2))
    scale_c, zero_c = relax.const(scale, "float32"), relax.const(zero, dtype)
    with bb.function("main", [x]):
        with bb.dataflow():
            codes = bb.emit(relax.op.quantize(x, scale_c, zero_c, axis=1, out_dtype=dtype))
            real = bb.emit(relax.op.dequantize(codes, scale_c, zero_c, axis=1))
            out = bb.emit_output(relax.op.matmul(real, bb.emit(_weight())))
        bb.emit_func_output(out)
    return bb.get()


def float_linear(clamp: tuple[float, float] | None = None) -> tvm.IRModule:
    """qdq_linear without its activation pair: x clamped to `clamp` (the pair's range), if given."""
    bb = relax.BlockBuilder()
    x = tensor("x", (4, 2))
    with bb.function("main", [x]):
        with bb.dataflow():
            data = x
            if clamp is not None:
                floored = bb.emit(relax.op.maximum(x, relax.const(clamp[0], "float32")))
                data = bb.emit(relax.op.minimum(floored, relax.const(clamp[1], "float32")))
            out = bb.emit_output(relax.op.matmul(data, bb.emit(_weight())))
        bb.emit_func_output(out)
    return bb.get()


def test_strip_qdq_removes_activation_pairs_keeping_their_clamp_and_weight_dequantizes():
    """uint8 codes at 2/255 stand for [0, 2]: ONNX Runtime folds a ReLU into such a pair and removes it."""
    assert_transforms(strip_qdq, qdq_linear(2 / 255, 0, "uint8"), float_linear(clamp=(0.0, 2.0)))


def dynamic_qdq_linear() -> tvm.IRModule:
    """qdq_linear with the activation's scale computed at run time, as DynamicQuantizeLinear imports."""
    bb = relax.BlockBuilder()
    x = tensor("x", (4, 2))
    zero = relax.const(0, "uint8")
    with bb.function("main", [x]):
        with bb.dataflow():
            scale = bb.emit(relax.op.divide(relax.op.max(relax.op.abs(x)), relax.const(255.0)))
            codes = bb.emit(relax.op.quantize(x, scale, zero, axis=0, out_dtype="uint8"))
            real = bb.emit(relax.op.dequantize(codes, scale, zero, axis=1))
            out = bb.emit_output(relax.op.matmul(real, bb.emit(_weight())))
        bb.emit_func_output(out)
    return bb.get()


def test_strip_qdq_removes_pairs_whose_scale_is_computed_at_run_time():
    assert_transforms(strip_qdq, dynamic_qdq_linear(), float_linear())


def test_a_pair_whose_scale_is_computed_at_run_time_makes_a_dynamic_matmul():
    realized = relay_amp.realize_qdq(dynamic_qdq_linear(), fallback_dtype="float32")
    [entry] = relay_amp.quant_plan(realized).entries
    assert entry.dtype == DYNAMIC
    plan = QuantPlan(list(QUANTIZABLE_OPS), "qdq", "per_channel", "float32", entries=[entry])
    tvm.ir.assert_structural_equal(realized, relay_amp.apply_quant_plan(float_linear(), plan))


@pytest.mark.parametrize("scale, zero, dtype, planned, threshold, zero_point, clamp", [
    (2 / 255, 0, "uint8", "uint8", 2.0, 0, (0.0, 2.0)),  # no negative part: the model's own codes
    (0.5, 0, "int8", "uint8", 63.5, 128, (-64.0, 63.5)),  # int8 codes, shifted by 128: the same values
    (0.5, 128, "uint8", "uint8", 63.5, 128, (-64.0, 63.5)),  # ONNX Runtime's uint8 around a signed range
    (0.5, 100, "uint8", "uint8", 77.5, 100, (-50.0, 77.5)),
])
def test_the_plan_holds_each_layer_range_from_the_model(scale, zero, dtype, planned, threshold, zero_point, clamp):
    realized = relay_amp.realize_qdq(qdq_linear(scale, zero, dtype), fallback_dtype="float32")
    [entry] = relay_amp.quant_plan(realized).entries
    assert (entry.dtype, entry.threshold, entry.zero_point) == (planned, pytest.approx(threshold), zero_point)
    assert entry.step == pytest.approx(scale)  # the model's own codes
    assert relay_amp.quant_plan(realized).observer == "qdq"
    plan = QuantPlan(list(QUANTIZABLE_OPS), "qdq", "per_channel", "float32", entries=[entry])
    tvm.ir.assert_structural_equal(realized, relay_amp.apply_quant_plan(float_linear(clamp), plan))


def test_a_range_that_is_not_255_steps_of_one_scale_has_no_zero_point():
    assert _zero_point(-1.0, 2.2) is None  # 1 / 3.2 * 255 = 79.69: not the 255 steps of one scale
    assert _zero_point(-64.0, 63.5) == 128 and _zero_point(0.0, 2.0) is None


def test_code_range_is_what_the_extreme_codes_stand_for():
    call = relax.op.quantize(tensor("x", (2, 3)), relax.const(np.array([0.1, 0.2, 0.4], "float32")),
                             relax.const(np.array([0, 10, 20], "uint8")), axis=1, out_dtype="uint8")
    call = relax.BlockBuilder().normalize(call)
    assert code_range(call) == (pytest.approx(-8.0), pytest.approx(94.0))  # (0 - 20) x 0.4, (255 - 20) x 0.4


def test_a_layer_without_a_pair_stays_in_the_fallback_dtype():
    bb = relax.BlockBuilder()
    x = tensor("x", (4, 2))
    scale, zero = relax.const(2 / 255, "float32"), relax.const(0, "uint8")
    with bb.function("main", [x]):
        with bb.dataflow():
            real = bb.emit(relax.op.dequantize(bb.emit(relax.op.quantize(x, scale, zero, out_dtype="uint8")), scale,
                                               zero))
            first = bb.emit(relax.op.matmul(real, bb.emit(_weight())))
            out = bb.emit_output(relax.op.matmul(first, relax.const(np.ones((3, 16), "float32"))))
        bb.emit_func_output(out)
    entries = relay_amp.quant_plan(relay_amp.realize_qdq(bb.get())).entries
    assert [(e.dtype, e.reason) for e in entries] == [("uint8", "from the model's QuantizeLinear"),
                                                      ("fallback", "no QDQ pair on its input")]


@pytest.fixture(scope="module")
def onnxruntime_qdq_digits(tmp_path_factory):
    """The digits CNN quantized by ONNX Runtime's static quantizer (QDQ, per-channel int8 weights, uint8
    activations) on two batches of the held-out split, and an ONNX Runtime session on that file."""
    quantization = pytest.importorskip("onnxruntime.quantization")
    import onnxruntime

    images, _ = digits.load_test_split()

    class Batches(quantization.CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"image": images[i:i + 50]} for i in (0, 50)])

        def get_next(self):
            return next(self.batches, None)

    path = tmp_path_factory.mktemp("qdq") / "digits_qdq.onnx"
    quantization.quantize_static(str(digits.MODEL_FILE), str(path), Batches(), quant_format=quantization.QuantFormat.QDQ,
                                 per_channel=True, activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8)
    return path, onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_onnxruntime_qdq_model_runs_int8_with_its_accuracy(onnxruntime_qdq_digits):
    path, session = onnxruntime_qdq_digits
    realized = relay_amp.realize_qdq(relay_amp.frontend.from_onnx(path, shape_dict={"image": [50, 1, 8, 8]}))
    assert [e.dtype for e in relay_amp.quant_plan(realized).entries] == ["uint8"] * 4
    images, labels = digits.load_test_split()
    batches = [images[i:i + 50] for i in range(0, len(images), 50)]
    ours = np.concatenate([relay_amp.run(realized, [x])[0] for x in batches])
    theirs = np.concatenate([session.run(None, {"image": x})[0] for x in batches])
    fp32 = np.concatenate([relay_amp.run(digits.load_model(), [x])[0] for x in batches])
    assert metrics.top1_accuracy(ours, labels) == pytest.approx(metrics.top1_accuracy(theirs, labels), abs=0.005)
    # ONNX Runtime also rounds the logits to its output QDQ pair; relay_amp's logits stay in float
    assert np.abs(ours - fp32).max() <= np.abs(theirs - fp32).max()


def _pytorch_quantized_cnn(path):
    """A small residual CNN quantized by PyTorch (FX graph mode post-training quantization, its x86 qconfig:
    per-channel int8 weights, uint8 activations) on random batches and exported by the TorchScript ONNX exporter,
    which writes QuantizeLinear/DequantizeLinear pairs; the quantized module and an input."""
    torch = pytest.importorskip("torch")
    quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
    from torch.ao.quantization import get_default_qconfig_mapping

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
                                            torch.nn.ReLU())
            self.body = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
                                            torch.nn.Conv2d(16, 16, 3, padding=1))
            self.head = torch.nn.Linear(16, 10)

        def forward(self, x):
            x = self.stem(x)
            x = torch.relu(x + self.body(x))
            return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))

    torch.manual_seed(0)
    batches = [torch.randn(1, 3, 16, 16) for _ in range(5)]
    model = quantize_fx.prepare_fx(Residual().eval(), get_default_qconfig_mapping("x86"), (batches[0],))
    with torch.no_grad():
        for batch in batches[1:]:
            model(batch)
        model = quantize_fx.convert_fx(model)
        torch.onnx.export(model, (batches[0],), str(path), opset_version=17, dynamo=False)
    return model, batches[0]


def test_a_model_quantized_and_exported_by_pytorch_runs_its_layers_in_int8(tmp_path):
    model, x = _pytorch_quantized_cnn(tmp_path / "quantized.onnx")
    realized = relay_amp.realize_qdq(relay_amp.frontend.from_onnx(tmp_path / "quantized.onnx"))
    dtypes = [e.dtype for e in relay_amp.quant_plan(realized).entries]
    assert dtypes == ["uint8"] * 4  # three convs and the head read the codes of PyTorch's activation ranges
    got = relay_amp.run(realized, [x.numpy()])[0]
    expected = model(x).detach().numpy()
    # fp32 requantization, logits not rounded to an output pair, against PyTorch's integer one (0.7% measured)
    assert np.abs(got - expected).max() <= 0.02 * np.abs(expected).max()


def test_bad_input_is_a_clear_error():
    with pytest.raises(ModuleError, match="not a QDQ model"):
        relay_amp.realize_qdq(float_linear())
    with pytest.raises(OptionError, match="cannot quantize relax.nn.softmax"):
        relay_amp.realize_qdq(qdq_linear(0.1, 0, "uint8"), ops=["nn.softmax"])
    with pytest.raises(DTypeError, match="fallback_dtype"):
        relay_amp.realize_qdq(qdq_linear(0.1, 0, "uint8"), fallback_dtype="int4")


def test_pass_form_matches_the_function():
    mod = qdq_linear(2 / 255, 0, "uint8")
    tvm.ir.assert_structural_equal(relay_amp.transform.RealizeQDQ()(mod), relay_amp.realize_qdq(mod))
    assert isinstance(relay_amp.quant_plan(relay_amp.realize_qdq(mod)).entries[0], QuantEntry)
