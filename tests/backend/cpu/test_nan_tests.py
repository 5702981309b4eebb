"""nan_tests: isnan in scheduled functions as a test of the bits, so that a vector loop selecting on it stays one."""

import numpy as np
import tvm
from tvm.script import tirx as T

from relay_amp import targets
from relay_amp.backend.cpu import nan_tests

from pass_checks import assert_transforms


@T.prim_func(private=True, s_tir=True)
def _guard(p: T.Buffer((64,), "float32"), zero: T.Buffer((), "float32"), out: T.Buffer((64,), "float32")):
    for block in range(4):
        for lane in T.vectorized(16):
            with T.sblock("where"):
                v = T.axis.spatial(64, block * 16 + lane)
                out[v] = T.Select(T.isnan(p[v]), zero[()], p[v])


@T.prim_func(private=True, s_tir=True)
def _guard_by_bits(p: T.Buffer((64,), "float32"), zero: T.Buffer((), "float32"),
                      out: T.Buffer((64,), "float32")):
    for block in range(4):
        for lane in T.vectorized(16):
            with T.sblock("where"):
                v = T.axis.spatial(64, block * 16 + lane)
                out[v] = T.Select(T.bitwise_and(T.reinterpret("int32", p[v]), 0x7FFFFFFF) > 0x7F800000, zero[()], p[v])


def test_a_nan_test_becomes_a_test_of_the_bits():
    assert_transforms(nan_tests.NanTestsAsBitTests, tvm.IRModule({"main": _guard}),
                      tvm.IRModule({"main": _guard_by_bits}))


def test_a_function_without_nan_tests_is_returned_as_it_is():
    module = tvm.IRModule({"main": _guard_by_bits})
    assert nan_tests.NanTestsAsBitTests(module)["main"].same_as(module["main"])


def test_the_guard_builds_as_vectors_and_zeroes_only_the_nans():
    """TVM scalarized the loop selecting on isnan: a compare and a branch per lane (vucomiss)."""
    target = targets.get_target("cpu")
    module = nan_tests.NanTestsAsBitTests(tvm.IRModule({"main": _guard.with_attr("global_symbol", "main")}))
    built = tvm.compile(module, target=target)
    assert "vucomiss" not in built.mod.inspect_source("asm")
    values = np.random.default_rng(0).standard_normal(64).astype("float32")
    values[[3, 40]] = np.nan
    values[7] = np.inf
    out = tvm.runtime.empty((64,), "float32")
    built["main"](tvm.runtime.tensor(values), tvm.runtime.tensor(np.zeros((), "float32")), out)
    np.testing.assert_array_equal(out.numpy(), np.where(np.isnan(values), 0.0, values))
