"""amx_experts: a mixture of experts' routed bf16 rows times their own expert's weight on AMX tiles, chosen where
the target computes bf16 on AMX, equal to the dense product's rows."""

import ml_dtypes
import numpy as np
import pytest
import tvm

import relay_amp
from relay_amp import targets
from relay_amp.backend.cpu import amx_experts, experts
from relay_amp.backend.cpu.experts import ExpertSpec, GroupedExpertMatmuls
from relay_amp.runtime import run_executable

from builders import expert_kernel_call, taken_expert_rows
from pass_checks import assert_transforms

EXPERTS, TOKENS, DEPTH, COLUMNS = 4, 40, 64, 64  # depths: two 64-byte tile rows; columns: two 32-column panels
AMX = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}
RNG = np.random.default_rng(0)
WEIGHT = RNG.standard_normal((DEPTH, EXPERTS * COLUMNS)).astype(ml_dtypes.bfloat16)
BF16_AMX = frozenset({"bfloat16"})


@pytest.mark.parametrize("dtype, depth, columns, amx_dtypes, computed", [
    ("bfloat16", 64, 64, BF16_AMX, True),
    ("bfloat16", 32, 32, BF16_AMX, True),  # one 64-byte tile row, one panel
    ("bfloat16", 64, 48, BF16_AMX, False),  # a panel of 16 columns left over
    ("bfloat16", 40, 64, BF16_AMX, False),  # 80 bytes: not whole tile rows
    ("bfloat16", 64, 64, frozenset(), False),  # the target has no AMX bf16
    ("float32", 64, 64, BF16_AMX, False),
])
def test_supports_whole_panels_and_tile_rows_of_bf16_on_amx_targets(dtype, depth, columns, amx_dtypes, computed):
    assert amx_experts.supports(dtype, depth, columns, amx_dtypes) is computed


@pytest.mark.parametrize("experts_count, panels, per_item", [(64, 16, 16), (32, 4, 4), (4, 16, 2), (8, 3, 1)])
def test_an_item_takes_all_an_experts_panels_unless_few_experts_leave_too_few_items(experts_count, panels, per_item):
    assert amx_experts._panels_per_item(experts_count, panels) == per_item


def _spec(rows: int, stored: str, amx: bool = True) -> ExpertSpec:
    return ExpertSpec(TOKENS, DEPTH, EXPERTS, COLUMNS, rows, "bfloat16", stored, "int64", 2, amx=amx)


def _grouped(rows: int, stored: str) -> tvm.IRModule:
    """What the pass writes on an AMX target: one call of the AMX kernel on x, the index and the packed weight."""
    return expert_kernel_call(taken_expert_rows(WEIGHT, EXPERTS, TOKENS, rows, stored), _spec(rows, stored), WEIGHT)


def test_an_amx_target_takes_bf16_rows_to_the_amx_kernel():
    """On Sapphire Rapids the bf16 take is one call of the AMX kernel (its spec marked `amx`), on the same packed
    weight as the dot-product kernel's."""
    with tvm.target.Target(AMX):
        assert_transforms(GroupedExpertMatmuls(), taken_expert_rows(WEIGHT, EXPERTS, TOKENS, 9, "bfloat16"),
                          _grouped(9, "bfloat16"))
    assert "tdpbf16ps" not in experts.expert_kernel(_spec(9, "bfloat16", amx=False)).script()


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_the_built_amx_kernel_stores_each_taken_rows_own_product(stored):
    """Built by relay_amp for cpu-amx: 70 rows of expert 1 (two full scratches of 32 rows, then 6), none of expert
    3, a token taken twice by one expert, rows in no order; within 1e-2 of the largest output (bf16 operands
    exact, fp32 sums, a bf16 output rounded once)."""
    tokens_of = np.concatenate([RNG.permutation(TOKENS)[:35], RNG.permutation(TOKENS)[:35], [5, 5, 7, 9, 11]])
    experts_of = np.array([1] * 70 + [0, 0, 2, 2, 0])
    index = (tokens_of * EXPERTS + experts_of).astype("int64")[RNG.permutation(75)]
    executable = relay_amp.build(taken_expert_rows(WEIGHT, EXPERTS, TOKENS, len(index), stored),
                                 targets.get_target("cpu-amx"))  # a Target: built on any host, run where AMX is
    assert "tdpbf16ps" in executable.mod.imports[0].inspect_source("asm")
    if not targets.host_runs_amx():
        pytest.skip("host CPU (or kernel) has no AMX: the code is checked, not run")
    x = RNG.standard_normal((TOKENS, DEPTH)).astype(ml_dtypes.bfloat16)
    expected = (x.astype("float64") @ WEIGHT.astype("float64")).reshape(TOKENS * EXPERTS, COLUMNS)[index]
    got = run_executable(executable, [x, index])[0].astype("float64")
    assert np.abs(got - expected).max() <= 1e-2 * np.abs(expected).max()
