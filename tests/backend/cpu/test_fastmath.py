"""fastmath: GELU and friends become TVM's fast approximations, within 1e-6 of the exact functions."""

import math

import numpy as np
import pytest
from tvm import relax

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
