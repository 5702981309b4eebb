"""What the CPU backend knows of cores past their instruction set: the dtypes whose dot-product instruction computes
fewer products a cycle than fp32's FMA, and whether an AVX-512 FMA runs in two halves, on the core a target names
(its `model`, which relay_amp's presets set to the host's: relay_amp.targets.host_model)."""

import tvm

# Intel's Xeon cores of Sapphire Rapids' design issue vdpbf16ps once every two cycles: on Emerald Rapids one every 2.08
# against a vfmadd231ps every 0.55 (zmm, 16 independent accumulators), 15 bf16 products a cycle against 29 fp32
# ones (their bf16 speed is in AMX tiles). Zen 4 and Zen 5 issue it as often as an FMA.
SLOW_DOTS = dict.fromkeys(("sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d"),
                          frozenset({"bfloat16"}))
# Zen 4 runs an AVX-512 FMA as two 256-bit halves: 16 fp32 products a cycle, as AVX2's cores compute, where Zen 5's
# and Intel's server cores compute 32. There fp32 3x3 convs run faster as Winograd's (relay_amp.backend.cpu.winograd).
HALF_WIDTH_AVX512 = frozenset({"znver4"})


def target_core(target: tvm.target.Target) -> str:
    """The core `target` builds for, as LLVM names it: its `model`, else its `mcpu` ("" where it names none)."""
    return str(target.attrs.get("model", "") or target.attrs.get("mcpu", ""))


def slow_dtypes(target: tvm.target.Target) -> frozenset[str]:
    """The data dtypes whose dot-product instruction computes fewer products a cycle than fp32's FMA on the core
    `target` builds for."""
    return SLOW_DOTS.get(target_core(target), frozenset())


def splits_avx512(target: tvm.target.Target) -> bool:
    """Whether the core `target` builds for computes each AVX-512 FMA in two 256-bit halves (Zen 4)."""
    return target_core(target) in HALF_WIDTH_AVX512


def target_cores(target: "tvm.target.Target | None" = None) -> int:
    """The cores `target` (else the target a build has set current) is built for: its `num-cores`, the threads
    relay_amp sizes TVM's pool to; 0 where it names none."""
    target = target or tvm.target.Target.current(allow_none=True)
    return int(target.attrs.get("num-cores", 0)) if target is not None else 0
