"""formula: activations read off Relax ops as nested tuples, evaluated into TIR within 1e-6 of numpy."""

import math

import numpy as np
import pytest
import tvm
from tvm import relax, te, topi

from relay_amp.backend.cpu import formula

from builders import tensor

X = formula.X
VALUES = np.linspace(-6.0, 6.0, 256).astype("float32")
ERF = np.vectorize(math.erf)
SIGMOID = 1.0 / (1.0 + np.exp(-VALUES.astype("float64")))
REFERENCE = {  # op -> numpy of VALUES in float64
    "relax.sigmoid": SIGMOID,
    "relax.nn.silu": VALUES * SIGMOID,
    "relax.nn.gelu": VALUES * 0.5 * (1.0 + ERF(VALUES / math.sqrt(2.0))),
    "relax.nn.gelu_tanh": VALUES * 0.5 * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (VALUES + 0.044715 * VALUES ** 3))),
    "relax.erf": ERF(VALUES),
    "relax.tanh": np.tanh(VALUES),
    "relax.nn.relu": np.maximum(VALUES, 0.0),
}


def _evaluate(expr_formula: tuple, values: np.ndarray = VALUES) -> np.ndarray:
    """`expr_formula` of fp32 `values`, compiled for the host CPU through formula.expression."""
    data = te.placeholder(values.shape, "float32", "data")
    out = te.compute(values.shape, lambda i: formula.expression(expr_formula, data[i] * 1.0), name="out")
    lib = tvm.compile(tvm.IRModule({"main": te.create_prim_func([data, out])}), "llvm")
    result = tvm.runtime.tensor(np.zeros_like(values))
    lib["main"](tvm.runtime.tensor(values), result)
    return result.numpy()


def _call(op_name: str) -> relax.Call:
    x = tensor("x", VALUES.shape)
    return relax.Call(tvm.ir.Op.get(op_name), [x]), x


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("op_name", sorted(REFERENCE))
def test_activation_formulas_match_numpy(op_name, fast):
    call, x = _call(op_name)
    made = formula.of_call(call, {x: X}, fast)
    assert ("fast_" in str(made)) == (fast and op_name != "relax.nn.relu")
    np.testing.assert_allclose(_evaluate(made), REFERENCE[op_name], rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("alpha", [0.01, 0.2, 1.5, -0.5])
def test_a_leaky_relu_is_x_or_alpha_times_x_rounded_as_tvms(alpha):
    call = relax.op.nn.leakyrelu(tensor("x", VALUES.shape), alpha)
    made = formula.of_call(call, {call.args[0]: X}, True)
    expected = np.where(VALUES > 0, VALUES, VALUES * np.float32(alpha))
    np.testing.assert_array_equal(_evaluate(made), expected)


def test_abs_has_a_formula():
    call, x = _call("relax.abs")
    np.testing.assert_array_equal(_evaluate(formula.of_call(call, {x: X}, True)), np.abs(VALUES))


def test_binary_ops_take_scalar_constants_and_known_values():
    x = tensor("x", VALUES.shape)
    halved = tensor("halved", VALUES.shape)
    known = {x: X, halved: ("multiply", X, formula.const(0.5))}
    made = formula.of_call(relax.op.subtract(x, halved), known, True)
    assert made == ("subtract", X, ("multiply", X, ("const", 0.5)))
    np.testing.assert_allclose(_evaluate(made), VALUES * 0.5, rtol=1e-7)


@pytest.mark.parametrize("exponent,expected", [(2.0, VALUES ** 2), (3.0, VALUES ** 3)])
def test_small_powers_are_multiplies(exponent, expected):
    x = tensor("x", VALUES.shape)
    made = formula.of_call(relax.op.power(x, relax.const(exponent, "float32")), {x: X}, True)
    assert "power" not in str(made)
    np.testing.assert_allclose(_evaluate(made), expected, rtol=1e-6)


def test_a_power_of_one_half_is_a_square_root():
    x = tensor("x", VALUES.shape)
    assert formula.of_call(relax.op.power(x, relax.const(0.5, "float32")), {x: X}, True) == ("sqrt", X)


def test_a_power_of_three_quarters_is_a_root_times_its_root():
    x = tensor("x", VALUES.shape)
    made = formula.of_call(relax.op.power(x, relax.const(0.75, "float32")), {x: X}, True)
    assert made == ("multiply", ("sqrt", X), ("sqrt", ("sqrt", X)))
    positive = np.abs(VALUES) + 0.1
    np.testing.assert_allclose(formula.root_power(positive, 0.75, np.multiply, np.sqrt), positive ** 0.75, rtol=1e-6)


@pytest.mark.parametrize("reason,build", [
    ("an operand with no formula", lambda x, y: relax.op.add(x, y)),
    ("a constant that is not a scalar", lambda x, y: relax.op.add(x, relax.const(VALUES))),
    ("a reduction", lambda x, y: relax.op.sum(x)),
    ("a cast to an integer", lambda x, y: relax.op.astype(x, "int32")),
    ("a power with another exponent", lambda x, y: relax.op.power(x, relax.const(1.7, "float32"))),
])
def test_ops_without_a_formula_give_none(reason, build):
    x, y = tensor("x", VALUES.shape), tensor("y", VALUES.shape)
    assert formula.of_call(relax.BlockBuilder().normalize(build(x, y)), {x: X}, True) is None, reason


def test_casts_between_floats_pass_the_value_on():
    x = tensor("x", VALUES.shape)
    cast = relax.BlockBuilder().normalize(relax.op.astype(x, "bfloat16"))
    assert formula.of_call(cast, {x: X}, True) == X


def _exps(values: np.ndarray, exp) -> np.ndarray:
    """`exp` (a TE function) of fp32 `values`, compiled for the host CPU, in float64."""
    data = te.placeholder(values.shape, "float32", "data")
    lib = tvm.compile(tvm.IRModule({"main": te.create_prim_func([data, exp(data)])}), "llvm")
    result = tvm.runtime.tensor(np.zeros_like(values))
    lib["main"](tvm.runtime.tensor(values), result)
    return result.numpy().astype("float64")


@pytest.mark.parametrize("kind, bound", [("fast_exp", 2e-7), ("narrow_exp", 1e-5)])  # float16's half ulp: 4.9e-4
def test_the_exps_are_within_their_bounds_and_saturate(kind, bound):
    values = np.concatenate([np.linspace(-87.0, 88.0, 20001), [-200.0, 0.0, 200.0]]).astype("float32")
    got = _exps(values, formula.PRIMITIVES[kind])
    assert np.abs(got[:-3] / np.exp(values[:-3].astype("float64")) - 1.0).max() <= bound
    assert got[-3] == 0.0 and got[-2] == 1.0 and abs(got[-1] / np.exp(88.0) - 1.0) <= bound  # clamped at e^88


def test_the_fast_exp_is_unbiased_closer_than_tvms_and_passes_nan_and_infinity():
    """relay_amp's exp: 1.1e-7 relative at worst and a mean error of 1e-9 over [-87, 88], where TVM's fast_exp
    (ln2 in one part) drifts to 4e-6 near the ends."""
    values = np.linspace(-87.0, 88.0, 200001).astype("float32")
    exact = np.exp(values.astype("float64"))
    ours, tvms = (_exps(values, exp) / exact - 1.0 for exp in (formula.PRIMITIVES["fast_exp"], topi.fast_exp))
    assert abs(ours.mean()) < 1e-8 and np.abs(ours).max() < np.abs(tvms).max() / 10
    specials = _exps(np.array([np.nan, np.inf, -np.inf], "float32"), formula.PRIMITIVES["fast_exp"])
    assert np.isnan(specials[0]) and specials[1] == np.inf and specials[2] == 0.0


@pytest.mark.parametrize("kind", ["fast_exp", "narrow_exp"])
def test_silus_negated_exps_are_the_exps_of_the_negated_values_bit_for_bit(kind):
    """SiLU's e^-x folds the sign into the constants: the same bits as the exp of -x, clamps included; NaN is not
    carried (x carries it through SiLU's quotient)."""
    values = np.concatenate([np.linspace(-88.0, 87.0, 20001), [-200.0, 200.0]]).astype("float32")
    negated = _exps(values, formula.PRIMITIVES[kind + "_negative"])
    np.testing.assert_array_equal(negated, _exps(-values, formula.PRIMITIVES[kind]))
    silu = formula.narrowed(formula.activation("relax.nn.silu", X, fast=True)) if kind == "narrow_exp" else \
        formula.activation("relax.nn.silu", X, fast=True)
    assert silu[2][1] == (kind + "_negative", X)
    specials = _evaluate(silu, np.array([np.nan, np.inf, -1e30, 1e30], "float32"))
    assert np.isnan(specials[0]) and specials[1] == np.inf and specials[3] == np.float32(1e30)
    assert -1e-8 < specials[2] <= 0.0  # -1e30 / (1 + e^88): the exp clamped at e^88


def test_exps_rounded_to_a_narrow_float_take_the_narrow_polynomial():
    silu = formula.activation("relax.nn.silu", X, fast=True)
    narrowed = formula.narrowed(silu)
    assert "narrow_exp" in str(narrowed) and "fast_exp" not in str(narrowed)
    np.testing.assert_allclose(_evaluate(narrowed), REFERENCE["relax.nn.silu"], rtol=1e-5, atol=1e-6)
    exact = formula.activation("relax.nn.silu", X, fast=False)
    assert formula.narrowed(exact) == exact  # only the fast polynomial has a narrow one


def test_the_narrow_erf_is_within_its_bound_everywhere_and_has_no_division():
    """erf for a GELU requantized to 8 bits: within 2.5e-5 over [-10, 10] (its clamp at 3 included), against an
    8-bit step of a 127th to a 255th of its range; a polynomial, where TVM's fast_erf divides two."""
    values = np.linspace(-10.0, 10.0, 40001).astype("float32")
    got = _exps(values, formula.PRIMITIVES["narrow_erf"])
    assert np.abs(got - ERF(values.astype("float64"))).max() <= 2.5e-5
    data = te.placeholder((4,), "float32")
    assert "/" not in te.create_prim_func([data, formula.PRIMITIVES["narrow_erf"](data)]).script()


def test_only_gelus_requantized_to_8_bits_take_the_narrow_erf():
    """A GELU rounded to bf16 or fp16 keeps fast_erf: their tails (values near 1e-4) need an erf within a few
    1e-6. Requantized results keep fast_exp and fast_divide."""
    gelu = formula.activation("relax.nn.gelu", X, fast=True)
    requantized = formula.narrowed(gelu, requantized=True)
    assert "narrow_erf" in str(requantized) and "fast_erf" not in str(requantized)
    np.testing.assert_allclose(_evaluate(requantized), REFERENCE["relax.nn.gelu"], rtol=0, atol=5.1e-5)
    assert formula.narrowed(gelu) == gelu
    silu = formula.activation("relax.nn.silu", X, fast=True)
    assert formula.narrowed(silu, requantized=True) == silu
    exact = formula.activation("relax.nn.gelu", X, fast=False)
    assert formula.narrowed(exact, requantized=True) == exact


def test_a_quotient_by_a_constant_is_a_product_with_its_reciprocal():
    """The exporters' GELU divides by sqrt(2): a multiply by 1 / sqrt(2), as PyTorch's GELU computes it (no vdivps);
    a quotient of a constant by a value stays one."""
    x = tensor("x", VALUES.shape)
    made = formula.of_call(relax.op.divide(x, relax.const(np.float32(1.4142135))), {x: X}, True)
    assert made == ("multiply", X, formula.const(1.0 / float(np.float32(1.4142135))))
    np.testing.assert_allclose(_evaluate(made), VALUES / np.float32(1.4142135), rtol=2 ** -23)
    assert formula.of_call(relax.op.divide(relax.const(np.float32(2.0)), x), {x: X}, True)[0] == "divide"


def test_a_product_with_a_reciprocal_is_a_quotient():
    x, gate = tensor("x", VALUES.shape), tensor("gate", VALUES.shape)
    sigmoid = formula.activation("relax.sigmoid", X, fast=True)
    for call in (relax.op.multiply(x, gate), relax.op.multiply(gate, x)):  # x * sigmoid(x), in either order
        made = formula.of_call(call, {x: X, gate: sigmoid}, True)
        assert made == formula.activation("relax.nn.silu", X, fast=True)
        assert made[2][1] == ("fast_exp_negative", X)  # e^-x with its sign folded into the constants
    np.testing.assert_allclose(_evaluate(made), REFERENCE["relax.nn.silu"], rtol=1e-6, atol=2e-6)
