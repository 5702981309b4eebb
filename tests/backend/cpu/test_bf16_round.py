"""bf16_round: fp32 -> bfloat16 casts of scheduled CPU functions round on `vcvtneps2bf16`."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import te
from tvm.script import ir as I
from tvm.script import tirx as T

from relay_amp import targets
from relay_amp.backend.cpu.bf16_round import (ROUND_OP, DropRegisterRoundTrips, NativeBF16Rounding, lanes_of,
                                              rounding_passes)

from pass_checks import assert_transforms

BF16_HOST = pytest.mark.skipif(not targets.host_supports("avx512_bf16"), reason="host CPU lacks avx512_bf16")
BF16_TARGET = targets.get_target("cpu-avx512-bf16")


def test_fp32_to_bf16_casts_in_vector_loops_become_the_rounding_op_and_other_casts_stay():
    @I.ir_module
    class Before:
        @T.prim_func(s_tir=True)
        def main(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "bfloat16"), c: T.Buffer((16,), "float32"),
                 d: T.Buffer((16,), "float16"), e: T.Buffer((16,), "bfloat16")):
            for i in T.vectorized(16):
                with T.sblock("cast"):
                    v = T.axis.spatial(16, i)
                    b[v] = T.Cast("bfloat16", a[v] * T.float32(2))
                    c[v] = T.Cast("float32", b[v])  # widening: TVM's shift is already one instruction
                    d[v] = T.Cast("float16", a[v])
            for i in range(16):  # scalar: LLVM's loop vectorizer widens TVM's integer rounding
                with T.sblock("scalar"):
                    v = T.axis.spatial(16, i)
                    e[v] = T.Cast("bfloat16", a[v])

    @I.ir_module
    class Expected:
        @T.prim_func(s_tir=True)
        def main(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "bfloat16"), c: T.Buffer((16,), "float32"),
                 d: T.Buffer((16,), "float16"), e: T.Buffer((16,), "bfloat16")):
            for i in T.vectorized(16):
                with T.sblock("cast"):
                    v = T.axis.spatial(16, i)
                    b[v] = T.reinterpret("bfloat16", T.call_intrin("uint16", ROUND_OP, a[v] * T.float32(2)))
                    c[v] = T.Cast("float32", b[v])
                    d[v] = T.Cast("float16", a[v])
            for i in range(16):
                with T.sblock("scalar"):
                    v = T.axis.spatial(16, i)
                    e[v] = T.Cast("bfloat16", a[v])

    assert_transforms(NativeBF16Rounding, Before, Expected)


def test_a_function_without_bf16_casts_is_returned_unchanged():
    @I.ir_module
    class Module:
        @T.prim_func(s_tir=True)
        def main(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float16")):
            for i in range(16):
                with T.sblock("cast"):
                    v = T.axis.spatial(16, i)
                    b[v] = T.Cast("float16", a[v])

    assert NativeBF16Rounding(Module)["main"].same_as(Module["main"])


def test_only_llvm_targets_with_avx512_bf16_round_natively():
    assert [p.info.name for p in rounding_passes(BF16_TARGET)] == ["DropRegisterRoundTrips", "NativeBF16Rounding"]
    skylake = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    assert [p.info.name for p in rounding_passes(skylake)] == ["DropRegisterRoundTrips"]
    assert rounding_passes(targets.get_target("cuda-tensorcore")) == []


def test_a_round_trip_through_bf16_in_registers_is_dropped_and_one_through_memory_stays():
    @I.ir_module
    class Before:
        @T.prim_func(s_tir=True)
        def main(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "bfloat16"), c: T.Buffer((16,), "float32")):
            for i in range(16):
                with T.sblock("silu"):
                    v = T.axis.spatial(16, i)
                    b[v] = T.Cast("bfloat16", a[v])
                    c[v] = T.Cast("float32", T.Cast("bfloat16", a[v] + T.float32(1))) * T.Cast("float32", b[v])

    @I.ir_module
    class Expected:
        @T.prim_func(s_tir=True)
        def main(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "bfloat16"), c: T.Buffer((16,), "float32")):
            for i in range(16):
                with T.sblock("silu"):
                    v = T.axis.spatial(16, i)
                    b[v] = T.Cast("bfloat16", a[v])
                    c[v] = (a[v] + T.float32(1)) * T.Cast("float32", b[v])  # b was stored: its rounding stays

    assert_transforms(DropRegisterRoundTrips, Before, Expected)


def test_lanes_of_counts_vector_lanes():
    assert lanes_of(tvm.tirx.const(1.0, "float32")) == 1
    assert lanes_of(tvm.tirx.Broadcast(tvm.tirx.const(1.0, "float32"), 8)) == 8


def _doubling_cast(lanes: int, size: int) -> tvm.IRModule:
    """b = bfloat16(a * 2) over `size` elements, `lanes` of them per vector (1: a scalar loop)."""
    a = te.placeholder((size,), "float32", name="a")
    b = te.compute((size,), lambda i: (a[i] * 2).astype("bfloat16"), name="b")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, b]))
    if lanes > 1:
        (loop,) = sch.get_loops(sch.get_sblock("b"))
        sch.vectorize(sch.split(loop, [None, lanes])[1])
    return sch.mod


@T.prim_func(s_tir=True)
def _scalar_rounding(a: T.Buffer((480,), "float32"), b: T.Buffer((480,), "bfloat16")):
    """What a vector loop's rounding becomes where TVM's vectorizer falls back to scalars."""
    for i in range(480):
        with T.sblock("b"):
            v = T.axis.spatial(480, i)
            b[v] = T.reinterpret("bfloat16", T.call_intrin("uint16", ROUND_OP, a[v] * T.float32(2)))


def _rounding_module(lanes: int) -> tvm.IRModule:
    if lanes == 1:
        return tvm.IRModule({"main": _scalar_rounding})
    return NativeBF16Rounding(_doubling_cast(lanes, 480))


def _assembly(lanes: int) -> str:
    return tvm.compile(_rounding_module(lanes), target=BF16_TARGET).mod.inspect_source("asm")


@pytest.mark.parametrize("lanes", [1, 4, 15, 16, 20, 32, 96])  # 15: one lane of padding
def test_every_vector_width_compiles_to_the_instruction_and_no_integer_rounding(lanes):
    assembly = _assembly(lanes)
    whole_pairs = lanes % 32 == 0
    assert ("vcvtne2ps2bf16" in assembly) == whole_pairs  # two registers into one, where the lanes are whole 32s
    assert ("vcvtneps2bf16" in assembly) != whole_pairs
    assert "vpsrld" not in assembly  # TVM's integer rounding shifts the fp32 bits right by 16


def test_a_scalar_loop_keeps_integer_rounding_for_llvm_to_vectorize():
    assembly = tvm.compile(NativeBF16Rounding(_doubling_cast(1, 480)), target=BF16_TARGET).mod.inspect_source("asm")
    assert "vcvtneps2bf16" not in assembly
    assert "vpsrld" in assembly


@BF16_HOST
@pytest.mark.parametrize("lanes", [1, 4, 15, 16, 20, 32, 96])  # 15: one lane of padding; 32, 96: in pairs
def test_rounding_matches_round_to_nearest_even(lanes):
    values = np.random.default_rng(lanes).standard_normal(480).astype("float32") * 1000
    values[:6] = [np.nan, np.inf, -np.inf, 0.0, 1.00390625, 1.01171875]  # the last two are ties: round to even
    lib = tvm.compile(_rounding_module(lanes), target=BF16_TARGET)
    out = tvm.runtime.empty((480,), "bfloat16", tvm.cpu())
    lib["main"](tvm.runtime.tensor(values), out)
    expected = (values * 2).astype(ml_dtypes.bfloat16)
    got = out.numpy()
    assert np.isnan(got[0].astype("float32"))
    np.testing.assert_array_equal(got[1:].view("uint16"), expected[1:].view("uint16"))
