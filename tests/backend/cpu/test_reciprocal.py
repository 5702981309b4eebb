"""reciprocal: fast math's quotients in vector loops run on `vrcp14ps` where the target has AVX-512, and divide
elsewhere, within the accuracy their results need."""

import math

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax, te
from tvm.script import ir as I
from tvm.script import tirx as T

from relay_amp import targets
from relay_amp.backend.cpu import formula
from relay_amp.compile.build import build
from relay_amp.runtime import run_executable
from relay_amp.backend.cpu.reciprocal import (ESTIMATE, FAST_DIVIDE, NARROW_DIVIDE, ReciprocalEstimates, divide,
                                              reciprocal_passes)

from builders import single_output_module, tensor
from pass_checks import assert_transforms

AVX512_HOST = pytest.mark.skipif(not targets.host_supports("avx512f"), reason="host CPU lacks AVX-512")
BF16_HOST = pytest.mark.skipif(not targets.host_supports("avx512_bf16"), reason="host CPU lacks avx512_bf16")
AVX512_TARGET = targets.get_target("cpu-avx512-bf16")


def test_quotients_in_vector_loops_become_products_with_the_estimate_and_others_stay():
    @I.ir_module
    class Before:
        @T.prim_func(s_tir=True)
        def main(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32"), c: T.Buffer((16,), "float32"),
                 d: T.Buffer((16,), "float32")):
            for i in T.vectorized(16):
                with T.sblock("vector"):
                    v = T.axis.spatial(16, i)
                    b[v] = T.call_intrin("float32", FAST_DIVIDE, a[v], a[v] + T.float32(1))
                    c[v] = T.call_intrin("float32", NARROW_DIVIDE, T.float32(1), a[v])
            for i in range(16):  # scalar: the op's lowering divides
                with T.sblock("scalar"):
                    v = T.axis.spatial(16, i)
                    d[v] = T.call_intrin("float32", FAST_DIVIDE, a[v], T.float32(3))

    @I.ir_module
    class Expected:
        @T.prim_func(s_tir=True)
        def main(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32"), c: T.Buffer((16,), "float32"),
                 d: T.Buffer((16,), "float32")):
            for i in T.vectorized(16):
                with T.sblock("vector"):
                    v = T.axis.spatial(16, i)
                    b[v] = a[v] * (T.call_intrin("float32", ESTIMATE, a[v] + T.float32(1)) * (
                        T.float32(2) - (a[v] + T.float32(1)) * T.call_intrin("float32", ESTIMATE, a[v] + T.float32(1))))
                    c[v] = T.float32(1) * T.call_intrin("float32", ESTIMATE, a[v])  # narrow: no Newton step
            for i in range(16):
                with T.sblock("scalar"):
                    v = T.axis.spatial(16, i)
                    d[v] = T.call_intrin("float32", FAST_DIVIDE, a[v], T.float32(3))

    assert_transforms(ReciprocalEstimates, Before, Expected)


def test_only_llvm_targets_with_avx512_estimate_reciprocals():
    assert [p.info.name for p in reciprocal_passes(AVX512_TARGET)] == ["ReciprocalEstimates"]
    assert [p.info.name for p in reciprocal_passes(targets.get_target("cpu-amx"))] == ["ReciprocalEstimates"]
    assert reciprocal_passes(tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})) == []
    assert reciprocal_passes(targets.get_target("cuda-tensorcore")) == []


def _quotients(lanes: int, narrow: bool, estimated: bool) -> tvm.IRModule:
    """c = a / b over 480 elements by reciprocal.divide, `lanes` of them per vector (1: a scalar loop)."""
    a, b = te.placeholder((480,), "float32", name="a"), te.placeholder((480,), "float32", name="b")
    c = te.compute((480,), lambda i: divide(a[i], b[i], narrow), name="c")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, b, c]))
    if lanes > 1:
        (loop,) = sch.get_loops(sch.get_sblock("c"))
        sch.vectorize(sch.split(loop, [None, lanes])[1])
    return ReciprocalEstimates(sch.mod) if estimated else sch.mod


@pytest.mark.parametrize("lanes", [1, 8, 15, 16, 32])  # 15: one lane of padding; 32: two registers
def test_every_vector_width_compiles_to_the_estimate_and_a_scalar_loop_divides(lanes):
    assembly = tvm.compile(_quotients(lanes, False, True), target=AVX512_TARGET).mod.inspect_source("asm")
    assert ("vrcp14ps" in assembly) == (lanes > 1)
    assert ("vdivps" in assembly or "vdivss" in assembly) == (lanes == 1)


def test_without_the_pass_the_ops_divide_exactly():
    assembly = tvm.compile(_quotients(16, True, False), target=AVX512_TARGET).mod.inspect_source("asm")
    assert "vrcp14ps" not in assembly and "vdivps" in assembly


@AVX512_HOST
@pytest.mark.parametrize("lanes", [1, 15, 16, 32])
@pytest.mark.parametrize("narrow, tolerance", [(False, 3e-7), (True, 2 ** -14)])
def test_estimated_quotients_are_within_their_tolerance(lanes, narrow, tolerance):
    rng = np.random.default_rng(lanes)
    numerators = rng.standard_normal(480).astype("float32") * 10
    denominators = (1 + np.exp(rng.uniform(-30, 30, 480))).astype("float32")  # a sigmoid's 1 + e^-x
    lib = tvm.compile(_quotients(lanes, narrow, True), target=AVX512_TARGET)
    out = tvm.runtime.empty((480,), "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(numerators), tvm.runtime.tensor(denominators), out)
    expected = numerators.astype("float64") / denominators
    assert np.all(np.abs(out.numpy() - expected) <= tolerance * np.abs(expected) + 1e-37)


def test_fast_sigmoids_and_silus_divide_by_the_fast_op_and_narrow_results_by_the_narrow_one():
    silu = formula.activation("relax.nn.silu", formula.X, fast=True)
    sigmoid = formula.activation("relax.sigmoid", formula.X, fast=True)
    assert silu[0] == sigmoid[0] == "fast_divide"
    assert formula.narrowed(silu)[0] == formula.narrowed(sigmoid)[0] == "narrow_divide"
    assert formula.narrowed(silu, requantized=True)[0] == "fast_divide"  # 8-bit codes: their rounding needs it
    assert formula.activation("relax.sigmoid", formula.X, fast=False)[0] == "divide"  # fast math off: exact


ERF = np.vectorize(math.erf)
EXACT = {  # float64 references of the functions whose fast forms divide
    "relax.erf": ERF,
    "relax.sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "relax.nn.silu": lambda x: x / (1 + np.exp(-x)),
    "relax.nn.gelu": lambda x: x * 0.5 * (1 + ERF(x / math.sqrt(2))),
    "relax.tanh": np.tanh,
    "relax.nn.gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
}
RELATIVE = {"float32": 2e-6, "bfloat16": 8e-3}  # the fp32 polynomials' error; one rounding to bf16


@BF16_HOST
@pytest.mark.parametrize("dtype", list(RELATIVE))
@pytest.mark.parametrize("name", list(EXACT))
def test_functions_on_the_estimate_match_the_exact_ones(name, dtype):
    """Built for an AVX-512 target (the quotients on vrcp14ps): each value within the bounds fastmath's own
    functions keep on the division (tests/backend/cpu/test_fastmath.py)."""
    op = {"relax.erf": relax.op.erf, "relax.sigmoid": relax.op.sigmoid, "relax.nn.silu": relax.op.nn.silu,
          "relax.nn.gelu": relax.op.nn.gelu, "relax.tanh": relax.op.tanh,
          "relax.nn.gelu_tanh": relax.op.nn.gelu_tanh}[name]
    executable = build(single_output_module(op, tensor("x", (4, 64), dtype)), "cpu-avx512-bf16")
    assert "vrcp14ps" in executable.mod.imports[0].inspect_source("asm")
    x = np.linspace(-9, 9, 256, dtype="float32").reshape(4, 64).astype(ml_dtypes.bfloat16 if dtype != "float32"
                                                                        else np.float32)
    got = run_executable(executable, [x])[0].astype("float64")
    expected = EXACT[name](x.astype("float64"))
    assert np.all(np.abs(got - expected) <= RELATIVE[dtype] * np.abs(expected) + 2e-6 * np.abs(expected).max())
