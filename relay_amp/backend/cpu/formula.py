"""formula: an elementwise function of one value (an activation: GELU, SiLU, tanh, ...) held as a nested tuple,
read off the Relax ops that compute it and evaluated into one TIR expression inside a kernel's epilogue.

A formula is `X` (the value), `("const", c)` or `(kind, *operands)` with `kind` one of `PRIMITIVES`: TVM's own
TE functions, including its polynomial `fast_erf`/`fast_tanh`, and relay_amp's polynomial exp, `fast_exp` (what
`fastmath.FastMath` uses for all of them), so an activation computed in a kernel's epilogue is the one it would have
been as a function of its own. Formulas are tuples so that `kernels.Step` stays hashable; `expression` turns one
into TIR through TE.
"""

import functools
import math

import tvm
from tvm import relax, s_tir, te, topi

from ..._ir import tensor_dtype
from ...dtypes import MODEL_FLOAT_DTYPES
from . import reciprocal

WIDE = "float32"
X = ("x",)
PRIMITIVES = {
    "add": topi.add, "subtract": topi.subtract, "multiply": topi.multiply, "divide": topi.divide,
    "maximum": topi.maximum, "minimum": topi.minimum, "negative": topi.negative, "sqrt": topi.sqrt,
    "erf": topi.erf, "exp": topi.exp, "tanh": topi.tanh, "floor": topi.floor, "log": topi.log, "sin": topi.sin,
    "cos": topi.cos, "abs": topi.abs,
}
UNARY_OPS = {"relax.negative": "negative", "relax.sqrt": "sqrt", "relax.erf": "erf", "relax.exp": "exp",
             "relax.tanh": "tanh", "relax.floor": "floor",  # floor: the rounding of a quantize (floor(x + 0.5))
             "relax.log": "log", "relax.sin": "sin", "relax.cos": "cos", "relax.abs": "abs"}
BINARY_OPS = {"relax.add": "add", "relax.subtract": "subtract", "relax.multiply": "multiply",
              "relax.divide": "divide", "relax.maximum": "maximum", "relax.minimum": "minimum"}
APPROXIMATED = ("erf", "exp", "tanh", "log", "sin", "cos")  # the primitives with a fast_ version
MAX_ROOT_POWER = 4.0  # the largest constant exponent computed by multiplies and square roots instead of pow
# e^f on |f| <= ln2/2, a degree-6 polynomial fitted here for relative error (Lawson-weighted least squares): with ln2
# in two parts, e^x within 1.1e-7 relative over [-87, 88] in fp32 arithmetic and unbiased (mean 1e-9). TVM's
# fast_exp (a degree 7, ln2 in one part, a floor and a conversion for 2^n) is 4.1e-6 near the ends, 5.7e-7 within
# |x| < 10, and takes 18 vector instructions against 15
EXP_POLYNOMIAL = (1.000000032161834, 0.49999994208731763, 0.16666431277413943, 0.04166800223111925,
                  0.008374154086684266, 0.0013843635737911166)
# e^f for an exp whose result is rounded to bfloat16 or float16: a degree 4 fitted for relative error, 7e-6 in fp32
# arithmetic (float16's half ulp: 4.9e-4). A degree 3, at 1.2e-4, biased a bf16 EfficientNet-B0's output 30% further
# from fp32's than a degree 7 did.
NARROW_EXP_POLYNOMIAL = (0.99996366, 0.50002222, 0.16790617, 0.04158984)
# erf(x) = x P(x^2) on |x| <= 3 (erf(3) = 1 - 2.2e-5), P of degree 8 fitted here for absolute error (Lawson-weighted
# least squares): within 2.5e-5 of erf everywhere in fp32 arithmetic and no division, where TVM's fast_erf divides two
# polynomials (a vdivps a vector, and more than half of an int8 1x1 conv's time with a GELU write-back). For results
# requantized to 8-bit integers only: their step is a 127th to a 255th of their range, while a bf16 GELU's negative
# tail (values near 1e-4) needs an erf within a few 1e-6
NARROW_ERF_POLYNOMIAL = (1.1282684265863718, -0.37531487725282203, 0.11107933623366807, -0.02510286088635603,
                         0.004235427019393558, -0.0005110367420977076, 4.1060505537407824e-05,
                         -1.9448213378001067e-06, 4.0742065110510595e-08)
NARROW_ERF_LIMIT = 3.0
# erf(x) and tanh(x) as x P(x^2) / Q(x^2), x clamped to a limit (TVM's fast_erf and fast_tanh: Eigen's rational
# approximations), as (limit, P, Q), coefficients lowest power first
ERF_RATIO = (4.0, (-1.60960333262415e-02, -2.95459980854025e-03, -7.34990630326855e-04, -5.69250639462346e-05,
                   -2.10102402082508e-06, 2.77068142495902e-08, -2.72614225801306e-10),
             (-1.42647390514189e-02, -7.37332916720468e-03, -1.68282697438203e-03, -2.13374055278905e-04,
              -1.45660718464996e-05))
TANH_RATIO = (9.0, (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
                    -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16),
              (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06))
EXP_LIMIT = 88.0  # |x| clamped so that n stays within [-127, 127]: 2^n's exponent field within [0, 254]
ROUNDING_MAGIC = 1.5 * 2 ** 23 + 127  # a float whose ulp is 1: adding it rounds to an integer, offset by 127
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
# log(1 + f) = f - f^2 / 2 + f^3 P(f) on sqrt(1/2) - 1 <= f < sqrt(2) - 1, P of degree 7 fitted here for relative
# error (Lawson-weighted least squares): within 0.86 ulp of log over the fp32 range in fp32 arithmetic
LOG_POLYNOMIAL = (0.33333352, -0.25000852, 0.19999857, -0.16621426, 0.14226538, -0.13201055, 0.12623558,
                  -0.07369332)
LN2_HIGH, LN2_LOW = 0.693359375, -2.12194440e-4  # ln 2 split so that e * LN2_HIGH is exact for |e| < 2^15
# sin r = r + r^3 S(r^2) and cos r = 1 - r^2 / 2 + r^4 C(r^2) on |r| <= pi/4, S and C of degree 2 fitted here for
# relative error (Lawson-weighted least squares): 3.8e-9 and 1.2e-10, under fp32's half ulp
SIN_POLYNOMIAL = (-0.16666655242443085, 0.008332161232829094, -0.00019515384337864816)
COS_POLYNOMIAL = (0.04166664555668831, -0.0013887316454201937, 2.4433235012111254e-05)
# pi/2 split in parts of 8 and 9 significant bits: k times each is exact for |k| < 2^15 (|x| < 51471), where
# x - k pi/2 is within an fp32 ulp of the reduced argument; at |x| = 1e5 within 2e-6, and beyond it worse
PI_2_HIGH, PI_2_MID, PI_2_LOW = 1.5703125, 0.00048351287841796875, 3.1391647326017846e-07
SMALLEST_NORMAL = 1.1754943508222875e-38  # below it an fp32's exponent field is 0: such inputs are scaled first
SUBNORMAL_SCALE = 23  # ... by 2^23


def _series(value: tvm.ir.Expr, coefficients: tuple) -> tvm.ir.Expr:
    """The polynomial of `coefficients` (lowest power first) at `value`, by Horner's rule."""
    result = _wide(coefficients[-1])
    for coefficient in reversed(coefficients[:-1]):
        result = result * value + _wide(coefficient)
    return result


def _polynomial_exp(x: te.Tensor, polynomial: tuple, ln2_parts: tuple, specials: bool, name: str,
                    negated: bool = False) -> te.Tensor:
    """e^x as 2^n times e^f, e^f by `polynomial` (the coefficients after 1, lowest power first), f = x - n ln2 with ln2
    subtracted in `ln2_parts`, n rounded by adding ROUNDING_MAGIC, whose low mantissa bits then hold n + 127, the
    exponent field of 2^n (no floor, no conversion). With `specials`, a last max with x lets NaN and +inf through
    (e^x exceeds x everywhere else); without it they give e^88 (one instruction fewer: SiLU's exps, where x carries a
    NaN through anyway). `negated`: e^-x, the sign folded into the constants (-x never computed: one instruction
    fewer, the same bits, as rounding to nearest is symmetric)."""
    sign = -1.0 if negated else 1.0

    def element(*index):
        value = te.max(te.min(x(*index), _wide(EXP_LIMIT)), _wide(-EXP_LIMIT))
        rounded = value * _wide(sign * LOG2E) + _wide(ROUNDING_MAGIC)
        bits = tvm.tirx.reinterpret("int32", rounded)
        whole = tvm.tirx.reinterpret(WIDE, bits) - _wide(ROUNDING_MAGIC)  # as bits, or TVM folds the magic away
        fraction = value  # sign * f
        for part in ln2_parts:
            fraction = fraction - whole * _wide(sign * part)
        power = _series(-fraction if negated else fraction, (1.0, *polynomial)) * tvm.tirx.reinterpret(WIDE, bits << 23)
        return te.max(power, x(*index)) if specials else power
    return te.compute(x.shape, element, name=name)


def _fast_exp(x: te.Tensor) -> te.Tensor:
    """e^x within 1.1e-7 relative (EXP_POLYNOMIAL); NaN and +inf pass through, as TVM's fast_exp lets them."""
    return _polynomial_exp(x, EXP_POLYNOMIAL, (LN2_HIGH, LN2_LOW), specials=True, name="fast_exp")


def _narrow_exp(x: te.Tensor, specials: bool = False) -> te.Tensor:
    """e^x for results rounded to a narrow float, within 7e-6 relative (NARROW_EXP_POLYNOMIAL, ln2 in one part)."""
    return _polynomial_exp(x, NARROW_EXP_POLYNOMIAL, (LN2,), specials, name="narrow_exp")


def _negated_exps(x: te.Tensor, narrow: bool) -> te.Tensor:
    """e^-x for SiLU's x / (1 + e^-x), fast_exp's or narrow_exp's polynomial, NaN and -inf of x not carried (the
    quotient's x carries a NaN): two instructions a vector fewer than fast_exp of -x (SiLU over 56x56x144 in fp32
    8% faster, its depthwise conv 6%, on Zen 4)."""
    if narrow:
        return _polynomial_exp(x, NARROW_EXP_POLYNOMIAL, (LN2,), False, name="narrow_exp_negative", negated=True)
    return _polynomial_exp(x, EXP_POLYNOMIAL, (LN2_HIGH, LN2_LOW), False, name="fast_exp_negative", negated=True)


def _odd_ratio(x: te.Tensor, ratio: tuple, name: str) -> te.Tensor:
    """x P(x^2) / Q(x^2) of `ratio` (ERF_RATIO, TANH_RATIO: TVM's fast_erf and fast_tanh), its quotient as fast
    math's (reciprocal.divide: on AVX-512 the reciprocal estimate and a Newton step, not a vdivps a vector)."""
    limit, numerator, denominator = ratio

    def element(*index):
        value = te.max(te.min(x(*index), _wide(limit)), _wide(-limit))
        square = value * value
        return reciprocal.divide(value * _series(square, numerator), _series(square, denominator), False)

    return te.compute(x.shape, element, name=name)


def _narrow_erf(x: te.Tensor) -> te.Tensor:
    """erf(x) within NARROW_ERF_POLYNOMIAL's 2.5e-5: x clamped to NARROW_ERF_LIMIT, times the polynomial of x^2."""
    def element(*index):
        value = te.max(te.min(x(*index), _wide(NARROW_ERF_LIMIT)), _wide(-NARROW_ERF_LIMIT))
        return _series(value * value, NARROW_ERF_POLYNOMIAL) * value

    return te.compute(x.shape, element, name="narrow_erf")


def _quotients(numerator, denominator, narrow: bool) -> te.Tensor:
    """numerator / denominator elementwise (tensors of one shape, or a constant and a tensor) as reciprocal.divide
    computes it."""
    shape = next(operand.shape for operand in (numerator, denominator) if isinstance(operand, te.Tensor))

    def element(*index):
        values = [operand(*index) if isinstance(operand, te.Tensor) else operand
                  for operand in (numerator, denominator)]
        return reciprocal.divide(*values, narrow)
    return te.compute(shape, element, name="narrow_divide" if narrow else "fast_divide")


def _wide(value: float) -> tvm.ir.Expr:
    return tvm.tirx.const(value, WIDE)


def _fast_log(x: te.Tensor) -> te.Tensor:
    """log x, vectorizable: x = 2^e m with m in [sqrt(1/2), sqrt(2)) read from its bits, log(m) by LOG_POLYNOMIAL,
    e ln 2 added in two parts; 0 gives -inf, +inf itself, and negative numbers and NaN give NaN, as libm's."""
    def element(*index):
        value = x(*index)
        subnormal = value < _wide(SMALLEST_NORMAL)
        bits = tvm.tirx.reinterpret("int32", tvm.tirx.Select(subnormal, value * _wide(2.0 ** SUBNORMAL_SCALE), value))
        mantissa = tvm.tirx.reinterpret(WIDE, (bits & 0x7FFFFF) | 0x3F800000)  # in [1, 2)
        high = mantissa > _wide(math.sqrt(2.0))
        fraction = tvm.tirx.Select(high, mantissa * _wide(0.5), mantissa) - _wide(1.0)
        exponent = (((bits >> 23) - 127).astype(WIDE) + tvm.tirx.Select(high, _wide(1.0), _wide(0.0))
                    - tvm.tirx.Select(subnormal, _wide(SUBNORMAL_SCALE), _wide(0.0)))
        square = fraction * fraction
        series = _series(fraction, LOG_POLYNOMIAL)
        log = (fraction * square * series + exponent * _wide(LN2_LOW) - square * _wide(0.5) + fraction
               + exponent * _wide(LN2_HIGH))
        infinity = _wide(math.inf)
        special = tvm.tirx.Select(value == _wide(0.0), -infinity,
                                  tvm.tirx.Select(value == infinity, infinity, _wide(math.nan)))
        return tvm.tirx.Select(tvm.tirx.all(value > _wide(0.0), value < infinity), log, special)
    return te.compute(x.shape, element, name="fast_log")


def _fast_sine(x: te.Tensor, quarter_turns: int) -> te.Tensor:
    """sin(x + quarter_turns pi/2), vectorizable: x = k pi/2 + r with |r| <= pi/4 (k rounded by floor, pi/2 in
    three parts), sin r or cos r by SIN_POLYNOMIAL or COS_POLYNOMIAL picked and signed by k's quadrant; infinities
    and NaN give NaN, as libm's. cos is quarter_turns 1."""
    def element(*index):
        value = x(*index)
        turns = tvm.tirx.floor(value * _wide(2.0 / math.pi) + _wide(0.5))
        reduced = ((value - turns * _wide(PI_2_HIGH)) - turns * _wide(PI_2_MID)) - turns * _wide(PI_2_LOW)
        reduced = te.max(te.min(reduced, _wide(1.0)), _wide(-1.0))  # past pi/4 by rounding; huge x: within [-1, 1]
        square = reduced * reduced
        sine = reduced + reduced * square * _series(square, SIN_POLYNOMIAL)
        cosine = _wide(1.0) - square * _wide(0.5) + square * square * _series(square, COS_POLYNOMIAL)
        quadrant = turns.astype("int32") + quarter_turns
        picked = tvm.tirx.Select((quadrant & 1) == 1, cosine, sine)
        signed = tvm.tirx.Select((quadrant & 2) == 2, -picked, picked)
        return tvm.tirx.Select(tvm.tirx.abs(value) < _wide(math.inf), signed, _wide(math.nan))
    return te.compute(x.shape, element, name="fast_cos" if quarter_turns else "fast_sin")


PRIMITIVES["fast_divide"] = lambda a, b: _quotients(a, b, narrow=False)
PRIMITIVES["narrow_divide"] = lambda a, b: _quotients(a, b, narrow=True)
PRIMITIVES["fast_exp"] = _fast_exp
PRIMITIVES["narrow_exp"] = _narrow_exp
PRIMITIVES["fast_exp_negative"] = lambda x: _negated_exps(x, narrow=False)
PRIMITIVES["narrow_exp_negative"] = lambda x: _negated_exps(x, narrow=True)
PRIMITIVES["fast_erf"] = lambda x: _odd_ratio(x, ERF_RATIO, "fast_erf")
PRIMITIVES["fast_tanh"] = lambda x: _odd_ratio(x, TANH_RATIO, "fast_tanh")
PRIMITIVES["narrow_erf"] = _narrow_erf
PRIMITIVES["fast_log"] = _fast_log
PRIMITIVES["fast_sin"] = lambda x: _fast_sine(x, 0)
PRIMITIVES["fast_cos"] = lambda x: _fast_sine(x, 1)


def fast_softmax(x: te.Tensor, axis: int, narrow: bool = False) -> te.Tensor:
    """The softmax over `axis` of fp32 `x`: e^(x - max) by fast_exp over its sum, as TVM's fast_softmax; by
    narrow_exp where `narrow` (a result rounded to a narrow float: a fifth to a third faster over rows of 208-736).
    Each exp times the reciprocal of its row's sum, which LLVM computes once a row (a quotient per element was a
    vdivps a vector: 4x12x128x128 in fp32 158 -> 125 us, within an ulp). A NaN (or +inf) in a row makes the row NaN,
    as PyTorch's and TVM's softmaxes do, not a one-hot row."""
    shifted = topi.subtract(x, topi.max(x, axis=axis, keepdims=True))
    exps = _narrow_exp(shifted, specials=True) if narrow else _fast_exp(shifted)
    return topi.multiply(exps, topi.divide(_wide(1.0), topi.sum(exps, axis=axis, keepdims=True)))


def narrowed(formula: tuple, requantized: bool = False) -> tuple:
    """`formula` with its fast exps only as accurate as a bfloat16 or float16 result keeps them (narrow_exp); where
    `requantized` (a result rounded to 8-bit integers, in steps of its range), its fast erfs instead (narrow_erf):
    its exps stay fast_exp and its quotients fast_divide, as narrow_exp's and the reciprocal estimate's 2^-14 moved a
    quantized CSPDarkNet's codes past its module's rounding. A narrow float result's fast quotients take the estimate
    alone (narrow_divide: relay_amp.backend.cpu.reciprocal)."""
    if requantized:
        return _renamed(formula, "fast_erf", "narrow_erf")
    exps = _renamed(_renamed(formula, "fast_exp", "narrow_exp"), "fast_exp_negative", "narrow_exp_negative")
    return _renamed(exps, "fast_divide", "narrow_divide")


def _renamed(formula: tuple, old: str, new: str) -> tuple:
    kind, *operands = formula
    if kind in ("x", "const"):
        return formula
    return (new if kind == old else kind, *(_renamed(operand, old, new) for operand in operands))


def const(value: float) -> tuple:
    """The formula of a constant."""
    return ("const", float(value))


def _quotient_kind(exp: str) -> str:
    """How a sigmoid's quotient divides: on the reciprocal estimate with fast math (fast_divide), else exactly."""
    return "fast_divide" if exp == "fast_exp" else "divide"


def _sigmoid(x: tuple, exp: str) -> tuple:
    return (_quotient_kind(exp), const(1.0), ("add", (exp, ("negative", x)), const(1.0)))


def _silu(x: tuple, exp: str) -> tuple:
    """x / (1 + e^-x) (a multiply fewer than x * sigmoid(x)); a fast exp of -x as fast_exp_negative."""
    if exp == "fast_exp":
        return ("fast_divide", x, ("add", ("fast_exp_negative", x), const(1.0)))
    return ("divide", x, ("add", (exp, ("negative", x)), const(1.0)))


def _gelu(x: tuple, erf: str) -> tuple:
    return ("multiply", ("multiply", x, const(0.5)),
            ("add", (erf, ("multiply", x, const(1.0 / math.sqrt(2.0)))), const(1.0)))


def _gelu_tanh(x: tuple, tanh: str) -> tuple:
    cube = ("multiply", ("multiply", x, x), x)
    inner = ("multiply", ("add", x, ("multiply", cube, const(0.044715))), const(math.sqrt(2.0 / math.pi)))
    return ("multiply", ("multiply", x, const(0.5)), ("add", (tanh, inner), const(1.0)))


def activation(op_name: str, x: tuple, fast: bool) -> "tuple | None":
    """The formula of a Relax activation op of one operand applied to `x` (fast: TVM's polynomial erf/exp/tanh,
    else libm's), None for any other op."""
    name = {kind: ("fast_" + kind if fast else kind) for kind in APPROXIMATED}
    if op_name in UNARY_OPS:
        kind = UNARY_OPS[op_name]
        return (name.get(kind, kind), x)
    builders = {"relax.sigmoid": lambda: _sigmoid(x, name["exp"]),
                "relax.nn.silu": lambda: _silu(x, name["exp"]),
                "relax.nn.gelu": lambda: _gelu(x, name["erf"]),
                "relax.nn.gelu_tanh": lambda: _gelu_tanh(x, name["tanh"]),
                "relax.nn.relu": lambda: ("maximum", x, const(0.0))}
    return builders[op_name]() if op_name in builders else None


def scalar(expr: relax.Expr) -> "float | None":
    """The value of a float constant with one element, else None."""
    if not isinstance(expr, tvm.ir.expr.Constant) or tensor_dtype(expr) not in MODEL_FLOAT_DTYPES:
        return None
    values = expr.value.numpy()
    return float(values.reshape(-1)[0]) if values.size == 1 else None


def root_power(base, value: "float | None", multiply, sqrt):
    """`base` ** `value` as multiplies and square roots (`multiply(a, b)`, `sqrt(a)` build them) where `value` is a
    multiple of 1/4 in (0, MAX_ROOT_POWER]: a variance's square, a tanh-GELU's cube, a local response norm's 0.75
    (sqrt(x) * sqrt(sqrt(x))). LLVM calls libm's scalar pow for every element. None for other exponents."""
    if value is None or not 0 < value <= MAX_ROOT_POWER or value * 4 != int(value * 4):
        return None
    whole, quarters = divmod(int(value * 4), 4)
    factors = [base] * whole
    if quarters:
        root = sqrt(base)
        factors += {1: lambda: [sqrt(root)], 2: lambda: [root], 3: lambda: [root, sqrt(root)]}[quarters]()
    product = factors[0]
    for factor in factors[1:]:
        product = multiply(product, factor)
    return product


def _power(base: tuple, exponent: relax.Expr) -> "tuple | None":
    return root_power(base, scalar(exponent), lambda a, b: ("multiply", a, b), lambda a: ("sqrt", a))


def of_call(call: relax.Expr, known: dict, fast: bool) -> "tuple | None":
    """The formula of an elementwise Relax op whose tensor operands all have formulas in `known` (var -> formula)
    and whose other operands are scalar constants; casts between float dtypes pass the value on. None otherwise."""
    if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
        return None
    operands = [known.get(arg) if isinstance(arg, relax.Var) else _const_formula(arg) for arg in call.args]
    name = call.op.name
    if name == "relax.astype" and tensor_dtype(call) in MODEL_FLOAT_DTYPES:
        return operands[0]
    if name == "relax.power" and operands[0] is not None:
        return _power(operands[0], call.args[1])
    if name == "relax.nn.leakyrelu" and operands[0] is not None:
        return leaky_relu(operands[0], float(call.attrs.alpha))
    if None in operands or all(operand[0] == "const" for operand in operands):
        return None
    if len(operands) == 2 and name in BINARY_OPS:
        return _cheaper(BINARY_OPS[name], *operands)
    return activation(name, operands[0], fast) if len(operands) == 1 else None


def leaky_relu(x: tuple, alpha: float) -> tuple:
    """max(x, 0) + alpha * min(x, 0): x or alpha * x, one of the two terms an exact 0 (so rounded as TVM's
    leaky_relu is), for any alpha."""
    return ("add", ("maximum", x, const(0.0)), ("multiply", ("minimum", x, const(0.0)), const(alpha)))


def _cheaper(kind: str, left: tuple, right: tuple) -> tuple:
    """`kind` of two formulas in its cheaper form: a product with a reciprocal (x * sigmoid(x)) as a quotient (one op
    and one rounding fewer), a quotient by a constant as a product with its reciprocal (as PyTorch's own GELU
    computes the x / sqrt(2) the exporters write: one vdivps a vector fewer, 4-7% of a 1x1 conv's time with its
    GELU)."""
    if kind == "divide" and right[0] == "const" and right[1] != 0.0:
        return ("multiply", left, const(1.0 / right[1]))
    if kind == "multiply":
        for value, other in ((left, right), (right, left)):
            if other[0] in ("divide", "fast_divide") and other[1] == const(1.0):
                return _quotient(value, other[2])
    return (kind, left, right)


def _quotient(value: tuple, denominator: tuple) -> tuple:
    """`value` / `denominator`, as _silu where that is x / (1 + e^-x) (x * sigmoid(x), the exporters' SiLU)."""
    for exp in ("fast_exp", "exp"):
        if denominator == _sigmoid(value, exp)[2]:
            return _silu(value, exp)
    return ("divide", value, denominator)


def _const_formula(expr: relax.Expr) -> "tuple | None":
    value = scalar(expr)
    return None if value is None else const(value)


def compute(formula: tuple, x: te.Tensor):
    """`formula` of the fp32 TE tensor `x`, as TE stages (a constant formula: a TIR constant)."""
    kind, *operands = formula
    if kind == "x":
        return x
    if kind == "const":
        return tvm.tirx.const(operands[0], WIDE)
    return PRIMITIVES[kind](*(compute(operand, x) for operand in operands))


def _stored_value(stmt) -> tvm.ir.Expr:
    """The value of the one BufferStore in a single-block TIR body."""
    while not isinstance(stmt, tvm.tirx.BufferStore):
        stmt = stmt.block.body if hasattr(stmt, "block") else stmt.body
    return stmt.value


@functools.lru_cache(maxsize=None)
def _function(formula: tuple) -> tvm.tirx.PrimFunc:
    """main(x: float32, out: Buffer((1,))): out[0] = formula(x), in one block."""
    var = tvm.tirx.Var("x", WIDE)
    stages = te.compute((1,), lambda _: var, name="x")
    sch = s_tir.Schedule(te.create_prim_func([var, compute(formula, stages)]))
    for block in reversed(sch.get_child_blocks(sch.get_sblock("root"))[:-1]):
        sch.compute_inline(block)
    return sch.mod["main"]


def expression(formula: tuple, value: tvm.ir.Expr) -> tvm.ir.Expr:
    """`formula` of the fp32 expression `value`, as one TIR expression."""
    func = _function(formula)
    return _stored_value(func.specialize({func.params[0]: value}).body)
