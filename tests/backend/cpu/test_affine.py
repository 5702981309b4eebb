"""affine: runs of scales, biases and clamps folded into one multiply-add and a clamp moved after it (and a floor)."""

import math

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp.backend.cpu import kernels
from relay_amp.backend.cpu.affine import FLOOR, BatchNormsAsAffine, FoldAffineClamps, folded, truncated
from relay_amp.runtime import run_executable

from builders import tensor, torchvision_through_onnx
from pass_checks import assert_transforms, prepared_function_names

RNG = np.random.default_rng(0)
CHANNELS = 8
SILU = ("divide", ("x",), ("add", ("exp", ("negative", ("x",))), ("const", 1.0)))


def scale(values) -> tuple:
    return kernels.Step(kernels.SCALE), np.broadcast_to(values, CHANNELS).astype("float32")


def bias(values) -> tuple:
    return kernels.Step(kernels.BIAS), np.broadcast_to(values, CHANNELS).astype("float32")


def clip(low: float = -math.inf, high: float = math.inf) -> tuple:
    return kernels.Step(kernels.CLIP, low, high), None


def mapped(formula: tuple) -> tuple:
    return kernels.Step(kernels.MAP, formula=formula), None


def codes() -> list[tuple]:
    """A quantize's rounding and clamp to uint8 codes, as the Relax graph has them."""
    return [mapped(FLOOR), clip(0.0), clip(high=255.0)]


def residual() -> tuple:
    return kernels.Step(kernels.RESIDUAL), relax.Var("r", relax.TensorType((1, CHANNELS), "float32"))


def fold(*pairs) -> tuple[list, list]:
    return folded([step for step, _ in pairs], [operand for _, operand in pairs if operand is not None])


def kinds(steps: list) -> list[str]:
    return [step.kind for step in steps]


def evaluate(formula: tuple, x: np.ndarray) -> np.ndarray:
    kind, *operands = formula
    if kind == "x":
        return x
    if kind == "const":
        return np.float64(operands[0])
    values = [evaluate(operand, x) for operand in operands]
    functions = {"floor": np.floor, "maximum": np.maximum, "minimum": np.minimum, "negative": np.negative,
                 "exp": np.exp, "add": np.add, "divide": np.divide}
    return functions[kind](*values)


def run(steps: list, operands: list, x: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The epilogue's value for accumulators `x` (rows of CHANNELS), in float64."""
    taken = iter(operands)
    for step in steps:
        if step.kind == kernels.CLIP:
            x = np.minimum(np.maximum(x, step.low), step.high)
        elif step.kind == kernels.MAP:
            x = evaluate(step.formula, x)
        else:
            operand = next(taken)
            value = r if step.kind == kernels.RESIDUAL else np.asarray(operand, "float64")
            x = x * value if step.kind == kernels.SCALE else x + value
    return x


def test_a_requantize_after_relu6_becomes_one_multiply_add_floor_and_the_codes_clamp():
    weight_scales, layer_bias = RNG.uniform(0.01, 0.1, CHANNELS), RNG.normal(size=CHANNELS)
    steps, operands = fold(scale(weight_scales), bias(layer_bias), clip(0.0), clip(high=6.0), scale(42.5),
                           bias(0.5), *codes())
    assert kinds(steps) == [kernels.SCALE, kernels.BIAS, kernels.MAP, kernels.CLIP] and steps[2].formula == FLOOR
    assert (steps[3].low, steps[3].high) == (0.0, 255.0)
    np.testing.assert_allclose(operands[0], weight_scales * 42.5, rtol=1e-6)
    np.testing.assert_allclose(operands[1], layer_bias * 42.5 + 0.5, rtol=1e-6)


def test_a_residual_and_an_activation_other_than_floor_end_a_run():
    steps, _ = fold(scale(2.0), bias(1.0), residual(), clip(0.0), scale(0.25), bias(0.5), *codes())
    assert kinds(steps) == [kernels.SCALE, kernels.BIAS, kernels.RESIDUAL, kernels.SCALE, kernels.BIAS, kernels.MAP,
                            kernels.CLIP]
    steps, _ = fold(bias(1.0), clip(0.0, 6.0), mapped(SILU))
    assert kinds(steps) == [kernels.BIAS, kernels.CLIP, kernels.MAP]


@pytest.mark.parametrize("after_clamp", [scale(RNG.uniform(0.5, 2.0, CHANNELS)), scale(-2.0),
                                         bias(RNG.normal(size=CHANNELS))])
def test_a_clamp_stays_before_a_per_channel_or_negative_constant(after_clamp):
    steps, _ = fold(bias(1.0), clip(0.0), after_clamp)
    assert kinds(steps) == [kernels.BIAS, kernels.CLIP, after_clamp[0].kind]


def test_a_clamp_moves_after_a_floor_as_its_floored_bounds():
    steps, _ = fold(clip(0.5, 6.5), mapped(FLOOR))
    assert kinds(steps) == [kernels.MAP, kernels.CLIP] and (steps[1].low, steps[1].high) == (0.0, 6.0)


def test_a_floor_clamped_to_whole_unsigned_bounds_is_left_to_the_casts_truncation():
    assert kinds(truncated([mapped(FLOOR)[0], clip(0.0, 255.0)[0]])) == [kernels.CLIP]
    steps, _ = fold(scale(2.0), bias(0.5), *codes())
    assert kinds(truncated(steps)) == [kernels.SCALE, kernels.BIAS, kernels.CLIP]


@pytest.mark.parametrize("ending", [[mapped(FLOOR), clip(-128.0, 127.0)], [mapped(FLOOR), clip(0.0, 6.5)],
                                    [mapped(FLOOR), clip(0.0)], [mapped(FLOOR)], [clip(0.0, 255.0)],
                                    [mapped(FLOOR), clip(0.0, 255.0), scale(2.0)]])
def test_a_floor_stays_where_truncation_would_round_another_way_or_there_is_none(ending):
    """Negative codes (int8) truncate towards zero, a bound between integers or none lets values between integers
    through, and a step after the clamp computes on the floored values."""
    steps = [step for step, _ in ending]
    assert truncated(steps) == steps


CHAINS = {
    "relu6 requantize": [scale(RNG.uniform(0.01, 0.1, CHANNELS)), bias(RNG.normal(size=CHANNELS)), clip(0.0),
                         clip(high=6.0), scale(42.5), bias(0.5), *codes()],
    "residual relu requantize": [scale(0.5), bias(RNG.normal(size=CHANNELS)), residual(), clip(0.0), scale(20.0),
                                 bias(0.5), *codes()],
    "clamps and scales": [clip(-1.0, 3.0), scale(3.0), bias(-2.0), clip(0.0), scale(RNG.uniform(0.5, 2, CHANNELS)),
                          clip(high=4.0), mapped(FLOOR), bias(0.5)],
    "disjoint clamps": [clip(0.0, 1.0), clip(2.0, 3.0), scale(2.0)],
    "activation": [bias(RNG.normal(size=CHANNELS)), clip(-3.0, 3.0), mapped(SILU), scale(2.0), clip(high=1.0)],
}


@pytest.mark.parametrize("name", CHAINS)
def test_a_folded_epilogue_computes_what_the_steps_did(name):
    steps, operands = fold(*CHAINS[name])
    original_steps = [step for step, _ in CHAINS[name]]
    original_operands = [operand for _, operand in CHAINS[name] if operand is not None]
    x, r = RNG.normal(scale=30.0, size=(1000, CHANNELS)), RNG.normal(size=(1000, CHANNELS))
    np.testing.assert_allclose(run(steps, operands, x, r), run(original_steps, original_operands, x, r),
                               rtol=1e-5, atol=1e-5)
    assert len(steps) <= len(original_steps)


NHWC = (1, 3, 3, CHANNELS)
WEIGHT_SCALES = RNG.uniform(0.01, 0.1, CHANNELS).astype("float32")
LAYER_BIAS = RNG.normal(size=(1, 1, 1, CHANNELS)).astype("float32")


def _requantize_after_relu6(x: relax.Expr, bb: relax.BlockBuilder, codes: str = "uint8", low: float = 0.0,
                            high: float = 255.0, round_trip: tuple[str, ...] = ()) -> relax.Expr:
    """A dequantize, the layer's bias and ReLU6, casts to each of `round_trip`'s dtypes, then the next layer's
    `codes` (uint8), one binding each."""
    ops = [lambda v: relax.op.multiply(v, relax.const(WEIGHT_SCALES)),
           lambda v: relax.op.add(v, relax.const(LAYER_BIAS)),
           lambda v: relax.op.maximum(v, relax.const(0.0)), lambda v: relax.op.minimum(v, relax.const(6.0)),
           *[lambda v, dtype=dtype: relax.op.astype(v, dtype) for dtype in round_trip],
           lambda v: relax.op.multiply(v, relax.const(42.5)), lambda v: relax.op.add(v, relax.const(0.5)),
           relax.op.floor,
           lambda v: relax.op.maximum(v, relax.const(low)), lambda v: relax.op.minimum(v, relax.const(high))]
    for op in ops:
        x = bb.emit(op(x))
    return relax.op.astype(x, codes)


def _module(body, shape: tuple = NHWC) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = tensor("x", shape)
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(x, bb))
        bb.emit_func_output(out)
    return bb.get()


def _folded_requantize(x: relax.Expr, bb: relax.BlockBuilder, floor: bool = False, codes: str = "uint8",
                       low: float = 0.0, high: float = 255.0) -> relax.Expr:
    scale = (WEIGHT_SCALES.astype("float64") * 42.5).astype("float32").reshape(1, 1, 1, -1)
    bias = (LAYER_BIAS.astype("float64") * 42.5 + 0.5).astype("float32")
    x = bb.emit(relax.op.add(bb.emit(relax.op.multiply(x, relax.const(scale))), relax.const(bias)))
    x = bb.emit(relax.op.floor(x)) if floor else x
    x = bb.emit(relax.op.minimum(bb.emit(relax.op.maximum(x, relax.const(low))), relax.const(high)))
    return relax.op.astype(x, codes)


def test_fold_affine_clamps_makes_a_requantize_after_relu6_one_multiply_add_and_clamp_whose_cast_floors():
    assert_transforms(FoldAffineClamps(), _module(_requantize_after_relu6), _module(_folded_requantize))


def test_a_requantize_to_floats_keeps_its_floor():
    before = _module(lambda x, bb: _requantize_after_relu6(x, bb, codes="float32"))
    expected = _module(lambda x, bb: _folded_requantize(x, bb, floor=True, codes="float32"))
    assert_transforms(FoldAffineClamps(), before, expected)


def test_a_requantize_to_signed_codes_keeps_its_floor():
    """Without a ReLU before it the clamp's lower bound is negative, where truncation rounds up."""
    def signed_codes(x, bb):
        return _folded_requantize(bb.emit(relax.op.divide(x, relax.const(42.5))), bb, floor=True, codes="int8",
                                  low=-128.0, high=127.0)
    assert_transforms(FoldAffineClamps(), _module(signed_codes), _module(signed_codes))


def test_folded_codes_match_the_unfolded_ones_on_the_vm():
    data = [RNG.normal(scale=40.0, size=NHWC).astype("float32")]
    before = _module(_requantize_after_relu6)
    expected = relay_amp.run(before, data)[0].astype("int32")
    actual = relay_amp.run(FoldAffineClamps()(before), data)[0].astype("int32")
    assert np.abs(actual - expected).max() <= 1 and (actual == expected).mean() > 0.95
    assert len(np.unique(expected)) > 3


def test_the_casts_truncation_gives_the_floors_codes_exactly_on_the_vm():
    """Values on and between integers, and past both bounds: the floor's codes, not one off."""
    grid = np.arange(-40.0, 300.0, 0.25, dtype="float32")
    with_floor = _module(lambda x, bb: _folded_requantize(x, bb, floor=True))
    for values in (grid[:72], grid[500:572], grid[-72:]):
        values = values.reshape(NHWC)
        np.testing.assert_array_equal(relay_amp.run(_module(_folded_requantize), [values])[0],
                                      relay_amp.run(with_floor, [values])[0])


@pytest.mark.parametrize("narrow", ["bfloat16", "float16"])
def test_a_run_goes_on_through_a_round_trip_to_a_16_bit_float_which_it_drops(narrow):
    """AMP's fallback ops between two int8 layers (a depthwise conv's bias and ReLU6) end in a cast to bf16 and back
    before the next layer's codes."""
    before = _module(lambda x, bb: _requantize_after_relu6(x, bb, round_trip=(narrow, "float32")))
    assert_transforms(FoldAffineClamps(), before, _module(_folded_requantize))


def test_the_codes_without_the_round_trips_rounding_are_the_float32_codes_on_the_vm():
    data = [RNG.normal(scale=40.0, size=NHWC).astype("float32")]
    before = _module(lambda x, bb: _requantize_after_relu6(x, bb, round_trip=("bfloat16", "float32")))
    expected = relay_amp.run(_module(_requantize_after_relu6), data)[0].astype("int32")
    actual = relay_amp.run(FoldAffineClamps()(before), data)[0].astype("int32")
    assert np.abs(actual - expected).max() <= 1 and (actual == expected).mean() > 0.95
    rounded = relay_amp.run(before, data)[0].astype("int32")
    assert (rounded != expected).sum() > (actual != expected).sum()  # bf16's rounding moved codes; the fold's did not


@pytest.mark.parametrize("outputs", ["narrow", "wide"])
def test_a_round_trip_read_elsewhere_ends_the_run(outputs):
    def scaled_twice(x, bb):
        narrow = bb.emit(relax.op.astype(bb.emit(relax.op.multiply(x, relax.const(WEIGHT_SCALES))), "bfloat16"))
        wide = bb.emit(relax.op.astype(narrow, "float32"))
        return relax.Tuple([relax.op.multiply(wide, relax.const(42.5)), narrow if outputs == "narrow" else wide])

    before = _module(scaled_twice)
    assert_transforms(FoldAffineClamps(), before, before)


def test_runs_that_would_not_shrink_or_whose_value_is_read_twice_are_left_alone():
    def relu_then_residual(x, bb):
        biased = bb.emit(relax.op.add(x, relax.const(LAYER_BIAS)))
        scaled = bb.emit(relax.op.multiply(biased, relax.const(0.5)))
        return relax.op.add(bb.emit(relax.op.nn.relu(scaled)), biased)  # biased is read twice: a run ends there

    before = _module(relu_then_residual)
    assert_transforms(FoldAffineClamps(), before, before)
    channel_after_clamp = _module(lambda x, bb: relax.op.multiply(
        bb.emit(relax.op.maximum(x, relax.const(0.0))), relax.const(WEIGHT_SCALES)))
    assert_transforms(FoldAffineClamps(), channel_after_clamp, channel_after_clamp)


STATISTICS = [RNG.uniform(0.5, 2.0, CHANNELS), RNG.normal(size=CHANNELS), RNG.normal(size=CHANNELS),
              RNG.uniform(0.5, 2.0, CHANNELS)]  # gamma, beta, mean, var


def _normed(x: relax.Expr, bb: relax.BlockBuilder, axis: int = 3, training: bool = False) -> relax.Expr:
    stats = [relax.const(v.astype("float32")) for v in STATISTICS]
    norm = bb.emit(relax.op.nn.batch_norm(x, *stats, axis=axis, epsilon=1e-5, training=training))
    return relax.op.nn.relu(bb.emit(relax.TupleGetItem(norm, 0)))


def _scaled_and_shifted(x: relax.Expr, bb: relax.BlockBuilder) -> relax.Expr:
    gamma, beta, mean, var = (v.astype("float32").astype("float64") for v in STATISTICS)  # as the constants hold
    scale = (gamma / np.sqrt(var + 1e-5)).astype("float32")
    shift = (beta - mean * gamma / np.sqrt(var + 1e-5)).astype("float32")
    scaled = bb.emit(relax.op.multiply(x, relax.const(scale.reshape(1, 1, 1, -1))))
    return relax.op.nn.relu(bb.emit(relax.op.add(scaled, relax.const(shift.reshape(1, 1, 1, -1)))))


def test_an_inference_batch_norm_no_conv_took_becomes_a_per_channel_multiply_add():
    assert_transforms(BatchNormsAsAffine(), _module(_normed), _module(_scaled_and_shifted))


@pytest.mark.parametrize("training", [True, False])
def test_a_training_batch_norm_or_one_of_runtime_statistics_stays(training):
    def runtime_mean(x, bb):  # the mean from the data: not a constant
        stats = [relax.const(v.astype("float32")) for v in STATISTICS]
        stats[2] = bb.emit(relax.op.mean(x, axis=[0, 1, 2]))
        norm = bb.emit(relax.op.nn.batch_norm(x, *stats, axis=3, epsilon=1e-5, training=False))
        return relax.TupleGetItem(norm, 0)
    before = _module(lambda x, bb: _normed(x, bb, training=True) if training else runtime_mean(x, bb))
    assert_transforms(BatchNormsAsAffine(), before, before)


def test_the_multiply_add_normalizes_as_the_batch_norm_did_on_the_vm():
    """Over the channels axis of NCHW too (axis 1); within 1e-6 of the divided form's largest value."""
    data = [RNG.normal(scale=3.0, size=(1, CHANNELS, 4, 4)).astype("float32")]
    before = _module(lambda x, bb: _normed(x, bb, axis=1), shape=(1, CHANNELS, 4, 4))
    expected = relay_amp.run(before, data)[0]
    actual = relay_amp.run(BatchNormsAsAffine()(before), data)[0]
    assert np.abs(actual - expected).max() <= 1e-6 * np.abs(expected).max()


def test_torchvisions_densenet_normalizes_after_its_concats_by_multiply_adds_and_matches_pytorch():
    """A model nobody here wrote (a small DenseNet, random weights): each batch norm after a concat of earlier
    features folds into no conv; the build has none left and stays within 1e-5 of PyTorch's largest output."""
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, num_classes=10)
    mod, x, expected = torchvision_through_onnx(model, 32)
    assert not [name for name in prepared_function_names(mod) if "batch_norm" in name]
    got = run_executable(relay_amp.build(mod, relay_amp.targets.host_preset()), [x])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
