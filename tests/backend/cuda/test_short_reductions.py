"""short_reductions: depthwise convs' and pools' windows one output a thread on CUDA, checked without a GPU."""

import shutil

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

import relay_amp
from relay_amp import models, targets
from relay_amp.backend.cuda.short_reductions import SHORT_REDUCTION, ShortReductionRule
from relay_amp.backend.cuda.tensorcore import kernel_sources, tensor_core_kernels
from relay_amp.compile.build import build, compile_ptx, cuda_source

from builders import single_output_module, tensor

TARGET = "cuda-tensorcore"


def _depthwise(window: int, channels: int = 32) -> tvm.IRModule:
    """main(x[1, channels, 28, 28]) = relu(depthwise window x window conv(x)), same padding."""
    weight = relax.const(np.random.default_rng(0).normal(size=(channels, 1, window, window)).astype("float32"))
    return single_output_module(
        lambda x: relax.op.nn.relu(relax.op.nn.conv2d(x, weight, padding=window // 2, groups=channels)),
        tensor("x", (1, channels, 28, 28)))


def _prim_func(mod: tvm.IRModule, name_part: str) -> tvm.tirx.PrimFunc:
    legalized = relax.transform.LegalizeOps()(mod)
    return next(func for gvar, func in legalized.functions_items() if name_part in gvar.name_hint)


def test_a_depthwise_conv_is_scheduled_as_dlights_fallback_schedules_it():
    func = _prim_func(_depthwise(3), "conv2d")
    target = targets.get_target(TARGET)
    with target:
        ours = ShortReductionRule().apply(func, target, False)
        fallback = dl.gpu.Fallback().apply(func, target, False)
    tvm.ir.assert_structural_equal(ours.mod["main"], fallback.mod["main"])


@pytest.mark.parametrize("window, short", [(3, True), (7, True), (9, False)])  # 81 values: dlight's rules
def test_only_reductions_of_at_most_short_reduction_values_are_taken(window, short):
    func = _prim_func(_depthwise(window), "conv2d")
    assert (window * window <= SHORT_REDUCTION) == short
    with targets.get_target(TARGET) as target:
        assert (ShortReductionRule().apply(func, target, False) is not None) == short


def test_elementwise_functions_and_cpu_targets_are_left_to_other_rules():
    relu = _prim_func(single_output_module(relax.op.nn.relu, tensor("x", (4, 64))), "relu")
    rule = ShortReductionRule()
    with targets.get_target(TARGET) as target:
        assert rule.apply(relu, target, False) is None  # no reduction
    assert rule.apply(_prim_func(_depthwise(3), "conv2d"), targets.get_target("cpu"), False) is None


def test_a_matmul_over_a_short_k_stays_with_dlights_matmul_rule_ahead_of_this_one():
    kernels = kernel_sources(cuda_source(build(models.matmul(size=64), TARGET)))  # fp32, K = 64
    assert [body for body in kernels.values() if "__shared__" in body], list(kernels)  # staged tiles


def test_float16_mobilenet_like_block_runs_its_depthwise_conv_a_thread_an_output_and_compiles():
    """Before: 256 threads an output, 9 of them busy, then a shuffle tree (MobileNetV3-Large's depthwise convs
    took half its time on an H200)."""
    mod = relay_amp.to_mixed_precision(_depthwise(3), "float16")
    source = cuda_source(build(mod, TARGET))
    convs = {name: body for name, body in kernel_sources(source).items() if "conv2d" in name}
    assert convs and not any("__shfl_down_sync" in body for body in convs.values()), list(convs)
    assert not any(tensor_core_kernels(source).values())
    if shutil.which("nvcc"):
        assert ".entry" in compile_ptx(source)


def test_layer_norms_rows_still_reduce_across_threads():
    mod = relay_amp.to_mixed_precision(models.bert_encoder(), "float16")
    kernels = kernel_sources(cuda_source(build(mod, TARGET)))
    norms = [body for name, body in kernels.items() if "layer_norm" in name]
    assert norms and all("__shfl_down_sync" in body for body in norms)
