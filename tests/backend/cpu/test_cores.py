"""The cores a CPU target names, and the dtypes whose dot products the CPU backend computes on fp32's kernels there."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax, s_tir
from tvm.s_tir.dlight.analysis import get_root_block

from relay_amp import targets
from relay_amp.backend.cpu import cores, dispatch, kernels
from relay_amp.compile.build import build
from relay_amp.compile.tuning import prepare
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor

BF16 = "bfloat16"


def _llvm(mcpu: str, model: str | None = None) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu, **({"model": model} if model else {})})


def test_a_target_names_its_core_by_model_else_by_mcpu():
    assert cores.target_core(_llvm(targets.BF16_CPU, "emeraldrapids")) == "emeraldrapids"
    assert cores.target_core(_llvm("znver4")) == "znver4"
    assert cores.target_core(tvm.target.Target("llvm")) == ""


def test_a_targets_cores_are_its_num_cores_given_or_current_else_none():
    four = tvm.target.Target({"kind": "llvm", "num-cores": 4})
    assert cores.target_cores(four) == 4
    assert cores.target_cores(tvm.target.Target("llvm")) == 0
    with four:
        assert cores.target_cores() == 4
    assert cores.target_cores() == 0


@pytest.mark.parametrize("target, slow", [(_llvm(targets.BF16_CPU, "emeraldrapids"), {BF16}),
                                          (_llvm("sapphirerapids"), {BF16}),
                                          (_llvm(targets.BF16_CPU, "znver4"), set()),
                                          (_llvm(targets.BF16_CPU), set())])
def test_slow_dtypes_are_those_of_the_cores_whose_bf16_dot_is_half_rate(target, slow):
    assert cores.slow_dtypes(target) == slow


@pytest.mark.parametrize("target, splits", [(_llvm(targets.BF16_CPU, "znver4"), True), (_llvm("znver4"), True),
                                            (_llvm(targets.BF16_CPU, "znver5"), False),
                                            (_llvm(targets.BF16_CPU, "emeraldrapids"), False),
                                            (_llvm("haswell"), False)])
def test_only_zen4_computes_an_avx512_fma_in_two_halves(target, splits):
    assert cores.splits_avx512(target) == splits


def test_kernel_dtypes_drop_a_slow_dot_unless_amx_tiles_take_its_dtype():
    """Emerald Rapids without AMX computes bf16 on fp32's kernels; with AMX (the cpu-amx preset's Sapphire Rapids),
    its tiles take bf16 and the AVX-512 kernels keep vdpbf16ps for the shapes they do not fit."""
    full = {"float32", BF16, "int8", "uint8"}
    assert dispatch.kernel_dtypes(_llvm(targets.BF16_CPU, "znver5")) == full
    assert dispatch.kernel_dtypes(_llvm(targets.BF16_CPU, "emeraldrapids")) == full - {BF16}
    assert dispatch.kernel_dtypes(_llvm(targets.AMX_CPU)) == full


def _dots(mod: tvm.IRModule) -> list[str]:
    """The dot-product instructions of the kernels in a prepared module, by name."""
    found = []
    for func in mod.functions.values():
        if isinstance(func, tvm.tirx.PrimFunc):
            sch = s_tir.Schedule(func)
            specs = [kernels.kernel_spec(sch, block) for block in sch.get_child_blocks(get_root_block(sch))]
            found += [spec.dot.name for spec in specs if spec is not None]
    return found


def test_a_bf16_matmul_built_for_a_core_with_a_slow_bf16_dot_runs_on_the_fp32_kernel():
    """The same bf16 module, prepared for Emerald Rapids, widens its matmul onto the fp32 FMA kernel; for Zen 5 it
    keeps vdpbf16ps. Both match fp32 sums of the bf16 values within one bf16 rounding of the output."""
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((64, 48)).astype(ml_dtypes.bfloat16)
    mod = single_output_module(lambda x: relax.op.matmul(x, relax.const(weight)), tensor("x", (1, 12, 64), BF16))
    slow, fast = _llvm(targets.BF16_CPU, "emeraldrapids"), _llvm(targets.BF16_CPU, "znver5")
    assert _dots(prepare(mod, slow)) == [kernels.FP32_FMA.name]
    assert _dots(prepare(mod, fast)) == [kernels.BF16_DOT.name]
    if not targets.host_supports("avx512_bf16"):
        pytest.skip("host CPU lacks avx512_bf16")
    data = rng.standard_normal((1, 12, 64)).astype(ml_dtypes.bfloat16)
    exact = data.astype("float32") @ weight.astype("float32")
    for target in (slow, fast):
        got = run_executable(build(mod, target), [data])[0].astype("float32")
        np.testing.assert_allclose(got, exact, rtol=2 ** -8, atol=1e-5)
