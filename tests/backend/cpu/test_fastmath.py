"""fastmath: GELU and friends become TVM's fast approximations, within 1e-6 of the exact functions."""

import math

import ml_dtypes
import numpy as np
import pytest
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_amp import models
from relay_amp.backend.cpu import fastmath
from relay_amp.compile.build import build
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor
from pass_checks import assert_transforms

TOLERANCE = 2e-6  # relative to the output's largest magnitude


def _gelu_module(dtype: str = "float32"):
    return single_output_module(relax.op.nn.gelu, tensor("x", (4, 64), dtype))


def test_gelu_becomes_a_fast_erf_primfunc():
    before = _gelu_module()
    text = before.script()
    after = fastmath.FastMath()(before)
    relax.analysis.well_formed(after)
    assert before.script() == text, "the pass mutated its input module"
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert ops == ["relax.call_tir"]
    assert "fast_gelu" in [gv.name_hint for gv in after.get_global_vars()]


def test_integer_ops_are_left_alone():
    mod = single_output_module(lambda x: relax.op.add(x, x), tensor("x", (4, 64), "int32"))
    assert_transforms(fastmath.FastMath(), mod, mod)


def test_bf16_gelu_goes_through_fp32_and_matches():
    x = np.linspace(-6, 6, 256, dtype="float32").reshape(4, 64)
    got = run_executable(build(_gelu_module("bfloat16"), "cpu"), [x.astype("bfloat16")])[0].astype("float32")
    exact = run_executable(build(_gelu_module("bfloat16"), "cpu", fast_math=False), [x.astype("bfloat16")])[0]
    assert np.abs(got - exact.astype("float32")).max() <= 8e-3 * np.abs(got).max()  # one bf16 rounding step


def test_fast_gelu_matches_the_exact_formula():
    x = np.linspace(-6, 6, 256, dtype="float32").reshape(4, 64)
    got = run_executable(build(_gelu_module(), "cpu"), [x])[0]
    expected = np.array([[v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in row] for row in x.astype("float64")])
    assert np.abs(got - expected).max() <= TOLERANCE * np.abs(expected).max()


@pytest.mark.parametrize("name", ["bert", "small_cnn"])
def test_fast_math_build_matches_the_exact_build(name):
    mod = models.get_model(name, **({"seq_len": 16, "layers": 1} if name == "bert" else {}))
    inputs = models.example_inputs(mod)
    fast = run_executable(build(mod, "cpu"), inputs)[0]
    exact = run_executable(build(mod, "cpu", fast_math=False), inputs)[0]
    assert np.abs(fast - exact).max() <= TOLERANCE * np.abs(exact).max()


def test_fast_log_is_within_an_ulp_of_log_and_keeps_libms_special_values():
    """log called libm's scalar logf for every element: 1.5 ms over 64x112x112 on the Zen 4 host, 0.26 after."""
    rng = np.random.default_rng(0)
    normal = np.exp(rng.uniform(-87, 88, 4000)).astype("float32")
    near_one = (1 + np.arange(-1000, 1000) * 1e-7).astype("float32")
    subnormal = np.array([1e-40, 1e-45, 3e-39], "float32")
    special = np.array([0.0, -0.0, -1.0, np.inf, -np.inf, np.nan, 1.0, 2.0], "float32")
    x = np.concatenate([normal, near_one, subnormal, special])
    got = run_executable(build(single_output_module(relax.op.log, tensor("x", x.shape)), "cpu"), [x])[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.log(x.astype("float64"))
    finite = np.isfinite(expected)
    ulps = np.abs(got[finite] - expected[finite]) / np.spacing(np.abs(expected[finite]).astype("float32"))
    assert ulps.max() <= 1.0
    np.testing.assert_array_equal(got[~finite], expected[~finite])  # -inf at zeros, inf, NaN elsewhere


@pytest.mark.parametrize("op, exact", [(relax.op.sin, np.sin), (relax.op.cos, np.cos)])
def test_fast_sin_and_cos_are_within_an_fp32_ulp_of_one_and_give_nan_where_libm_does(op, exact):
    """sin and cos called libm per element: 3.6 ms over 64x112x112 on the Zen 4 host, 0.17-0.19 after."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-10, 10, 4000), rng.uniform(-5e4, 5e4, 4000), np.linspace(-np.pi, np.pi, 1001),
                        rng.uniform(-1e-3, 1e-3, 200)]).astype("float32")
    special = np.array([np.inf, -np.inf, np.nan, 1e30], "float32")
    got = run_executable(build(single_output_module(op, tensor("x", (x.size + 4,))), "cpu"),
                         [np.concatenate([x, special])])[0]
    assert np.abs(got[:-4] - exact(x.astype("float64"))).max() <= np.spacing(np.float32(1.0))
    assert np.isnan(got[-4:-1]).all() and abs(got[-1]) <= 1.0  # a huge argument: inaccurate, but a sine


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrow_log_is_computed_in_fp32_and_rounded_once(dtype):
    x = np.geomspace(1e-3, 1e3, 256).reshape(4, 64).astype(NUMPY_DTYPES[dtype])
    got = run_executable(build(single_output_module(relax.op.log, tensor("x", (4, 64), dtype)), "cpu"), [x])[0]
    expected = np.log(x.astype("float64"))
    assert np.all(np.abs(got.astype("float64") - expected) <= RELATIVE[dtype] * np.abs(expected) + 1e-6)


@pytest.mark.parametrize("name", ["sigmoid", "silu", "gelu_tanh", "exp", "log", "sin", "cos", "erf", "tanh"])
def test_sigmoid_family_and_log_become_one_fast_primfunc(name):
    op = {"sigmoid": relax.op.sigmoid, "silu": relax.op.nn.silu, "gelu_tanh": relax.op.nn.gelu_tanh,
          "exp": relax.op.exp, "log": relax.op.log, "sin": relax.op.sin, "cos": relax.op.cos, "erf": relax.op.erf,
          "tanh": relax.op.tanh}[name]
    after = fastmath.FastMath()(single_output_module(op, tensor("x", (4, 64), "bfloat16")))
    relax.analysis.well_formed(after)
    calls = [b.value for b in after["main"].body.blocks[0].bindings]
    assert [c.op.name for c in calls] == ["relax.call_tir"] and calls[0].args[0].name_hint == f"fast_{name}"


EXACT = {  # float64 references
    "erf": np.vectorize(math.erf),
    "exp": np.exp,
    "tanh": np.tanh,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "gelu": lambda x: x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
}
RELAX_OPS = {"erf": relax.op.erf, "exp": relax.op.exp, "tanh": relax.op.tanh, "sigmoid": relax.op.sigmoid,
             "silu": relax.op.nn.silu, "gelu": relax.op.nn.gelu, "gelu_tanh": relax.op.nn.gelu_tanh}
# fp32: the polynomial's error; bf16/fp16: one rounding of the result (8 and 11 mantissa bits)
RELATIVE = {"float32": 2e-6, "bfloat16": 8e-3, "float16": 1e-3}
NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@pytest.mark.parametrize("dtype", list(RELATIVE))
@pytest.mark.parametrize("name", list(EXACT))
def test_fast_functions_match_the_exact_ones_in_every_float_dtype(name, dtype):
    x = np.linspace(-6, 6, 256, dtype="float32").reshape(4, 64).astype(NUMPY_DTYPES[dtype])
    got = run_executable(build(single_output_module(RELAX_OPS[name], tensor("x", (4, 64), dtype)), "cpu"), [x])[0]
    expected = EXACT[name](x.astype("float64"))
    # each value within its dtype's rounding, plus the fp32 polynomial's error (TOLERANCE of the largest value)
    bound = RELATIVE[dtype] * np.abs(expected) + TOLERANCE * np.abs(expected).max()
    assert np.all(np.abs(got.astype("float64") - expected) <= bound)


@pytest.mark.parametrize("exponent,expected_ops", [
    (2.0, ["relax.multiply"]), (3.0, ["relax.multiply", "relax.multiply"]), (0.5, ["relax.sqrt"]),
    (0.75, ["relax.sqrt", "relax.sqrt", "relax.multiply"]),  # a local response norm's: sqrt(x) * sqrt(sqrt(x))
    (2.25, ["relax.sqrt", "relax.sqrt", "relax.multiply", "relax.multiply"]),
    (1.7, ["relax.power"]), (-0.5, ["relax.power"]), (4.5, ["relax.power"]),  # other exponents keep pow
])
def test_small_constant_powers_become_multiplies(exponent, expected_ops):
    def power(x):
        return relax.op.power(x, relax.const(exponent, "float32"))

    before = single_output_module(power, tensor("x", (4, 64)))
    text = before.script()
    after = fastmath.FastMath()(before)
    relax.analysis.well_formed(after)
    assert before.script() == text, "the pass mutated its input module"
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert ops == expected_ops
    x = np.linspace(0.1, 4, 256, dtype="float32").reshape(4, 64)
    got = run_executable(build(before, "cpu"), [x])[0]
    np.testing.assert_allclose(got, x.astype("float64") ** exponent, rtol=1e-6)  # a few fp32 roundings


@I.ir_module
class Rounded:
    @R.function
    def main(x: R.Tensor((4, 64), "float32")):
        with R.dataflow():
            gate = R.sigmoid(x)
            silu = R.multiply(x, gate)
            narrow = R.astype(silu, "bfloat16")  # gate and silu are rounded to bf16 before anything reads them
            reduced = R.sigmoid(x)
            mean = R.mean(reduced, axis=[1], keepdims=True)  # a reduction reads this one
            returned = R.sigmoid(x)
            gv = (narrow, mean, returned)
            R.output(gv)
        return gv


def test_values_rounded_to_a_narrow_float_are_found_through_elementwise_readers():
    assert {var.name for var in fastmath.rounded_values(Rounded["main"])} == {"gate", "silu"}


@I.ir_module
class GuardedRows:
    @R.function
    def main(scores: R.Tensor((2, 48), "float32")):
        with R.dataflow():
            rows = R.nn.softmax(scores, axis=-1)
            test = R.isnan(rows)  # a NaN stays a NaN when rounded
            guarded = R.where(test, R.const(0.0, "float32"), rows)
            sliced = R.strided_slice(guarded, axes=[1], begin=[0], end=[37])
            narrow = R.astype(sliced, "bfloat16")
            wide = R.nn.softmax(scores, axis=-1)
            kept = R.where(R.isnan(wide), R.const(0.0, "float32"), wide)  # returned in fp32
            gv = (narrow, kept)
            R.output(gv)
        return gv


def test_values_rounded_to_a_narrow_float_are_found_through_a_nan_guard_and_a_slice():
    """An exported attention's softmax, guarded against NaN (where, isnan) and sliced back from padded rows before
    its cast to bf16, is rounded: its exps take narrow_exp. The same guard returned in fp32 is not."""
    assert {var.name for var in fastmath.rounded_values(GuardedRows["main"])} == {"rows", "test", "guarded",
                                                                                  "sliced"}


def test_only_activations_rounded_to_a_narrow_float_take_the_narrow_exp():
    after = fastmath.FastMath()(Rounded)
    relax.analysis.well_formed(after)
    gates = [func.script() for gv, func in after.functions_items() if gv.name_hint.startswith("fast_si")]
    assert sorted("narrow_exp" in text for text in gates) == [False, True]  # the silu; the fp32 sigmoid, shared
    x = np.linspace(-6, 6, 256, dtype="float32").reshape(4, 64)
    narrow, mean, returned = run_executable(build(Rounded, "cpu"), [x])
    silu = EXACT["silu"](x.astype("float64"))
    assert np.all(np.abs(narrow.astype("float64") - silu) <= RELATIVE["bfloat16"] * np.abs(silu))
    np.testing.assert_allclose(returned, EXACT["sigmoid"](x.astype("float64")), rtol=TOLERANCE)
    np.testing.assert_allclose(mean[:, 0], EXACT["sigmoid"](x.astype("float64")).mean(axis=1), rtol=TOLERANCE)


@I.ir_module
class SpelledSilu:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), y: R.Tensor((4, 64), "float32")):
        with R.dataflow():
            gate = R.sigmoid(x)
            silu = R.multiply(x, gate)  # the exporters' SiLU
            shared = R.sigmoid(y)
            product = R.multiply(shared, y)  # a SiLU whose gate another op reads too
            gated = R.multiply(shared, x)
            gv = (silu, product, gated)
            R.output(gv)
        return gv


@I.ir_module
class OneSilu:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), y: R.Tensor((4, 64), "float32")):
        with R.dataflow():
            silu = R.nn.silu(x)
            shared = R.sigmoid(y)
            product = R.multiply(shared, y)
            gated = R.multiply(shared, x)
            gv = (silu, product, gated)
            R.output(gv)
        return gv


def test_an_exported_silu_becomes_one_op_unless_its_gate_is_read_again():
    assert_transforms(fastmath.silu_spelled_out, SpelledSilu, OneSilu)
    x, y = (np.linspace(-6, 6, 256, dtype="float32").reshape(4, 64) * s for s in (1.0, -0.5))
    silu, product, gated = run_executable(build(SpelledSilu, "cpu"), [x, y])
    np.testing.assert_allclose(silu, EXACT["silu"](x.astype("float64")), rtol=TOLERANCE, atol=1e-7)
    np.testing.assert_allclose(product, EXACT["silu"](y.astype("float64")), rtol=TOLERANCE, atol=1e-7)
    np.testing.assert_allclose(gated, EXACT["sigmoid"](y.astype("float64")) * x, rtol=TOLERANCE, atol=1e-7)


@pytest.mark.parametrize("activation", ["Softplus", "Mish", "LogSigmoid"])
def test_exported_log_activations_run_on_the_fast_log_and_match_pytorch(activation, tmp_path):
    """torch.onnx's Softplus (TVM imports it as max(x, 0) + log(1 + e^-|x|)), Mish (Softplus, Tanh, Mul) and
    LogSigmoid: 1.9, 2.2 and 2.2 ms over 64x112x112 on libm's log, 0.69, 0.63 and 0.78 ms on the fast log."""
    torch = pytest.importorskip("torch")
    import relay_amp

    module = getattr(torch.nn, activation)()
    x = torch.linspace(-30, 30, 4 * 64).reshape(4, 64)
    path = tmp_path / "activation.onnx"
    torch.onnx.export(module, (x,), str(path), opset_version=17, dynamo=False)
    mod = relay_amp.frontend.from_onnx(path)
    prepared = fastmath.FastMath()(mod)
    assert "fast_log" in [gv.name_hint for gv in prepared.get_global_vars()]
    got = run_executable(build(mod, "cpu"), [x.numpy()])[0]
    np.testing.assert_allclose(got, module(x.double()).numpy(), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("axis, shape", [(-1, (6, 197)), (1, (2, 64, 5))])
def test_log_softmax_runs_on_the_fast_exp_and_log_and_matches(axis, shape):
    """TVM's log_softmax called libm's exp and log: 1.35 ms over 64x112x112 rows of 112, 0.24 ms after."""
    before = single_output_module(lambda x: relax.op.nn.log_softmax(x, axis), tensor("x", shape))
    after = fastmath.FastMath()(before)
    relax.analysis.well_formed(after)
    assert "fast_log_softmax" in [gv.name_hint for gv in after.get_global_vars()]
    x = (np.random.default_rng(0).standard_normal(shape) * 30).astype("float32")  # rows spanning e^-100 and more
    got = run_executable(build(before, "cpu"), [x])[0]
    wide = x.astype("float64")
    shifted = wide - wide.max(axis, keepdims=True)
    expected = shifted - np.log(np.exp(shifted).sum(axis, keepdims=True))
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-6 * np.abs(expected).max())


@pytest.mark.parametrize("name", ["exp", "softmax", "silu"])
def test_fp32_exps_run_on_relay_amps_exp_within_its_bound(name):
    """An fp32 exp, softmax or SiLU runs on formula's fast_exp (1.1e-7 relative; TVM's fast_exp, which
    FastMathTransform would give the first two, drifts to 4e-6 near e^-87 and e^88)."""
    op = {"exp": relax.op.exp, "softmax": lambda x: relax.op.nn.softmax(x, 1), "silu": relax.op.nn.silu}[name]
    before = single_output_module(op, tensor("x", (4, 2048)))
    after = fastmath.FastMath()(before)
    scripts = "".join(func.script() for _, func in after.functions_items())
    assert f'sblock("{"fast_exp_negative" if name == "silu" else "fast_exp"}")' in scripts
    assert "T_fast_exp" not in scripts
    x = np.linspace(-87, 88, 4 * 2048, dtype="float32").reshape(4, 2048)
    if name == "silu":
        x = -x  # e^-x over the same span
    got = run_executable(build(before, "cpu"), [x])[0].astype("float64")
    if name == "softmax":
        exps = np.exp((x - x.max(1, keepdims=True)).astype("float64"))  # x - max rounded to fp32, as the model's
        expected = exps / exps.sum(1, keepdims=True)
    else:
        expected = EXACT[name](x.astype("float64"))
    assert np.all(np.abs(got - expected) <= 4e-7 * np.abs(expected) + 1e-38)


@I.ir_module
class RoundedSoftmax:
    @R.function
    def main(scores: R.Tensor((2, 6, 208), "float32")):
        with R.dataflow():
            weights = R.nn.softmax(scores, axis=-1)
            narrow = R.astype(weights, "bfloat16")  # attention's weights, rounded for the product with the values
            kept = R.nn.softmax(scores, axis=1)  # an fp32 result: TVM's fast softmax
            gv = (narrow, kept)
            R.output(gv)
        return gv


def test_a_softmax_rounded_to_a_narrow_float_takes_the_narrow_exp():
    """A bf16 model's attention weights are rounded to bf16: their exps need only narrow_exp's 7e-6 (a fifth to a
    third faster over rows of 208-736); a softmax read in fp32 takes relay_amp's fast_exp (formula.fast_softmax)."""
    after = fastmath.FastMath()(RoundedSoftmax)
    relax.analysis.well_formed(after)
    softmaxes = [func.script() for gv, func in after.functions_items() if gv.name_hint.startswith("fast_softmax")]
    assert sorted("narrow_exp" in text for text in softmaxes) == [False, True]
    scores = (np.random.default_rng(0).standard_normal((2, 6, 208)) * 8).astype("float32")
    narrow, kept = run_executable(build(RoundedSoftmax, "cpu"), [scores])
    for got, axis, relative in ((narrow, -1, RELATIVE["bfloat16"]), (kept, 1, TOLERANCE)):
        exps = np.exp(scores.astype("float64") - scores.max(axis, keepdims=True))
        expected = exps / exps.sum(axis, keepdims=True)
        assert np.all(np.abs(got.astype("float64") - expected) <= relative * expected + 1e-30)
    scores[0, 0, 5] = np.nan  # a NaN score makes its row NaN, as PyTorch's softmax and TVM's fast one give it
    narrow, kept = run_executable(build(RoundedSoftmax, "cpu"), [scores])
    assert np.isnan(narrow[0, 0].astype("float32")).all() and not np.isnan(narrow[0, 1:].astype("float32")).any()


@I.ir_module
class MaskedSoftmaxes:
    @R.function
    def main(scores: R.Tensor((2, 4, 32), "float32"), mask: R.Tensor((2, 1, 32), "float32"),
             bias: R.Tensor((2, 4, 32), "float32")):
        with R.dataflow():
            masked = R.add(scores, mask)  # a padding mask shared by the 4 rows: one TE function with the softmax
            weights = R.nn.softmax(masked, axis=-1)
            narrow = R.astype(weights, "bfloat16")
            biased = R.add(scores, bias)  # a tensor of the scores' shape: stays an add
            kept = R.nn.softmax(biased, axis=-1)
            shared = R.add(mask, scores)  # read twice: stays an add
            again = R.nn.softmax(shared, axis=-1)
            gv = (narrow, kept, again, shared)
            R.output(gv)
        return gv


def test_a_softmax_of_scores_plus_a_broadcast_mask_adds_it_in_its_own_function():
    """BERT's padding mask, added to the scores as a pass of its own (0.33 ms a layer at 512 tokens), is now added
    by the softmax's function as it reads the scores; an add of two whole tensors, or one read elsewhere, stays."""
    after = fastmath.FastMath()(MaskedSoftmaxes)
    relax.analysis.well_formed(after)
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    adds = [call for call in calls if call.op.name == "relax.add"]
    assert len(adds) == 3 and len(adds[0].args) == 2  # the first is dead (removed by fusion's dead-code pass)
    softmax_inputs = [len(call.args[1].fields) for call in calls if call.op.name == "relax.call_tir"
                      and "softmax" in call.args[0].name_hint]
    assert softmax_inputs == [2, 1, 1]  # scores and mask; the others take the sums (TVM's fast softmax)
    rng = np.random.default_rng(0)
    scores, bias = (rng.standard_normal((2, 4, 32)).astype("float32") * 4 for _ in range(2))
    mask = np.where(rng.random((2, 1, 32)) > 0.3, 0.0, np.finfo("float32").min).astype("float32")
    narrow, kept, again, _ = run_executable(build(MaskedSoftmaxes, "cpu"), [scores, mask, bias])
    for got, logits, relative in ((narrow, scores + mask, RELATIVE["bfloat16"]), (kept, scores + bias, TOLERANCE),
                                  (again, scores + mask, TOLERANCE)):
        exps = np.exp(logits.astype("float64") - logits.max(-1, keepdims=True))
        expected = exps / exps.sum(-1, keepdims=True)
        assert np.all(np.abs(got.astype("float64") - expected) <= relative * expected + 1e-7)
