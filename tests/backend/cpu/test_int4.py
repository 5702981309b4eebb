"""int4: the CPU kernels of weight-only int4 matmuls (vdpbf16ps on packed nibbles, or the generic loop)."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import targets
from relay_amp.backend.cpu import int4
from relay_amp.backend.cpu.int4 import UsePackedInt4Kernels
from relay_amp.compile.build import build
from relay_amp.packed_int4 import PackedSpec, reference_kernel, spec_of
from relay_amp.passes.weight_only import quantize_int4, quantize_weights
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor

RNG = np.random.default_rng(1)
BF16_TARGET = "cpu-avx512-bf16"


def _packed_module(rows: int, depth: int, columns: int, dtype: str, group: int = 64):
    weight = RNG.standard_normal((depth, columns)).astype("float32")
    mod = single_output_module(lambda x: relax.op.matmul(x, relax.const(weight)), tensor("x", (rows, depth)))
    if dtype == "bfloat16":
        mod = relay_amp.to_mixed_precision(mod, dtype)
        weight = weight.astype(ml_dtypes.bfloat16).astype("float32")
    return quantize_weights(mod, group_size=group), weight


def _expected(x: np.ndarray, weight: np.ndarray, dtype: str, group: int = 64) -> np.ndarray:
    codes, scales = quantize_int4(weight, group)
    depth, columns = weight.shape
    dequantized = (codes.reshape(depth // group, group, columns) * scales[:, None]).reshape(depth, columns)
    data = x.astype(ml_dtypes.bfloat16).astype("float32") if dtype == "bfloat16" else x
    return data.astype("float64") @ dequantized


def test_the_bf16_kernel_is_chosen_for_bf16_activations_on_avx512_bf16():
    spec = PackedSpec(1, 256, 64, 64, "bfloat16", "float32")
    bf16 = int4.kernel_for(spec, targets.get_target(BF16_TARGET))
    assert int4.symbol(int4.panels_for(spec)) in bf16.script()
    skylake = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})  # AVX-512 without bf16
    for other_spec, target in [(spec, skylake),
                               (PackedSpec(1, 256, 64, 64, "float32", "float32"), targets.get_target(BF16_TARGET))]:
        generic = int4.kernel_for(other_spec, target)
        assert "relay_amp_int4_bf16" not in generic.script()
        assert generic.attrs["tirx.is_scheduled"]


def test_rows_share_each_unpacked_word_in_blocks_and_the_rest_go_one_at_a_time():
    spec = PackedSpec(10, 256, 256, 64, "bfloat16", "float32")
    panels = int4.panels_for(spec)
    script = int4.kernel_for(spec, targets.get_target(BF16_TARGET)).script(show_meta=True)
    assert int4.rows_per_call(panels) == 8 and f"{int4.symbol(panels, 8)}(" in script
    assert f"{int4.symbol(panels, 1)}(" in script  # the 2 rows past the block of 8
    one_row = int4.llvm_ir(panels, 1)
    assert one_row.count("dpbf16ps.512(") == 4 * panels and one_row.count("fadd") == panels  # two chains per block
    eight_rows = int4.llvm_ir(panels, 8)
    assert eight_rows.count("dpbf16ps.512(") == 4 * panels * 8 and eight_rows.count("lshr") == 3 * panels


def test_panels_keep_enough_parallel_items():
    assert int4.panels_for(PackedSpec(1, 64, 4096, 64, "bfloat16", "float32")) == 4
    assert int4.panels_for(PackedSpec(1, 64, 256, 64, "bfloat16", "float32")) == 2
    assert int4.panels_for(PackedSpec(1, 64, 48, 64, "bfloat16", "float32")) == 1


def test_the_cpu_pass_swaps_every_reference_for_a_scheduled_kernel():
    mod, _ = _packed_module(2, 128, 32, "float32")
    after = UsePackedInt4Kernels(targets.get_target("cpu"))(mod)
    kernels = [f for _, f in after.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 1 and kernels[0].attrs["tirx.is_scheduled"] and spec_of(kernels[0]) is None
    assert spec_of(next(f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))) is not None


def test_the_reference_stays_out_of_operator_fusion():
    assert int(reference_kernel(PackedSpec(1, 64, 16, 64, "float32", "float32")).attrs["op_pattern"]) == 8


@pytest.mark.parametrize("rows, depth, columns, group", [(1, 256, 64, 64), (3, 128, 32, 64), (10, 256, 256, 64),
                                                        (1, 512, 1024, 64), (37, 96, 128, 32), (6, 48, 64, 24)])
def test_bf16_kernel_matches_the_dequantized_product(rows, depth, columns, group):
    if not targets.host_supports("avx512_bf16"):
        pytest.skip("the host has no avx512_bf16")
    mod, weight = _packed_module(rows, depth, columns, "bfloat16", group)
    x = RNG.standard_normal((rows, depth)).astype("float32")
    (got,) = run_executable(build(mod, BF16_TARGET), [x])
    expected = _expected(x, weight, "bfloat16", group)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generic_kernel_matches_the_dequantized_product(dtype):
    mod, weight = _packed_module(3, 128, 48, dtype)
    x = RNG.standard_normal((3, 128)).astype("float32")
    (got,) = run_executable(build(mod, "cpu"), [x])
    expected = _expected(x, weight, dtype)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
