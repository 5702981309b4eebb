"""Quantize: structural Before/Expected tests, observers, plans, errors, and int8 accuracy on the Relax VM."""

import json
import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import ModelLoadError, OptionError, digits, metrics, models, targets
from relay_amp.compile.build import build
from relay_amp.passes.quantize import QuantEntry, QuantPlan
from relay_amp.passes.quantize.observers import BINS, Histogram, threshold
from relay_amp.passes.quantize import realize
from relay_amp.passes.quantize.plan import code_levels, zero_point_position
from relay_amp._ir import tensor_dtype
from relay_amp.ops import call_op_name
from relay_amp.passes.quantize.realize import quantize_weight
from relay_amp.runtime import run_executable
from relay_amp.tools.models import example_inputs

from builders import expert_layer, single_output_module, tensor
from pass_checks import assert_transforms

WEIGHT = np.array([[0.5, -1.0, 0.25], [-0.25, 0.5, 0.125]], "float32")  # [K=2, N=3]: per-column scales


def linear_module() -> tvm.IRModule:
    """main(x[4, 2]) = x @ WEIGHT."""
    bb = relax.BlockBuilder()
    x = tensor("x", (4, 2))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.const(WEIGHT)))
        bb.emit_func_output(out)
    return bb.get()


def expected_linear(dtype: str, step: float, zero_point: int = 0, bits: int = 8,
                    input_means: tuple = (0.0, 0.0)) -> tvm.IRModule:
    """What quantization makes of linear_module with activations in `bits`-bit `dtype` codes of `step` around
    `zero_point`, and the weights' rounding error over inputs of `input_means` (per column) taken out."""
    levels = code_levels(dtype, bits)
    codes = np.array([[127, -127, 127], [-64, 64, 64]], "int8")  # WEIGHT / its column max |w| * 127
    weight_scales = np.abs(WEIGHT).max(axis=0).astype("float64") / 127
    scales = weight_scales * step  # as quantize_weight computes them
    rounding = np.asarray(input_means) @ (codes * weight_scales - WEIGHT)  # -0.25 became -64/127 * 0.5
    bb = relax.BlockBuilder()
    x = tensor("x", (4, 2))
    with bb.function("main", [x]):
        with bb.dataflow():
            scaled = bb.emit(relax.op.multiply(x, relax.const(1 / step)))
            rounded = bb.emit(relax.op.floor(bb.emit(relax.op.add(scaled, relax.const(zero_point + 0.5)))))
            floored = bb.emit(relax.op.maximum(rounded, relax.const(0.0 if dtype == "uint8" else -float(levels))))
            clipped = bb.emit(relax.op.minimum(floored, relax.const(float(levels))))
            activations = bb.emit(relax.op.astype(clipped, dtype))
            accumulated = bb.emit(relax.op.matmul(activations, relax.const(codes), out_dtype="int32"))
            real = relax.op.multiply(relax.op.astype(accumulated, "float32"),
                                     relax.const(scales.reshape(1, -1).astype("float32")))
            # minus the zero point's products (zero_point x each column's code sum) and the rounding's mean error
            correction = -zero_point * codes.astype("int64").sum(axis=0) * scales - rounding
            if correction.any():
                real = relax.op.add(bb.emit(real), relax.const(correction.reshape(1, -1).astype("float32")))
            out = bb.emit_output(real)
        bb.emit_func_output(out)
    return bb.get()


def linear_plan(dtype: str, limit: float, fallback: str = "float32", zero_point: int = 0) -> QuantPlan:
    layer = relay_amp.list_layers(linear_module(), ["matmul"])[0]
    return QuantPlan(["relax.matmul"], "minmax", "per_channel", fallback,
                     entries=[QuantEntry(0, layer.op, layer.name, dtype, limit, "test", zero_point)])


DEPTHWISE_WEIGHT = np.random.default_rng(3).normal(size=(4, 1, 3, 3)).astype("float32")
GROUPED_WEIGHT = np.random.default_rng(6).normal(size=(16, 8, 3, 3)).astype("float32")  # 2 groups of 8 channels


def grouped(data: relax.Expr, weight: np.ndarray, out_dtype: str = "float32") -> relax.Expr:
    """A padded 3x3 conv of `data`, as many channels as `weight` outputs, in groups of its input depth."""
    groups = weight.shape[0] // weight.shape[1]
    return relax.op.nn.conv2d(data, relax.const(weight), padding=1, groups=groups, out_dtype=out_dtype)


def grouped_module(weight: np.ndarray) -> tvm.IRModule:
    """main(x) = the grouped conv of x with `weight` (DEPTHWISE_WEIGHT: 4 channels; GROUPED_WEIGHT: 16)."""
    channels = weight.shape[0]
    return single_output_module(lambda x: grouped(x, weight), tensor("x", (1, channels, 6, 6)))


def expected_grouped(weight: np.ndarray, step: float) -> tvm.IRModule:
    """grouped_module with uint8 activation codes of `step`, then one multiply: fp32 weight codes and fp32 sums for
    the depthwise conv (no kernel takes one), int8 codes and int32 sums for groups of 8, as for any conv."""
    codes, scales = quantize_weight(weight, 0)
    depthwise = weight.shape[1] == 1
    bb = relax.BlockBuilder()
    x = tensor("x", (1, weight.shape[0], 6, 6))
    with bb.function("main", [x]):
        with bb.dataflow():
            scaled = bb.emit(relax.op.multiply(x, relax.const(1 / step)))
            rounded = bb.emit(relax.op.floor(bb.emit(relax.op.add(scaled, relax.const(0.5)))))
            clipped = bb.emit(relax.op.minimum(bb.emit(relax.op.maximum(rounded, relax.const(0.0))),
                                               relax.const(255.0)))
            activations = bb.emit(relax.op.astype(clipped, "uint8"))
            if depthwise:
                accumulated = bb.emit(grouped(activations, codes.astype("float32")))
            else:
                accumulated = bb.emit(relax.op.astype(bb.emit(grouped(activations, codes, "int32")), "float32"))
            out = bb.emit_output(relax.op.multiply(accumulated, relax.const(
                (scales * step).reshape(1, -1, 1, 1).astype("float32"))))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("weight", [DEPTHWISE_WEIGHT, GROUPED_WEIGHT], ids=["depthwise", "groups_of_8"])
def test_a_grouped_conv_multiplies_its_codes_by_fp32_weight_codes_only_where_its_groups_are_narrow(weight):
    layer = relay_amp.list_layers(grouped_module(weight), ["nn.conv2d"])[0]
    plan = QuantPlan(["relax.nn.conv2d"], "minmax", "per_channel", "float32",
                     entries=[QuantEntry(0, layer.op, layer.name, "uint8", 2.0, "test")])
    assert_transforms(lambda mod: relay_amp.apply_quant_plan(mod, plan).without_attr(QuantPlan.ATTR),
                      grouped_module(weight), expected_grouped(weight, 2.0 / 255))


def test_quantize_makes_a_depthwise_conv_of_an_unsigned_input_int8_and_keeps_a_signed_one_in_the_fallback():
    """After a ReLU the conv runs on codes, within the codes' rounding of fp32 (its sums are exact: integers below
    2^24); after a SiLU-like signed input it stays in the fallback, with the reason."""
    rng = np.random.default_rng(4)
    unsigned = [np.abs(rng.normal(size=(1, 4, 6, 6))).astype("float32") for _ in range(4)]
    quantized = relay_amp.quantize(grouped_module(DEPTHWISE_WEIGHT), unsigned, fallback_dtype="float32")
    [entry] = relay_amp.quant_plan(quantized).entries
    assert entry.dtype == "uint8"
    inputs = [np.abs(rng.normal(size=(1, 4, 6, 6))).astype("float32")]
    expected = relay_amp.run(grouped_module(DEPTHWISE_WEIGHT), inputs)[0]
    np.testing.assert_allclose(relay_amp.run(quantized, inputs)[0], expected, atol=0.03 * np.abs(expected).max())
    relax.analysis.well_formed(quantized)
    signed = [rng.normal(size=(1, 4, 6, 6)).astype("float32")]
    [entry] = relay_amp.quant_plan(relay_amp.quantize(grouped_module(DEPTHWISE_WEIGHT), signed)).entries
    assert entry.dtype == "fallback" and entry.reason.startswith("grouped convolution of a signed input")


def test_quantize_makes_a_conv_in_groups_of_8_of_a_signed_input_int8_within_its_codes_rounding():
    """Groups as wide as the kernels take are quantized as any conv: int8 codes of a signed input (offset to uint8),
    int32 sums (RegNet's groups of 8 outputs, in the fp32 sums kept for depthwise convs, made its int8 slower than
    fp32)."""
    rng = np.random.default_rng(7)
    calibration = [rng.normal(size=(1, 16, 6, 6)).astype("float32") for _ in range(4)]
    quantized = relay_amp.quantize(grouped_module(GROUPED_WEIGHT), calibration, fallback_dtype="float32")
    [entry] = relay_amp.quant_plan(quantized).entries
    assert (entry.dtype, entry.zero_point) == ("uint8", 128)
    inputs = [0.9 * calibration[0]]  # within the calibrated range: no clipped outliers
    expected = relay_amp.run(grouped_module(GROUPED_WEIGHT), inputs)[0]
    np.testing.assert_allclose(relay_amp.run(quantized, inputs)[0], expected, atol=0.03 * np.abs(expected).max())
    relax.analysis.well_formed(quantized)


@pytest.mark.parametrize("dtype, levels", [("uint8", 255), ("int8", 127)])
def test_a_planned_matmul_becomes_codes_times_int8_weights_and_one_dequantizing_multiply(dtype, levels):
    plan = linear_plan(dtype, 2.0)
    assert_transforms(lambda mod: relay_amp.apply_quant_plan(mod, plan).without_attr(QuantPlan.ATTR),
                      linear_module(), expected_linear(dtype, 2.0 / levels))
    assert relay_amp.quant_plan(relay_amp.apply_quant_plan(linear_module(), plan)) == plan


SQUARE = np.array([[0.5, -1.0], [-0.25, 0.5]], "float32")  # [K=2, N=2]: the output adds back its input


def residual_module(activated: bool = True) -> tvm.IRModule:
    """main(x[4, 2]) = a @ SQUARE + a for a = relu(x) (or x itself, a signed input): a residual connection around
    one layer."""
    bb = relax.BlockBuilder()
    x = tensor("x", (4, 2))
    with bb.function("main", [x]):
        with bb.dataflow():
            source = bb.emit(relax.op.nn.relu(x)) if activated else x
            layer = bb.emit(relax.op.matmul(source, relax.const(SQUARE)))
            out = bb.emit_output(relax.op.add(layer, source))
        bb.emit_func_output(out)
    return bb.get()


def expected_residual(step: float, quantized_residuals: bool, zero_point: int = 0) -> tvm.IRModule:
    """residual_module with uint8 codes of `step` around `zero_point` (a signed input: x itself, else relu(x)); the
    add reads their value, or its operand itself."""
    codes = np.array([[127, -127], [-64, 64]], "int8")
    scales = np.abs(SQUARE).max(axis=0) / 127 * step
    bb = relax.BlockBuilder()
    x = tensor("x", (4, 2))
    with bb.function("main", [x]):
        with bb.dataflow():
            source = x if zero_point else bb.emit(relax.op.nn.relu(x))
            scaled = bb.emit(relax.op.multiply(source, relax.const(1 / step)))
            rounded = bb.emit(relax.op.floor(bb.emit(relax.op.add(scaled, relax.const(zero_point + 0.5)))))
            clipped = bb.emit(relax.op.minimum(bb.emit(relax.op.maximum(rounded, relax.const(0.0))),
                                               relax.const(255.0)))
            activations = bb.emit(relax.op.astype(clipped, "uint8"))
            accumulated = bb.emit(relax.op.matmul(activations, relax.const(codes), out_dtype="int32"))
            layer = bb.emit(relax.op.multiply(relax.op.astype(accumulated, "float32"),
                                              relax.const(scales.reshape(1, -1).astype("float32"))))
            if zero_point:  # minus the zero point's products: zero_point x each column's code sum
                correction = -zero_point * codes.astype("int64").sum(axis=0) * scales
                layer = bb.emit(relax.op.add(layer, relax.const(correction.reshape(1, -1).astype("float32"))))
            if quantized_residuals:
                real = bb.emit(relax.op.astype(activations, "float32"))
                if zero_point:
                    real = bb.emit(relax.op.subtract(real, relax.const(float(zero_point), "float32")))
                source = bb.emit(relax.op.multiply(real, relax.const(step, "float32")))
            out = bb.emit_output(relax.op.add(layer, source))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("quantized_residuals", [True, False])
def test_a_residual_add_reads_the_value_of_its_operands_uint8_codes(quantized_residuals):
    layer = relay_amp.list_layers(residual_module(), ["matmul"])[0]
    plan = QuantPlan(["relax.matmul"], "minmax", "per_channel", "float32",
                     entries=[QuantEntry(0, layer.op, layer.name, "uint8", 2.0, "test")],
                     quantized_residuals=quantized_residuals)
    assert_transforms(lambda mod: relay_amp.apply_quant_plan(mod, plan).without_attr(QuantPlan.ATTR),
                      residual_module(), expected_residual(2.0 / 255, quantized_residuals))


def test_a_residual_add_reads_a_signed_operands_codes_less_their_zero_point():
    """A signed input's codes (int8's step, offset by 128 to uint8): the add reads (codes - 128) x step, within a
    code's rounding of fp32."""
    layer = relay_amp.list_layers(residual_module(activated=False), ["matmul"])[0]
    plan = QuantPlan(["relax.matmul"], "minmax", "per_channel", "float32",
                     entries=[QuantEntry(0, layer.op, layer.name, "uint8", 2.0, "test", 128)],
                     quantized_residuals=True)
    assert_transforms(lambda mod: relay_amp.apply_quant_plan(mod, plan).without_attr(QuantPlan.ATTR),
                      residual_module(activated=False), expected_residual(plan.entries[0].step, True, 128))
    x = np.array([[-1.0, 0.5], [2.0, -0.25], [0.125, -2.0], [0.0, 1.0]], "float32")
    got = relay_amp.run(relay_amp.apply_quant_plan(residual_module(activated=False), plan), [x])[0]
    np.testing.assert_allclose(got, x @ SQUARE + x, atol=2.5 * plan.entries[0].step)


def _residual_adds(mod: tvm.IRModule) -> tuple[int, int]:
    """(adds of two tensors, those reading an operand as uint8 codes times their step) in mod's main."""
    values = {b.var: b.value for block in mod["main"].body.blocks for b in block.bindings}

    def reads_codes(operand: relax.Expr) -> bool:
        value = values.get(operand)
        if call_op_name(value) != "relax.multiply":
            return False
        real = values.get(value.args[0])
        if call_op_name(real) == "relax.subtract":  # less a zero point
            real = values.get(real.args[0])
        return call_op_name(real) == "relax.astype" and real.args[0].ty.dtype == "uint8"

    adds = [v for v in values.values() if call_op_name(v) == "relax.add"
            and not any(isinstance(arg, tvm.ir.expr.Constant) for arg in v.args)]
    return len(adds), sum(any(reads_codes(arg) for arg in add.args) for add in adds)


def _quantized_error(mod: tvm.IRModule, quantized_residuals: bool) -> tuple[float, tvm.IRModule]:
    """The largest error of mod quantized on 4 random batches (fp32 fallback) relative to fp32's largest output."""
    calib = [example_inputs(mod, seed) for seed in (1, 2, 3, 4)]
    quantized = relay_amp.quantize(mod, calib, fallback_dtype="float32", quantized_residuals=quantized_residuals)
    inputs = example_inputs(mod, 9)
    expected = relay_amp.run(mod, inputs)[0]
    return float(np.abs(relay_amp.run(quantized, inputs)[0] - expected).max() / np.abs(expected).max()), quantized


# the largest error each may leave: tiny MobileNetV2's int8 is coarse whatever its residuals (0.175 with fp32 ones)
@pytest.mark.parametrize("source, adds_reading_codes, ceiling", [("relay_amp", 5, 0.05), ("resnet18", 1, 0.05),
                                                                 ("mobilenet_v2", 10, 0.25)])
def test_quantized_residuals_keep_a_model_close_to_fp32(source, adds_reading_codes, ceiling):
    """relay_amp's ResNet-18 and the zoo's ResNet-18 and MobileNetV2 (through ONNX, models the rewrite was not
    written on): every residual add whose operand a layer quantizes to uint8 reads its codes (a ResNet's after its
    ReLU, not those after a downsampling conv, which a block's first conv does not read; each of MobileNetV2's
    signed bottleneck outputs, less its zero point), within 1.5x of the error that fp32 residuals leave and under
    `ceiling` of the largest output."""
    if source == "relay_amp":
        mod = models.resnet18(image_size=32, classes=16)
    else:
        mod = pytest.importorskip("relay_amp.tools.zoo").load(source, tiny=True)
    floats_error, floats = _quantized_error(mod, False)
    codes_error, codes = _quantized_error(mod, True)
    assert _residual_adds(codes)[1] == adds_reading_codes and _residual_adds(floats)[1] == 0
    assert relay_amp.quant_plan(codes).quantized_residuals and not relay_amp.quant_plan(floats).quantized_residuals
    assert codes_error < max(1.5 * floats_error, 0.01) and codes_error < ceiling, (codes_error, floats_error)
    relax.analysis.well_formed(codes)


def test_a_zero_point_shifts_the_codes_and_its_products_come_off_each_column():
    """uint8 codes z + x / step for x down to -z * step: threshold 2.0 over 255 - 15 codes above z = 15."""
    plan = linear_plan("uint8", 2.0, zero_point=15)
    assert plan.entries[0].step == pytest.approx(2.0 / 240)
    assert_transforms(lambda mod: relay_amp.apply_quant_plan(mod, plan).without_attr(QuantPlan.ATTR),
                      linear_module(), expected_linear("uint8", 2.0 / 240, 15))
    x = np.array([[-0.1, 1.0], [2.0, -0.125], [0.25, 1.5], [0.0, 0.0]], "float32")
    got = relay_amp.run(relay_amp.apply_quant_plan(linear_module(), plan), [x])[0]
    np.testing.assert_allclose(got, x @ WEIGHT, atol=1.5 * 2.0 / 240)  # rounding of codes and weight codes


def _skewed_module(layer) -> tvm.IRModule:
    """main(x) = layer(gelu(x)): a layer reading an activation whose negative side is short (down to -0.17)."""
    return single_output_module(lambda x: layer(relax.op.nn.gelu(x)), tensor("x", (1, 32, 8, 8)))


def _padded_conv(data: relax.Expr) -> relax.Expr:
    weight = np.random.default_rng(11).normal(size=(16, 32, 3, 3)).astype("float32")
    return relax.op.nn.conv2d(data, relax.const(weight), padding=1)


def _unpadded_conv1d(data: relax.Expr) -> relax.Expr:
    weight = np.random.default_rng(12).normal(size=(16, 32, 3)).astype("float32")
    return relax.op.nn.conv1d(relax.op.reshape(data, (1, 32, 64)), relax.const(weight), strides=2)


@pytest.mark.parametrize("layer", [_padded_conv, _unpadded_conv1d])
def test_layers_after_a_gelu_get_a_zero_point_and_a_smaller_error_than_symmetric_int8(layer):
    """A padded conv's codes are padded with the zero point (the code of 0.0) and the conv has no padding left;
    conv1d (audio front ends) quantizes as conv2d does."""
    rng = np.random.default_rng(13)
    calib = [rng.normal(size=(1, 32, 8, 8)).astype("float32") * 2 for _ in range(4)]
    inputs = [rng.normal(size=(1, 32, 8, 8)).astype("float32") * 2]
    expected = relay_amp.run(_skewed_module(layer), inputs)[0]
    errors, scripts = {}, {}
    for activations in ("auto", "symmetric"):
        quantized = relay_amp.quantize(_skewed_module(layer), calib, activation_dtype=activations,
                                       fallback_dtype="float32")
        [entry] = relay_amp.quant_plan(quantized).entries
        assert (entry.dtype, entry.zero_point > 0) == (("uint8", True) if activations == "auto" else ("int8", False))
        difference = relay_amp.run(quantized, inputs)[0] - expected
        errors[activations] = np.sqrt(np.mean(difference ** 2) / np.mean(expected ** 2))  # relative RMS
        scripts[activations] = quantized["main"].script()
        relax.analysis.well_formed(quantized)
    assert errors["auto"] < 0.75 * errors["symmetric"] and errors["auto"] < 0.02, errors
    if targets.host_supports("avx512_vnni"):  # relay_amp's build: NHWC, the VNNI kernels, the pad of codes
        quantized = relay_amp.quantize(_skewed_module(layer), calib, fallback_dtype="float32")
        built = run_executable(build(quantized, "cpu-avx512-bf16"), inputs)[0]
        generic = relay_amp.run(quantized, inputs)[0]
        assert np.abs(built - generic).max() <= 1e-3 * np.abs(generic).max()  # a code apart at most, at a tie
    if layer is _padded_conv:
        zero_point = float(relay_amp.quant_plan(relay_amp.quantize(_skewed_module(layer), calib)).entries[0].zero_point)
        assert f"pad_value={zero_point}" in scripts["auto"] and "padding=[0, 0, 0, 0]" in scripts["auto"]
        assert "R.nn.pad(" not in scripts["symmetric"]


def test_quantize_picks_uint8_for_non_negative_inputs_and_the_observed_maximum():
    data = [np.array([[0.0, 1.0], [2.0, 0.5], [0.25, 1.5], [1.0, 1.0]], "float32")]
    quantized = relay_amp.quantize(linear_module(), data, fallback_dtype="float32")
    [entry] = relay_amp.quant_plan(quantized).entries
    assert (entry.dtype, entry.threshold) == ("uint8", pytest.approx(2.0))
    assert entry.input_means == pytest.approx((0.8125, 1.0))  # each column's mean
    tvm.ir.assert_structural_equal(quantized.without_attr(QuantPlan.ATTR),
                                   expected_linear("uint8", 2.0 / 255, input_means=entry.input_means))


def test_signed_inputs_get_int8s_codes_offset_to_uint8_and_int8_can_be_forced():
    """Symmetric int8's step, its codes plus 128: uint8, the operand vpdpbusd takes, with no shift in the kernel."""
    signed = [np.array([[-3.0, 1.0], [2.0, 0.5], [0.25, 1.5], [1.0, 1.0]], "float32")]
    quantized = relay_amp.quantize(linear_module(), signed, fallback_dtype="float32")
    [entry] = relay_amp.quant_plan(quantized).entries
    assert (entry.dtype, entry.zero_point, entry.step) == ("uint8", 128, pytest.approx(3.0 / 127))
    tvm.ir.assert_structural_equal(quantized.without_attr(QuantPlan.ATTR),
                                   expected_linear("uint8", 3.0 / 127, 128, input_means=entry.input_means))
    symmetric = relay_amp.quantize(linear_module(), signed, activation_dtype="symmetric", fallback_dtype="float32")
    assert relay_amp.quant_plan(symmetric).entries[0].dtype == "int8"
    inputs = [np.array([[-2.9, 0.3], [1.7, -0.4], [0.6, 2.2], [-1.1, 1.3]], "float32")]
    np.testing.assert_allclose(relay_amp.run(quantized, inputs)[0], relay_amp.run(symmetric, inputs)[0],
                               rtol=1e-6, atol=1e-6)  # the same codes, 128 higher
    positive = [np.abs(signed[0])]
    forced = relay_amp.quantize(linear_module(), positive, activation_dtype="int8")
    assert relay_amp.quant_plan(forced).entries[0].dtype == "int8"


def test_7_bit_activation_codes_take_half_the_levels_and_offset_signed_codes_by_64():
    """Unsigned inputs get codes up to 127 (twice 8-bit codes' step), signed ones symmetric 7-bit codes plus 64;
    weights stay 8-bit."""
    unsigned = [np.array([[0.0, 1.0], [2.0, 0.5], [0.25, 1.5], [1.0, 1.0]], "float32")]
    quantized = relay_amp.quantize(linear_module(), unsigned, fallback_dtype="float32", activation_bits=7)
    [entry] = relay_amp.quant_plan(quantized).entries
    assert (entry.dtype, entry.bits, entry.step) == ("uint8", 7, pytest.approx(2.0 / 127))
    tvm.ir.assert_structural_equal(quantized.without_attr(QuantPlan.ATTR),
                                   expected_linear("uint8", entry.step, bits=7, input_means=entry.input_means))
    signed = [np.array([[-3.0, 1.0], [2.0, 0.5], [0.25, 1.5], [1.0, 1.0]], "float32")]
    offset = relay_amp.quantize(linear_module(), signed, fallback_dtype="float32", activation_bits=7)
    [entry] = relay_amp.quant_plan(offset).entries
    assert (entry.dtype, entry.zero_point, entry.step) == ("uint8", 64, pytest.approx(3.0 / 63))
    tvm.ir.assert_structural_equal(offset.without_attr(QuantPlan.ATTR),
                                   expected_linear("uint8", entry.step, 64, bits=7, input_means=entry.input_means))
    inputs = [np.array([[-2.9, 0.3], [1.7, -0.4], [0.6, 2.2], [-1.1, 1.3]], "float32")]
    exact = inputs[0] @ WEIGHT
    assert np.abs(relay_amp.run(offset, inputs)[0] - exact).max() <= 3.0 / 63 * np.abs(WEIGHT).sum(axis=0).max()


@pytest.mark.parametrize("mcpu, bits", [("znver3", 7), ("haswell", 7), ("alderlake", 8), ("skylake-avx512", 8),
                                        ("znver4", 8)])
def test_automatic_activation_bits_are_7_for_unsigned_codes_on_avx2_without_vnni_or_avx512(monkeypatch, mcpu, bits):
    """Signed inputs (codes with a zero point) keep 8 bits on every target."""
    monkeypatch.setattr(realize, "seven_bit_codes", targets.seven_bit_codes)  # the host's rule, not conftest's pin
    data = [np.random.default_rng(0).normal(size=(4, 2)).astype("float32")]
    with tvm.target.Target({"kind": "llvm", "mcpu": mcpu}):
        unsigned = relay_amp.quantize(linear_module(), [np.abs(data[0])], fallback_dtype="float32")
        signed = relay_amp.quantize(linear_module(), data, fallback_dtype="float32")
    assert relay_amp.quant_plan(unsigned).entries[0].bits == bits
    [entry] = relay_amp.quant_plan(signed).entries
    assert entry.bits == 8 and entry.zero_point > 0
    assert relay_amp.quant_plan(relay_amp.quantize(linear_module(), data, activation_bits=8)).entries[0].bits == 8


def test_automatic_7_bit_codes_need_an_input_whose_values_fill_them(monkeypatch):
    """An unsigned input whose RMS is under a tenth of its threshold (a few outliers over small values) keeps 8-bit
    codes: 7 would round most of its values to a few codes."""
    monkeypatch.setattr(realize, "seven_bit_codes", lambda target=None: True)
    spread = [np.linspace(0.0, 2.0, 8, dtype="float32").reshape(4, 2)]
    outlier = [np.full((4, 2), 0.01, "float32") for _ in range(50)]
    outlier[0][0, 0] = 2.0
    for data, bits in ((spread, 7), (outlier, 8)):
        histogram = Histogram()
        for batch in data:
            histogram.add(batch)
        assert histogram.rms == pytest.approx(np.sqrt((np.stack(data) ** 2).mean()), rel=1e-3)
        assert (histogram.rms >= realize.SEVEN_BIT_RMS * 2.0) == (bits == 7)
        quantized = relay_amp.quantize(linear_module(), data, fallback_dtype="float32")
        assert relay_amp.quant_plan(quantized).entries[0].bits == bits
        assert relay_amp.quant_plan(relay_amp.quantize(linear_module(), data, activation_bits=7)).entries[0].bits == 7


def test_quantize_weight_per_channel_and_per_tensor():
    codes, scales = quantize_weight(WEIGHT, 1)
    np.testing.assert_allclose(scales, [0.5 / 127, 1 / 127, 0.25 / 127])
    np.testing.assert_array_equal(codes, [[127, -127, 127], [-64, 64, 64]])
    codes, scales = quantize_weight(WEIGHT, None)
    np.testing.assert_allclose(scales, [1 / 127])
    np.testing.assert_array_equal(codes, np.rint(WEIGHT * 127))


@pytest.mark.parametrize("bits", [8, 7])
def test_dynamic_matmuls_scale_each_row_at_run_time_and_keep_the_encoder_close_to_fp32(bits):
    """8-bit per-row codes are int8; 7-bit ones (AVX2's byte products) uint8 around zero point 64."""
    mod = models.bert_encoder(batch=1, seq_len=16, hidden=64, heads=2, layers=2)
    calib = [example_inputs(mod, seed) for seed in (1, 2)]
    quantized = relay_amp.quantize(mod, calib, dynamic_matmuls=True, fallback_dtype="float32", activation_bits=bits)
    plan = relay_amp.quant_plan(quantized)
    dynamic = [e for e in plan.entries if e.dtype == "dynamic int8"]
    assert dynamic and all(e.op == "relax.matmul" and e.bits == bits for e in dynamic)
    codes = {tensor_dtype(b.value.args[0]) for b in quantized["main"].body.blocks[0].bindings
             if call_op_name(b.value) == "relax.matmul" and "int32" in str(b.value.attrs.out_dtype)}
    assert codes == {"int8" if bits == 8 else "uint8"}
    assert any(e.dtype == "fallback" and "second operand" in e.reason for e in plan.entries)  # attention
    inputs = example_inputs(mod, 7)
    expected, actual = relay_amp.run(mod, inputs)[0], relay_amp.run(quantized, inputs)[0]
    assert metrics.cosine_similarity(actual, expected) >= 0.99


@pytest.mark.parametrize("bits", [8, 7])
def test_the_digits_cnn_keeps_its_accuracy_in_int8(bits):
    """The shipped CNN, calibrated on 100 held-out images, within 0.5 points of fp32 on the other 350, with 8-bit
    activation codes and with AVX2's 7-bit ones."""
    images, labels = digits.load_test_split()
    batches = digits.batches(images, labels, 50)
    mod = digits.load_model(50)
    quantized = relay_amp.quantize(mod, [x for x, _ in batches[:2]], observer="percentile", activation_bits=bits)
    assert sum(e.quantized for e in relay_amp.quant_plan(quantized).entries) == 4
    fp32, int8 = relay_amp.runtime.compile_module(mod), relay_amp.runtime.compile_module(quantized)
    held_out = batches[2:]
    reference = np.concatenate([relay_amp.runtime.run_executable(fp32, [x])[0] for x, _ in held_out])
    outputs = np.concatenate([relay_amp.runtime.run_executable(int8, [x])[0] for x, _ in held_out])
    truth = np.concatenate([y for _, y in held_out])
    assert metrics.top1_accuracy(outputs, truth) >= metrics.top1_accuracy(reference, truth) - 0.005
    relax.analysis.well_formed(quantized)


def two_linears(first: np.ndarray, second: np.ndarray) -> tvm.IRModule:
    """main(x) = (x @ first) @ second."""
    bb = relax.BlockBuilder()
    x = tensor("x", (16, first.shape[0]))
    with bb.function("main", [x]):
        with bb.dataflow():
            hidden = bb.emit(relax.op.matmul(x, relax.const(first)))
            out = bb.emit_output(relax.op.matmul(hidden, relax.const(second)))
        bb.emit_func_output(out)
    return bb.get()


def test_codes_of_an_input_in_the_bf16_fallback_are_computed_in_fp32():
    """The first matmul stays in the fallback (AMP runs it in bf16); the uint8 codes of its output for the second
    must be floor(x / s + z + 0.5) in fp32. In bf16 the constant z + 0.5 = 200.5 would round to 200 (bf16 steps
    by 1 from 128 to 256), so half the codes would come out one lower, and 1 / s would lose its low bits."""
    rng = np.random.default_rng(5)
    first, second = (rng.integers(-3, 4, shape).astype("float32") for shape in ((8, 8), (8, 4)))
    mod = two_linears(first, second)
    layers = relay_amp.list_layers(mod, ["matmul"])
    step, zero_point = 0.3, 200
    plan = QuantPlan(["relax.matmul"], "minmax", "per_channel", "bfloat16", entries=[
        QuantEntry(0, layers[0].op, layers[0].name, "fallback", 0.0, "excluded"),
        QuantEntry(1, layers[1].op, layers[1].name, "uint8", (255 - zero_point) * step, "test", zero_point)])
    quantized = relay_amp.apply_quant_plan(mod, plan)
    calls = [b.value for b in relay_amp.passes.layers.op_bindings(quantized)]
    assert {str(c.ty.dtype) for c in calls if call_op_name(c) == "relax.floor"} == {"float32"}
    assert any(call_op_name(c) == "relax.matmul" and str(c.args[0].ty.dtype) == "bfloat16" for c in calls)
    x = rng.integers(-3, 4, (16, 8)).astype("float32")
    hidden = x @ first  # small integers: exact in bf16 too
    codes = np.clip(np.floor(hidden / np.float32(step) + zero_point + 0.5), 0, 255)
    weight_codes, scales = quantize_weight(second, 1)
    expected = ((codes - zero_point) @ weight_codes.astype("float64")) * scales * step
    np.testing.assert_allclose(relay_amp.run(quantized, [x])[0], expected, rtol=1e-5, atol=1e-4)


def test_fallback_dtype_runs_the_rest_through_amp():
    mod = models.small_cnn(batch=2)
    calib = [example_inputs(mod, 1)]
    plan = relay_amp.quant_plan(relay_amp.quantize(mod, calib, excluded_layers=[-1]))
    assert plan.entries[-1].dtype == "fallback" and plan.entries[-1].reason == "excluded"
    converted = relay_amp.quantize(mod, calib, excluded_layers=[-1])
    amp_plan = relay_amp.precision_plan(converted)
    assert any(e.op == "relax.matmul" and e.dtype == "bfloat16" for e in amp_plan.entries)
    inputs = example_inputs(mod, 3)
    np.testing.assert_allclose(relay_amp.run(converted, inputs)[0], relay_amp.run(mod, inputs)[0],
                               rtol=0.1, atol=0.1 * float(np.abs(relay_amp.run(mod, inputs)[0]).max()))


@pytest.mark.parametrize("target, in_int8", [({"kind": "llvm", "mcpu": "haswell", "num-cores": 2}, False),
                                             ({"kind": "llvm", "mcpu": "znver4", "num-cores": 2}, True)],
                         ids=["avx2", "zen4"])
def test_an_expert_layers_product_by_every_expert_is_int8_only_where_the_expert_kernel_takes_it(target, in_int8):
    """With AVX-512 VNNI (Zen 4) the CPU backend's expert kernel computes an int8 product by every expert only for
    each routed row's own expert, on vpdpbusd: quantize makes it int8. Elsewhere (AVX2) int8 would compute every
    expert's products, and in the fallback (bf16) the kernel computes only the routed rows': it stays there. Either
    way the build runs the expert kernel, and the linear layer before it is quantized."""
    rng = np.random.default_rng(1)
    calib = [[rng.standard_normal((6, 8)).astype("float32"), rng.integers(0, 24, 9).astype("int64")]]
    with tvm.target.Target(target):
        quantized = relay_amp.quantize(expert_layer(), calib)
    first, routed = relay_amp.quant_plan(quantized).entries
    assert first.dtype != "fallback"
    assert routed.quantized if in_int8 else (routed.dtype, routed.reason) == ("fallback", realize.ROUTED_ROWS)
    assert "expert_matmul" in build(quantized, tvm.target.Target(target)).as_text()


def test_a_saved_plan_edited_by_hand_reapplies_without_calibration(tmp_path):
    mod = models.small_cnn(batch=2)
    quantized = relay_amp.quantize(mod, [example_inputs(mod, 1)])
    path = tmp_path / "quant.json"
    relay_amp.quant_plan(quantized).save(path)
    plan = QuantPlan.load(path)
    tvm.ir.assert_structural_equal(relay_amp.apply_quant_plan(mod, plan), quantized)
    first = plan.entries[0]
    plan.entries[0] = QuantEntry(first.index, first.op, first.name, "fallback", 0.0, "by hand")
    edited = relay_amp.apply_quant_plan(mod, plan)
    assert relay_amp.quant_plan(edited).entries[0].dtype == "fallback"
    assert edited["main"].script().count('out_dtype="int32"') == len(plan.entries) - 1


def test_a_plan_saved_before_quantized_residuals_loads_with_float_residuals_and_no_bias_correction(tmp_path):
    path = tmp_path / "old.json"
    text = linear_plan("uint8", 1.0).to_json()
    data = json.loads(text)
    data.pop("quantized_residuals")
    data["entries"][0].pop("bits")  # and before 7-bit codes
    data["entries"][0].pop("input_means")  # and before bias correction
    path.write_text(json.dumps(data))
    assert not QuantPlan.load(path).quantized_residuals and QuantPlan.load(path).entries[0].bits == 8
    assert QuantPlan.load(path).entries[0].input_means == ()


def test_plan_errors_name_the_file_or_layer(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ModelLoadError, match="broken.json"):
        QuantPlan.load(path)
    other = linear_plan("uint8", 1.0)
    with pytest.raises(relay_amp.LayerIndexError, match="does not match"):
        relay_amp.apply_quant_plan(models.small_cnn(), other)
    runtime_weight = relay_amp.list_layers(models.bert_encoder(seq_len=16, hidden=64, heads=2, layers=1))
    attention = next(layer for layer in runtime_weight if layer.op == "relax.matmul" and layer.index > 3)
    bad = QuantPlan(["relax.nn.conv2d", "relax.matmul"], "minmax", "per_channel", "float32", entries=[
        QuantEntry(attention.index, attention.op, attention.name, "int8", 1.0, "by hand")])
    with pytest.raises(OptionError, match=f"layer {attention.index}.*cannot be int8"):
        relay_amp.apply_quant_plan(models.bert_encoder(seq_len=16, hidden=64, heads=2, layers=1), bad)
    with pytest.raises(relay_amp.ModuleError, match="no quantization plan"):
        relay_amp.quant_plan(linear_module())
    layer = relay_amp.list_layers(linear_module(), ["matmul"])[0]
    nine_bits = QuantPlan(["relax.matmul"], "minmax", "per_channel", "float32",
                          entries=[QuantEntry(0, layer.op, layer.name, "uint8", 1.0, "by hand", bits=9)])
    with pytest.raises(OptionError, match="layer 0 .*activation codes of 9 bits"):
        relay_amp.apply_quant_plan(linear_module(), nine_bits)


@pytest.mark.parametrize("dataset, options, match", [
    ([], {}, "dataset is empty"),
    ([np.full((4, 2), np.nan, "float32")], {}, "batch 0: the input of layer 0 .* NaN"),
    ([np.zeros((3, 2), "float32")], {}, r"must be \(4, 2\) float32"),
    ([np.zeros((4, 2), "float32")], {"ops": ["nn.softmax"]}, "cannot quantize relax.nn.softmax"),
    ([np.zeros((4, 2), "float32")], {"observer": "kl"}, "observer must be one of"),
    ([np.zeros((4, 2), "float32")], {"percentile": 0}, "percentile"),
    ([np.zeros((4, 2), "float32")], {"weight_granularity": "per_row"}, "weight_granularity"),
    ([np.zeros((4, 2), "float32")], {"activation_bits": 6}, "activation_bits must be"),
    ([np.zeros((4, 2), "float32")], {"activation_bits": True}, "activation_bits must be"),
    ([np.zeros((4, 2), "float32")], {"excluded_layers": [3]}, "out of range"),
])
def test_bad_input_is_a_relay_amp_error_that_names_it(dataset, options, match):
    with pytest.raises(relay_amp.RelayAmpError, match=match):
        relay_amp.quantize(linear_module(), dataset, **options)


def test_histogram_widening_keeps_every_count_and_the_top():
    histogram = Histogram()
    histogram.add(np.linspace(0, 1, 1000))
    histogram.add(np.linspace(-4, 0, 1000))
    assert histogram.counts.sum() == 1998 and histogram.zeros == 2  # each linspace's 0.0 counted apart
    assert histogram.top == 4.0 and histogram.signed
    assert threshold(histogram, "minmax", 127) == 4.0


@pytest.mark.parametrize("observer", ["entropy", "mse"])
def test_a_relus_spike_of_zeros_does_not_pull_the_threshold_down(observer):
    """Half the values exactly zero, as after a ReLU: the observers pick what they pick for the positive values
    alone (in the first bin with the zeros, entropy kept an eighth of the range, the least it can)."""
    positives = np.abs(np.random.default_rng(1).normal(size=50_000))
    relu, alone = Histogram(), Histogram()
    relu.add(np.concatenate([positives, np.zeros(50_000)]))
    alone.add(positives)
    assert relu.zeros == 50_000 and not relu.signed
    assert threshold(relu, observer, 255) == threshold(alone, observer, 255) > 0.25 * relu.top
    assert threshold(relu, "percentile", 255, 50.0) < threshold(alone, "percentile", 255, 50.0)  # zeros count there


def test_observers_clip_outliers_that_minmax_keeps():
    rng = np.random.default_rng(0)
    histogram = Histogram()
    histogram.add(np.concatenate([rng.normal(size=100_000), [40.0]]))
    percentile = threshold(histogram, "percentile", 127, 99.9)
    assert 3.0 < percentile < 3.6  # the 99.9th percentile of |N(0, 1)| is 3.29
    for observer in ("entropy", "mse"):
        clipped = threshold(histogram, observer, 127)
        assert 2.0 < clipped < 0.9 * threshold(histogram, "minmax", 127), observer  # below the outlier
    assert threshold(Histogram(), "entropy", 127) == 0.0
    assert BINS % 16 == 0


def test_quantize_never_mutates_its_input_and_its_output_is_well_formed():
    mod = models.small_cnn(batch=2)
    text = mod.script()
    quantized = relay_amp.transform.Quantize([example_inputs(mod, 1)])(mod)
    assert mod.script() == text
    relax.analysis.well_formed(quantized)


@pytest.mark.parametrize("low, high, position", [(-1.0, 1.0, 127.5), (-0.5, 2.0, 51.0), (-2.0, 0.5, 204.0)])
def test_zero_point_position_is_where_zero_falls_among_the_uint8_codes(low, high, position):
    """Codes 0..255 span [low, high]: 0.0 sits -low / (high - low) of the way up (quantize and realize_qdq read it)."""
    assert zero_point_position(low, high) == pytest.approx(position)
