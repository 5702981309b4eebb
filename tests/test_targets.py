"""Target presets and host feature checks."""

import pytest
import tvm

import relay_amp
from relay_amp import targets


@pytest.mark.parametrize("preset, kind", [("cpu", "llvm"), ("cpu-avx512-bf16", "llvm"), ("cpu-amx", "llvm"),
                                          ("cuda-tensorcore", "cuda"), ("cuda-tensorcore-sm90", "cuda")])
def test_presets_are_targets(preset, kind):
    target = targets.get_target(preset)
    assert isinstance(target, tvm.target.Target) and target.kind.name == kind


def test_bf16_preset_uses_a_cpu_with_avx512_bf16_and_vnni():
    target = targets.get_target("cpu-avx512-bf16")
    assert tvm.target.codegen.target_has_features(["avx512bf16", "avx512vnni"], target)
    assert str(targets.get_target("cuda-tensorcore").attrs["arch"]) == "sm_80"
    assert tvm.target.codegen.target_has_features(["amx-tile", "amx-bf16", "avx512bf16"], targets.get_target("cpu-amx"))


def test_unknown_preset_is_a_target_error():
    with pytest.raises(relay_amp.TargetError, match="gpu-fast"):
        targets.get_target("gpu-fast")


def test_host_supports_reads_cpu_flags():
    assert targets.host_supports("sse2")
    assert not targets.host_supports("no_such_feature")


def test_bf16_preset_on_a_cpu_without_bf16_is_refused_unless_forced(monkeypatch):
    monkeypatch.setattr(targets, "host_supports", lambda feature: False)
    monkeypatch.delenv(targets.FORCE_BF16_ENV, raising=False)
    with pytest.raises(relay_amp.TargetError, match="avx512_bf16"):
        targets.check_host("cpu-avx512-bf16")
    monkeypatch.setenv(targets.FORCE_BF16_ENV, "1")
    with pytest.warns(UserWarning, match="RELAY_AMP_FORCE_BF16"):
        targets.check_host("cpu-avx512-bf16")
    targets.check_host("cpu")


def test_host_preset_follows_cpu_features(monkeypatch):
    monkeypatch.setattr(targets, "host_supports", lambda feature: True)
    monkeypatch.setattr(targets, "host_runs_amx", lambda: True)
    assert targets.host_preset() == "cpu-amx"
    monkeypatch.setattr(targets, "host_runs_amx", lambda: False)  # the CPU has tiles; Linux does not grant them
    assert targets.host_preset() == "cpu-avx512-bf16"
    monkeypatch.setattr(targets, "host_supports", lambda feature: not feature.startswith("amx"))
    assert targets.host_preset() == "cpu-avx512-bf16"
    monkeypatch.setattr(targets, "host_supports", lambda feature: feature != "avx512_vnni")
    assert targets.host_preset() == "cpu"


def test_a_host_without_amx_tiles_runs_no_amx(monkeypatch):
    monkeypatch.setattr(targets, "host_supports", lambda feature: feature != "amx_tile")
    assert targets.host_runs_amx.__wrapped__() is False


def test_cpu_presets_name_the_host_core_as_their_model_unless_told_otherwise(monkeypatch):
    """The presets' targets carry the host's core (LLVM's name) for the backend's per-core choices;
    RELAY_AMP_CPU_MODEL names another, and empty names none (the test suite's setting)."""
    monkeypatch.delenv(targets.CPU_MODEL_ENV, raising=False)
    host = tvm.target.codegen.llvm_get_system_cpu()
    assert targets.host_model() == host
    assert str(targets.get_target("cpu-avx512-bf16").attrs["model"]) == host
    assert str(targets.get_target("cpu-avx512-bf16").attrs["mcpu"]) == targets.BF16_CPU
    monkeypatch.setenv(targets.CPU_MODEL_ENV, "znver5")
    assert str(targets.get_target("cpu").attrs["model"]) == "znver5"
    monkeypatch.setenv(targets.CPU_MODEL_ENV, "")
    assert "model" not in targets.get_target("cpu-amx").attrs


def test_the_cpu_preset_turns_off_the_features_its_core_names_that_the_host_cannot_run(monkeypatch):
    """A host whose core has AMX tiles that Linux does not grant (or a hypervisor hides) gets a `cpu` target
    without them, so no AMX kernel is built for it."""
    monkeypatch.setattr(targets.tvm.target.codegen, "llvm_get_system_cpu", lambda: "sapphirerapids")
    monkeypatch.setattr(targets, "host_runs_amx", lambda: False)
    target = targets.get_target("cpu")
    assert str(target.attrs["mcpu"]) == "sapphirerapids"
    assert not tvm.target.codegen.target_has_features("amx-tile", target)
    assert tvm.target.codegen.target_has_features("avx512f", target) == targets.host_supports("avx512f")


@pytest.mark.parametrize("target, seven", [({"kind": "llvm", "mcpu": "znver3"}, True),
                                           ({"kind": "llvm", "mcpu": "haswell"}, True),
                                           ({"kind": "llvm", "mcpu": "alderlake"}, False),  # AVX-VNNI
                                           ({"kind": "llvm", "mcpu": "skylake-avx512"}, False),
                                           ({"kind": "llvm", "mcpu": "sandybridge"}, False),  # no AVX2
                                           ({"kind": "cuda", "arch": "sm_80"}, False)])
def test_seven_bit_codes_pay_on_avx2_without_vnni_or_avx512(target, seven):
    assert targets.seven_bit_codes(tvm.target.Target(target)) is seven
    with tvm.target.Target(target):
        assert targets.seven_bit_codes() is seven


@pytest.mark.parametrize("target, int8", [({"kind": "llvm", "mcpu": "znver4"}, True),
                                          ({"kind": "llvm", "mcpu": "sapphirerapids"}, True),
                                          ({"kind": "llvm", "mcpu": "cascadelake"}, True),  # AVX-512 VNNI
                                          ({"kind": "llvm", "mcpu": "skylake-avx512"}, False),
                                          ({"kind": "llvm", "mcpu": "alderlake"}, False),  # AVX-VNNI only
                                          ({"kind": "cuda", "arch": "sm_80"}, False)])
def test_expert_products_are_int8_where_the_expert_kernel_has_avx512_vnni(target, int8):
    assert targets.int8_expert_products(tvm.target.Target(target)) is int8
    with tvm.target.Target(target):
        assert targets.int8_expert_products() is int8
