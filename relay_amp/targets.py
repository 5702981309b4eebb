"""Target presets as tvm.target.Target objects, and what the host CPU can run."""

import functools
import os
import warnings
from pathlib import Path

import tvm
import tvm_ffi

from .errors import TargetError

FORCE_BF16_ENV = "RELAY_AMP_FORCE_BF16"
CPU_MODEL_ENV = "RELAY_AMP_CPU_MODEL"  # the core the CPU presets build for; unset: the host's; empty: none named
BF16_CPU = "cooperlake"  # the first x86 CPU with avx512_bf16 and avx512_vnni; Zen 4 and Sapphire Rapids extend it
AMX_CPU = "sapphirerapids"  # the first with AMX tiles (bf16 and int8) and avx512_fp16
# Linux's arch_prctl request for AMX tile state, which a process needs before its first tile instruction
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


def host_cpus() -> list[int]:
    """The logical CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def host_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyperthreads of one core counted once): the threads
    relay_amp's runs and its benchmarks' peers use."""
    return len({_core_of(cpu) for cpu in host_cpus()})


def _core_of(cpu: int) -> tuple[str, str]:
    """(package, core) of a logical CPU from Linux's topology files; the CPU itself where they cannot be read."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()
    except OSError:
        return "cpu", str(cpu)


def host_model() -> str:
    """The core the CPU presets' targets name as their `model`, for the backend's choices their instruction set
    alone does not settle (relay_amp.backend.cpu.cores): RELAY_AMP_CPU_MODEL where it is set (empty: none), else
    the host's core as LLVM names it (emeraldrapids, znver5)."""
    return os.environ.get(CPU_MODEL_ENV, tvm.target.codegen.llvm_get_system_cpu())


def _llvm(mcpu: str, mattr: "list[str] | None" = None) -> tvm.target.Target:
    """An llvm target of `mcpu`'s instructions (less those `mattr` turns off), for the host's cores (`host_model`)
    and threads."""
    model = host_model()
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": host_cores(),
                              **({"mattr": mattr} if mattr else {}), **({"model": model} if model else {})})


def _host_cpu() -> tvm.target.Target:
    """The host's own core, less the features its name claims that this host cannot run: AMX tiles that a
    hypervisor hides or Linux does not grant (an Emerald Rapids VM without them died of SIGILL in AMX kernels)."""
    mcpu = tvm.target.codegen.llvm_get_system_cpu()
    named = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    usable = {name: bool(on) for name, on in tvm_ffi.get_global_func("tvm.codegen.llvm.GetHostCPUFeatures")().items()}
    if not host_runs_amx():
        usable.update(dict.fromkeys((name for name in usable if name.startswith("amx-")), False))
    missing = [name for name, on in usable.items()
               if not on and tvm.target.codegen.target_has_features(name, named)]
    return _llvm(mcpu, [f"-{name}" for name in sorted(missing)])


def _cuda(arch: str) -> tvm.target.Target:
    host = tvm.target.Target({"kind": "llvm"})
    return tvm.target.Target({"kind": "cuda", "arch": arch, "max_num_threads": 1024}, host=host)


PRESETS = {
    "cpu": _host_cpu,
    "cpu-avx512-bf16": lambda: _llvm(BF16_CPU),
    "cpu-amx": lambda: _llvm(AMX_CPU),
    "cuda-tensorcore": lambda: _cuda("sm_80"),
    "cuda-tensorcore-sm90": lambda: _cuda("sm_90"),
}
PRESET_FEATURES = {
    "cpu-avx512-bf16": ("avx512_bf16", "avx512_vnni"),
    "cpu-amx": ("avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"),
}


def host_preset() -> str:
    """The fastest CPU preset this host can run: cpu-amx (where Linux grants the tiles too), cpu-avx512-bf16 or
    cpu, by the CPU's features."""
    for preset in ("cpu-amx", "cpu-avx512-bf16"):
        if all(map(host_supports, PRESET_FEATURES[preset])) and (preset != "cpu-amx" or host_runs_amx()):
            return preset
    return "cpu"


def seven_bit_codes(target: "tvm.target.Target | None" = None) -> bool:
    """Whether quantized activations should be 7-bit codes for `target` (the current one, else the host's preset):
    an x86 llvm target with AVX2 and neither AVX-512 nor AVX-VNNI. Its byte product, vpmaddubsw, sums two uint8 x
    int8 products in int16, which codes up to 255 overflow (2 x 255 x 128) and codes under 128 cannot (2 x 127 x
    128 = 32512), so the CPU backend takes 7-bit codes in one byte (relay_amp.backend.cpu.kernels.AVX2_BYTE_DOT)
    where it widens 8-bit ones to int16 pairs (ResNet-50 int8q on Zen 3: 0.77x the time)."""
    target = _given_current_or_host(target)
    has = tvm.target.codegen.target_has_features
    return (target.kind.name == "llvm" and has("avx2", target)
            and not any(has(feature, target) for feature in ("avx512f", "avxvnni")))


def int8_expert_products(target: "tvm.target.Target | None" = None) -> bool:
    """Whether a mixture of experts' products run in int8 for `target` (the current one, else the host's preset): an
    llvm target with AVX-512 VNNI, whose vpdpbusd the CPU backend's grouped expert kernel computes them on, only for
    the routed rows (relay_amp.backend.cpu.experts); elsewhere int8 would compute every expert's products."""
    target = _given_current_or_host(target)
    return target.kind.name == "llvm" and tvm.target.codegen.target_has_features("avx512vnni", target)


def _given_current_or_host(target: "tvm.target.Target | None") -> tvm.target.Target:
    """`target` if given, else the current target, else the host's preset."""
    return target or tvm.target.Target.current(allow_none=True) or get_target(host_preset())


@functools.cache
def host_runs_amx() -> bool:
    """Whether this process may run AMX tile instructions: the CPU has them and Linux grants the tile state (it
    asks, as relay_amp's AMX kernels do on their first call)."""
    if not host_supports("amx_tile"):
        return False
    import ctypes  # pylint: disable=import-outside-toplevel

    try:
        return ctypes.CDLL(None).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def get_target(target: "str | tvm.target.Target") -> tvm.target.Target:
    """A Target from a preset name (see PRESETS) or an existing Target."""
    if isinstance(target, tvm.target.Target):
        return target
    if target not in PRESETS:
        raise TargetError(f"unknown target preset {target!r}; choose one of {sorted(PRESETS)} or pass a Target")
    return PRESETS[target]()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def host_supports(feature: str) -> bool:
    """Whether the host CPU has `feature`, named as /proc/cpuinfo names it (e.g. "avx512_bf16")."""
    return feature in _cpu_flags()


def check_host(preset: "str | tvm.target.Target") -> None:
    """Raise TargetError when the host lacks a CPU feature the preset needs (RELAY_AMP_FORCE_BF16=1 overrides)."""
    if not isinstance(preset, str):
        return
    missing = [f for f in PRESET_FEATURES.get(preset, ()) if not host_supports(f)]
    if not missing:
        return
    if os.environ.get(FORCE_BF16_ENV) == "1":
        warnings.warn(f"{FORCE_BF16_ENV}=1: building {preset!r} although this CPU lacks {missing}", stacklevel=2)
        return
    raise TargetError(f"target {preset!r} needs CPU features {missing} that this host lacks "
                      f"(set {FORCE_BF16_ENV}=1 to build anyway)")
