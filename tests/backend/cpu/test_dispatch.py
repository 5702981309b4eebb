"""dispatch: eligible bf16/int8 matmuls and NHWC convs become kernel calls with packed constant weights."""

import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import targets
from relay_amp._ir import tensor_dtype, tensor_shape
from relay_amp.backend.cpu import amx, dispatch, kernels
from relay_amp.backend.cpu.epilogue import FuseKernelEpilogues
from relay_amp.compile.build import build
from relay_amp.ops import call_op_name
from relay_amp.passes.shapes import static_input_shape
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor, timm_through_onnx
from pass_checks import assert_transforms, prepared_function_names, prepared_module

BF16 = "bfloat16"


def _matmul_module(dtype: str, weight: np.ndarray, rows: int = 8):
    return single_output_module(lambda x: relax.op.matmul(x, relax.const(weight), out_dtype="float32"),
                                tensor("x", (2, rows, weight.shape[0]), dtype))


def _conv_module(weight_hwio: np.ndarray, dtype: str = "int8", channels: int | None = None, strides: int = 2):
    return single_output_module(
        lambda x: relax.op.nn.conv2d(x, relax.const(weight_hwio), strides=strides, padding=1, data_layout="NHWC",
                                     kernel_layout="HWIO", out_dtype="int32"),
        tensor("x", (1, 7, 7, channels or weight_hwio.shape[2]), dtype))


def _bf16_weight(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(ml_dtypes.bfloat16)


def test_bf16_matmul_becomes_a_kernel_call_on_packed_weights():
    weight = _bf16_weight((32, 16))
    after = dispatch.UseDotKernels({BF16})(_matmul_module(BF16, weight))
    relax.analysis.well_formed(after)
    bindings = [b.value for b in after["main"].body.blocks[0].bindings]
    ops = [v.op.name for v in bindings if isinstance(v, relax.Call)]
    assert ops == ["relax.reshape", "relax.call_tir", "relax.reshape"]
    call = bindings[1]
    assert call.args[0].name_hint == "relay_amp_dot_kernel1"
    np.testing.assert_array_equal(call.args[1].fields[1].value.numpy(),
                                  kernels.pack_weight(weight, "IO", kernels.BF16_DOT))
    assert relay_amp.transform.UseDotKernels({BF16})(_matmul_module(BF16, weight)).script() == after.script()


def test_a_weight_with_a_batch_of_one_is_taken_as_its_matrix():
    """torch.export spells an einsum by a weight as a bmm of a [1, K, N] constant: the kernel takes its matrix."""
    weight = _bf16_weight((32, 16))
    batched = single_output_module(lambda x: relax.op.matmul(x, relax.const(weight[None]), out_dtype="float32"),
                                   tensor("x", (2, 8, 32), BF16))
    plain = dispatch.UseDotKernels({BF16})(_matmul_module(BF16, weight))
    tvm.ir.assert_structural_equal(dispatch.UseDotKernels({BF16})(batched), plain)
    wider = single_output_module(lambda x: relax.op.matmul(x, relax.const(weight[None, None]), out_dtype="float32"),
                                 tensor("x", (8, 32), BF16))  # its output has the weight's batch axes: left alone
    names = [gv.name_hint for gv in dispatch.UseDotKernels({BF16})(wider).get_global_vars()]
    assert "relay_amp_dot_kernel1" not in names


@pytest.mark.parametrize("dtype", ["float32", BF16])
def test_a_batch_of_constant_weights_is_one_kernel_call_with_a_weight_per_batch_element(dtype):
    """[4, 40, 64] by a constant [4, 64, 24] (Winograd's transformed filters are 16 such): one kernel call, each
    batch element's rows by its own packed weight (24 columns padded to 32, sliced); a weight batch the data does not
    share (a broadcast) stays a matmul. fp32 within 1e-6 of numpy, bf16 within its rounding."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((4, 64, 24)).astype("float32")
    x = rng.standard_normal((4, 40, 64)).astype("float32")
    mod = single_output_module(lambda v: relax.op.matmul(v, relax.const(weights)), tensor("x", x.shape))
    if dtype == BF16:
        mod = relay_amp.to_mixed_precision(mod, BF16)
    after = dispatch.UseDotKernels({dtype})(mod)
    calls = [b.value for b in after["main"].body.blocks[0].bindings if call_op_name(b.value) == "relax.call_tir"]
    assert len(calls) == 1 and calls[0].args[1].fields[1].value.numpy().shape[0] == 4
    broadcast = single_output_module(lambda v: relax.op.matmul(v, relax.const(weights)), tensor("x", (2, 4, 40, 64)))
    assert "relay_amp_dot_kernel" not in dispatch.UseDotKernels({"float32"})(broadcast).script()
    if dtype == BF16 and not targets.host_supports("avx512_bf16"):
        return
    got = run_executable(build(mod, "cpu-avx512-bf16" if dtype == BF16 else "cpu"), [x])[0]
    expected = x.astype("float64") @ weights
    assert np.abs(got - expected).max() <= (1e-6 if dtype == "float32" else 8e-3) * np.abs(expected).max()


@pytest.mark.parametrize("reason,module", [
    ("fp32 is not enabled here", lambda: _matmul_module("float32", np.ones((32, 16), "float32"))),
    ("dtype not enabled for the target", lambda: _conv_module(np.ones((3, 3, 8, 16), "int8"), "int8")),
])
def test_calls_the_kernels_cannot_take_are_left_alone(reason, module):
    before = module()
    expected = relax.transform.FoldConstant()(module())
    assert_transforms(dispatch.UseDotKernels({BF16}), before, expected)


def test_amx_takes_the_calls_that_fit_its_tiles():
    def kernel_text(rows):
        after = dispatch.UseDotKernels({BF16}, amx_dtypes={BF16})(_matmul_module(BF16, _bf16_weight((64, 32)), rows))
        return after["relay_amp_dot_kernel1"].script()
    assert amx.PRODUCTS[BF16].symbol in kernel_text(16)  # 2 x 16 rows
    assert amx.PRODUCTS[BF16].symbol not in kernel_text(1)  # 2 rows: the AVX-512 kernel
    int8 = dispatch.UseDotKernels({"int8"}, amx_dtypes={"int8"})(_conv_module(np.ones((3, 3, 8, 32), "int8")))
    call = next(b.value for b in int8["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)
                and b.value.op.name == "relax.call_tir")
    assert len(call.args[1].fields) == 2  # data and packed weight: tdpbssd takes signed int8, no weight sums
    assert amx.PRODUCTS["int8"].symbol in int8["relay_amp_dot_kernel1"].script()


def test_flat_amx_tiles_read_no_zero_rows_and_store_only_the_output():
    after = dispatch.UseDotKernels({"int8"}, amx_dtypes={"int8"})(_conv_module(np.ones((3, 3, 8, 32), "int8"),
                                                                              strides=1))
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert ops == ["relax.nn.pad", "relax.call_tir"]  # the conv's own pad; the kernel skips the tiles' extra columns
    relax.analysis.well_formed(after)


def test_matmul_rows_off_the_tiles_run_across_one_image_row_on_amx_without_zero_rows():
    """2 x 197 rows (ViT's tokens) as 25 flat tiles of 16, the last overlapping the one before; 2 x 5 as row tiles
    of 10: no rows padded either way."""
    def kernel_input(rows):
        after = dispatch.UseDotKernels({BF16}, amx_dtypes={BF16})(_matmul_module(BF16, _bf16_weight((64, 32)), rows))
        assert "relax.nn.pad" not in after["main"].script()
        return tuple(int(d) for d in after["relay_amp_dot_kernel1"].params[0].ty.shape)
    assert kernel_input(197) == (1, 1, 394, 64)
    assert kernel_input(5) == (1, 1, 10, 64)
    if not (targets.host_runs_amx()):
        pytest.skip("host CPU (or kernel) has no AMX")
    mod = _matmul_module(BF16, _bf16_weight((64, 32)), rows=197)
    inputs = [np.random.default_rng(3).standard_normal((2, 197, 64)).astype(ml_dtypes.bfloat16)]
    got = run_executable(build(mod, "cpu-amx"), inputs)[0]
    expected = relay_amp.run(mod, inputs)[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()  # fp32 sums of bf16 products, reordered


@pytest.mark.parametrize("dtype,strides", [(BF16, 1), ("int8", 2), ("int8", 1)])
def test_built_model_with_amx_kernels_matches_the_generic_build(dtype, strides):
    if not (targets.host_runs_amx()):
        pytest.skip("host CPU (or kernel) has no AMX")
    rng = np.random.default_rng(2)
    if dtype == BF16:
        mod = _matmul_module(BF16, _bf16_weight((64, 64)), rows=16)
        inputs = [rng.standard_normal((2, 16, 64)).astype(ml_dtypes.bfloat16)]
        tolerance = 1e-5  # fp32 sums of the same bf16 products, in another order
    else:  # stride 2: row tiles of a 4x4 output; stride 1: flat tiles of a 7x7 output
        mod = _conv_module(rng.integers(-128, 128, (3, 3, 3, 32)).astype("int8"), strides=strides)  # 3 channels -> 4
        inputs = [rng.integers(-128, 128, (1, 7, 7, 3)).astype("int8")]
        tolerance = 0  # integer arithmetic is exact
    executable = build(mod, "cpu-amx")
    assert amx.PRODUCTS[dtype].instruction in executable.mod.imports[0].inspect_source("asm")
    got = run_executable(executable, inputs)[0].astype("float64")
    expected = relay_amp.run(mod, inputs)[0].astype("float64")
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def test_outputs_off_the_lanes_get_zero_weight_columns_and_a_slice():
    matmul = dispatch.UseDotKernels({BF16})(_matmul_module(BF16, _bf16_weight((32, 24))))
    calls = [b.value for b in matmul["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [c.op.name for c in calls] == ["relax.reshape", "relax.call_tir", "relax.reshape", "relax.strided_slice"]
    assert tensor_shape(calls[2]) == (2, 8, 32) and [int(e.value) for e in calls[-1].args[3]] == [24]
    conv = dispatch.UseDotKernels({"int8"})(_conv_module(np.ones((3, 3, 8, 10), "int8")))
    calls = [b.value for b in conv["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert calls[-1].op.name == "relax.strided_slice" and tensor_shape(calls[-1]) == (1, 4, 4, 10)
    relax.analysis.well_formed(conv)


def test_int8_conv_is_padded_then_dispatched():
    after = dispatch.UseDotKernels({"int8"})(_conv_module(np.ones((3, 3, 8, 16), "int8")))
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert ops == ["relax.nn.pad", "relax.call_tir"]


def _kernel_spec(mod: tvm.IRModule, call: relax.Call) -> kernels.ConvSpec:
    return kernels.fusable_spec(mod[call.args[0]], kernels.FUSABLE_ATTR)


def test_rows_that_tile_badly_are_computed_in_whole_tiles_and_only_their_own_stored():
    after = dispatch.UseDotKernels({BF16})(_matmul_module(BF16, _bf16_weight((64, 32)), rows=197))
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [c.op.name for c in calls] == ["relax.reshape", "relax.call_tir", "relax.reshape"]  # no pad, no slice
    spec = _kernel_spec(after, calls[1])  # 2 x 197 rows: 394 computed as 399, in 7-row tiles
    assert (spec.data_shape, spec.input_shape, spec.stored_width) == ((1, 1, 399, 64), (1, 1, 394, 64), 394)
    assert tensor_shape(calls[1]) == (1, 1, 394, 32)
    assert kernels.padded_width(2, 32) == 2 and kernels.padded_width(128, 32) == 128  # one tile; 4-row tiles
    relax.analysis.well_formed(after)


def test_built_model_with_padded_rows_matches_the_generic_build():
    if not targets.host_supports("avx512f"):
        pytest.skip("host CPU lacks avx512f")
    rng = np.random.default_rng(3)
    mod = _matmul_module("float32", rng.standard_normal((64, 32)).astype("float32"), rows=197)
    inputs = [rng.standard_normal((2, 197, 64)).astype("float32")]
    got = run_executable(build(mod, "cpu-avx512-bf16"), inputs)[0]
    expected = relay_amp.run(mod, inputs)[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()  # the same products in another order


def _audio_conv_module(dtype: str = "int8"):
    """A stride-2, width-3 conv over 1 x 1600 pixels (wav2vec2's second conv): 799 outputs, 17 x 47."""
    weight = np.random.default_rng(5).integers(-8, 8, (1, 3, 16, 32)).astype("int8")
    return single_output_module(
        lambda x: relax.op.nn.conv2d(x, relax.const(weight), strides=(1, 2), data_layout="NHWC", kernel_layout="HWIO",
                                     out_dtype="int32"),
        tensor("x", (1, 1, 1600, 16), dtype))


def test_conv_outputs_that_tile_badly_are_computed_in_whole_tiles_and_only_their_own_stored():
    after = dispatch.UseDotKernels({"int8"})(_audio_conv_module())
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [c.op.name for c in calls] == ["relax.call_tir"]  # no pad, no slice
    spec = _kernel_spec(after, calls[0])  # 799 outputs computed as 805 (7-pixel tiles, stride 2) from 1612 pixels
    assert (spec.out_shape, spec.stored_shape) == ((1, 1, 805, 32), (1, 1, 799, 32))
    assert spec.input_shape == (1, 1, 1600, 16) and tensor_shape(calls[0]) == (1, 1, 799, 32)
    relax.analysis.well_formed(after)


def test_built_conv_with_padded_pixels_matches_the_generic_build():
    if not targets.host_supports("avx512_vnni"):
        pytest.skip("host CPU lacks avx512_vnni")
    mod = _audio_conv_module()
    inputs = [np.random.default_rng(6).integers(-128, 128, (1, 1, 1600, 16)).astype("int8")]
    np.testing.assert_array_equal(run_executable(build(mod, "cpu-avx512-bf16"), inputs)[0],
                                  relay_amp.run(mod, inputs)[0])  # integer arithmetic is exact


def _runtime_int8_matmul() -> tvm.IRModule:
    return single_output_module(lambda a, b: relax.op.matmul(a, b, out_dtype="int32"),
                                tensor("a", (2, 16, 32), "int8"), tensor("b", (2, 32, 32), "int8"))


def _codes_conv(high: float) -> tvm.IRModule:
    """quantize's uint8 codes up to `high` of a float input, then a 3x3 conv by int8 weights of 127 and -128 (each
    pair of input channels sums to 254 or 256: vpmaddubsw's pair sums of 8-bit codes would saturate)."""
    weight = np.where(np.arange(3 * 3 * 8 * 16).reshape(3, 3, 8, 16) % 3 == 0, -128, 127).astype("int8")

    def body(x):
        clamped = relax.op.minimum(relax.op.maximum(relax.op.floor(x), relax.const(0.0)), relax.const(high))
        return relax.op.nn.conv2d(relax.op.astype(clamped, "uint8"), relax.const(weight), padding=1,
                                  data_layout="NHWC", kernel_layout="HWIO", out_dtype="int32")
    return single_output_module(body, tensor("x", (1, 7, 7, 8)))


@pytest.mark.parametrize("high, dot", [(127.0, kernels.AVX2_BYTE_DOT), (255.0, kernels.INT16_DOT)])
def test_7_bit_codes_take_avx2s_byte_products_whatever_the_weights_and_8_bit_ones_int16_pairs(high, dot):
    """A conv of codes clamped to 127 (quantize's 7-bit codes: code_bounds reads the clamp back) cannot saturate
    vpmaddubsw; of codes up to 255 it could, by these weights, so they are widened to int16 pairs. Both builds are
    exact: the codes and weights at their extremes give the same sums as the generic build."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    mod = _codes_conv(high)
    with target:
        after = dispatch.UseDotKernels({"uint8"})(relax.transform.Normalize()(mod))
    (kernel,) = [b.value for b in after["main"].body.blocks[0].bindings if call_op_name(b.value) == "relax.call_tir"
                 and b.value.args[0].name_hint.startswith("relay_amp_dot_kernel")]
    assert _kernel_spec(after, kernel).dot is dot
    if not targets.host_supports("avx2"):
        pytest.skip("host CPU lacks avx2")
    data = [np.full((1, 7, 7, 8), 300.0, "float32")]  # every code at its clamp
    np.testing.assert_array_equal(run_executable(build(mod, target), data)[0], relay_amp.run(mod, data)[0])


def _small_weight_conv():
    return _conv_module(np.ones((3, 3, 8, 16), "int8"))


def _large_weight_conv():  # pairs of input channels' weights sum to 200: vpmaddubsw would saturate
    return _conv_module(np.full((3, 3, 8, 16), 100, "int8"))


@pytest.mark.parametrize("mcpu, dot, feature", [("haswell", kernels.INT16_DOT, "avx2"),
                                                ("alderlake", kernels.AVX_VNNI_DOT, "avx_vnni"),
                                                ("skylake-avx512", kernels.AVX512_INT16_DOT, "avx512bw")])
@pytest.mark.parametrize("module", [_audio_conv_module, _small_weight_conv, _large_weight_conv, _runtime_int8_matmul])
def test_int8_kernels_for_a_target_without_avx512_vnni_match_the_generic_build(module, mcpu, dot, feature):
    """A host without AVX-512 VNNI computes 8-bit codes with AVX-VNNI's 256-bit vpdpbusd where it has it, else
    widened to int16 pairs (kernels.INT16_DOT, AVX512_INT16_DOT: the weights packed in int16, a runtime operand as
    it is packed); on AVX2 a constant weight whose pairs fit takes vpmaddubsw instead (AVX2_BYTE_DOT), its int8
    data shifted to uint8: all exact as the generic build's integer sums."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    assert {"float32", "int8", "uint8"} <= dispatch.target_dtypes(target) and BF16 not in dispatch.target_dtypes(target)
    mod = module()
    with target:
        after = dispatch.UseDotKernels({"int8"})(mod)
    (kernel,) = [b.value for b in after["main"].body.blocks[0].bindings if call_op_name(b.value) == "relax.call_tir"
                 and b.value.args[0].name_hint.startswith("relay_amp_dot_kernel")]
    if dot is kernels.INT16_DOT and module in (_audio_conv_module, _small_weight_conv):
        dot = kernels.AVX2_BYTE_DOT
    assert _kernel_spec(after, kernel).dot is dot and tensor_dtype(kernel.args[1].fields[1]) == dot.b_dtype
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}")
    rng = np.random.default_rng(7)
    data = [rng.integers(-128, 128, static_input_shape(p)).astype("int8") for p in mod["main"].params]
    np.testing.assert_array_equal(run_executable(build(mod, target), data)[0], relay_amp.run(mod, data)[0])


def _dilated_conv_module(dtype: str, weight_hwio: np.ndarray):
    """An atrous 3x3 conv as DeepLab's ASPP has them: taps 2 pixels apart, padded to keep the 9 x 10 image."""
    return single_output_module(
        lambda x: relax.op.nn.conv2d(x, relax.const(weight_hwio), padding=2, dilation=2, data_layout="NHWC",
                                     kernel_layout="HWIO", out_dtype="int32" if dtype == "int8" else "float32"),
        tensor("x", (1, 9, 10, weight_hwio.shape[2]), dtype))


@pytest.mark.parametrize("amx_dtypes, attr", [(set(), kernels.FUSABLE_ATTR), ({"int8"}, amx.FUSABLE_ATTR)])
def test_a_dilated_conv_becomes_a_kernel_reading_its_taps_apart(amx_dtypes, attr):
    """The dot-product kernel, or on AMX the tile kernel (each tap a run of its own, kernel rows 2 rows apart)."""
    after = dispatch.UseDotKernels({"int8"}, amx_dtypes=amx_dtypes)(
        _dilated_conv_module("int8", np.ones((3, 3, 16, 32), "int8")))
    relax.analysis.well_formed(after)
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [c.op.name for c in calls] == ["relax.nn.pad", "relax.call_tir"]
    spec = kernels.fusable_spec(after["relay_amp_dot_kernel1"], attr)
    assert spec.dilation == (2, 2) and spec.out_shape == (1, 9, 10, 32)


@pytest.mark.parametrize("dtype,feature", [("int8", "avx512_vnni"), (BF16, "avx512_bf16"), ("float32", "avx512f")])
def test_built_dilated_conv_matches_the_generic_build(dtype, feature):
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}")
    rng = np.random.default_rng(7)
    if dtype == "int8":
        weight, data = rng.integers(-128, 128, (3, 3, 16, 32)), rng.integers(-128, 128, (1, 9, 10, 16))
    else:
        weight, data = rng.standard_normal((3, 3, 16, 32)), rng.standard_normal((1, 9, 10, 16))
    numpy_dtype = ml_dtypes.bfloat16 if dtype == BF16 else dtype
    mod = _dilated_conv_module(dtype, weight.astype(numpy_dtype))
    executable = build(mod, "cpu-avx512-bf16")
    assert "relay_amp_dot_kernel" in executable.mod.imports[0].inspect_source("asm")
    got = run_executable(executable, [data.astype(numpy_dtype)])[0].astype("float64")
    expected = relay_amp.run(mod, [data.astype(numpy_dtype)])[0].astype("float64")
    tolerance = 0 if dtype == "int8" else 1e-5  # integers are exact; fp32 sums of the same products, reordered
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def test_target_dtypes_follow_the_cpu_features():
    assert dispatch.target_dtypes(targets.get_target("cpu-avx512-bf16")) == {"float32", BF16, "int8", "uint8"}
    for mcpu in ("skylake-avx512", "haswell"):  # FMA; 8-bit codes in int16 pairs without VNNI
        assert dispatch.target_dtypes(tvm.target.Target({"kind": "llvm", "mcpu": mcpu})) == {"float32", "int8", "uint8"}
    assert dispatch.target_dtypes(tvm.target.Target({"kind": "llvm", "mcpu": "sandybridge"})) == set()
    assert dispatch.target_dtypes(targets.get_target("cuda-tensorcore")) == set()


def test_conv_with_three_input_channels_gets_a_zero_channel():
    after = dispatch.UseDotKernels({"int8"})(_conv_module(np.ones((3, 3, 3, 16), "int8")))
    pad = next(b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call))
    assert [int(p) for p in pad.attrs.pad_width] == [0, 0, 1, 1, 1, 1, 0, 1]


@pytest.mark.parametrize("dtype,feature,channels", [(BF16, "avx512_bf16", 8), ("int8", "avx512_vnni", 8),
                                                     ("int8", "avx512_vnni", 3), ("float32", "avx512f", 8),
                                                     ("int8", "avx512_vnni", 10)])
def test_built_model_with_kernels_matches_the_generic_build(dtype, feature, channels):
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}")
    rng = np.random.default_rng(1)
    if dtype == BF16:
        mod = _matmul_module(BF16, _bf16_weight((64, 32)))
        inputs = [rng.standard_normal((2, 8, 64)).astype(ml_dtypes.bfloat16)]
        tolerance = 1e-5  # fp32 sums of the same bf16 products, in another order
    elif dtype == "float32":
        mod = _matmul_module("float32", rng.standard_normal((64, 32)).astype("float32"))
        inputs = [rng.standard_normal((2, 8, 64)).astype("float32")]
        tolerance = 1e-5  # the same products summed in another order
    else:
        mod = _conv_module(rng.integers(-128, 128, (3, 3, channels, 10 if channels == 10 else 16)).astype("int8"))
        inputs = [rng.integers(-128, 128, (1, 7, 7, channels)).astype("int8")]
        tolerance = 0  # integer arithmetic is exact
    got = run_executable(build(mod, "cpu-avx512-bf16"), inputs)[0].astype("float64")
    expected = relay_amp.run(mod, inputs)[0].astype("float64")
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def _attention_scores(dtype: str, heads: int = 2, tokens: int = 16, width: int = 32,
                      out_dtype: str | None = None) -> tvm.IRModule:
    """Q.K^T of two runtime tensors, as a transformer's attention computes it (int8 accumulates in int32)."""
    out_dtype = "int32" if dtype == "int8" else out_dtype
    return single_output_module(
        lambda q, k: relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2]), out_dtype=out_dtype),
        tensor("q", (1, heads, tokens, width), dtype), tensor("k", (1, heads, tokens, width), dtype))


def test_runtime_operands_are_packed_by_relax_ops_for_a_per_head_kernel():
    after = dispatch.UseDotKernels({BF16})(_attention_scores(BF16, tokens=32))
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [c.op.name for c in calls] == ["relax.permute_dims", "relax.reshape", "relax.permute_dims",
                                          "relax.reshape", "relax.reshape", "relax.call_tir", "relax.reshape"]
    packed = calls[5].args[1].fields[1]
    assert [int(d) for d in packed.ty.shape.values] == [2, 2, 1, 1, 16, 16, 2]  # heads, N/16, 1, 1, K/2, 16, 2
    kernel = after["relay_amp_dot_kernel1"]
    assert [int(d) for d in kernel.params[1].shape] == [2, 2, 1, 1, 16, 16, 2]  # one packed weight per head


@pytest.mark.parametrize("dtype, amx_dtypes, columns", [
    (BF16, set(), 32),  # a dot-product instruction's tile shares each broadcast between two 16-lane columns
    ("float32", set(), 16),  # fp32 FMAs measured slower so
    (BF16, {BF16}, 32),  # AMX tiles take 16-column blocks, the operand packed beside a zero block (amx.padded_weight)
])
def test_a_runtime_width_is_padded_to_the_kernels_column_block(dtype, amx_dtypes, columns):
    scores = _attention_scores(dtype, tokens=16, out_dtype="float32")
    after = dispatch.UseDotKernels({dtype}, amx_dtypes=amx_dtypes)(scores)
    kernel = after["relay_amp_dot_kernel1"]
    assert int(kernel.params[1].ty.shape[1]) * 16 == columns
    assert int(kernel.params[-1].ty.shape[-1]) == (16 if amx_dtypes else columns)  # the columns it stores
    relax.analysis.well_formed(after)


def test_a_runtime_matmul_broadcast_against_a_2d_operand_is_left_alone():
    module = single_output_module(relax.op.matmul, tensor("a", (2, 8, 32), BF16), tensor("b", (1, 32, 16), BF16))
    after = dispatch.UseDotKernels({BF16, "int8"})(module)
    assert not [gv for gv in after.get_global_vars() if "relay_amp_dot_kernel" in gv.name_hint]


def test_a_runtime_depth_off_the_group_gets_a_zero_column_and_a_zero_row():
    after = dispatch.UseDotKernels({BF16})(_attention_scores(BF16, tokens=32, width=33))  # P.V over 197 alike
    pads = [b.value for b in after["main"].body.blocks[0].bindings
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.nn.pad"]
    assert [[int(w) for w in pad.attrs.pad_width] for pad in pads] == [[0, 0, 0, 0, 0, 0, 0, 1],  # Q: 33 -> 34
                                                                       [0, 0, 0, 0, 0, 1, 0, 0]]  # K^T: 33 -> 34
    kernel = after["relay_amp_dot_kernel1"]
    assert [int(d) for d in kernel.params[1].shape] == [2, 2, 1, 1, 17, 16, 2]  # heads, N/16, 1, 1, 34/2, 16, 2
    relax.analysis.well_formed(after)


def test_a_runtime_width_off_the_lanes_gets_zero_columns_and_a_slice():
    after = dispatch.UseDotKernels({BF16})(_attention_scores(BF16, tokens=17))
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert calls[1].op.name == "relax.nn.pad" and [int(w) for w in calls[1].attrs.pad_width][-2:] == [0, 15]
    assert calls[-1].op.name == "relax.strided_slice" and [int(e.value) for e in calls[-1].args[3]] == [17]  # 32 -> 17
    relax.analysis.well_formed(after)


@pytest.mark.parametrize("tokens, blocks", [(17, 2), (40, 3)])  # 17 -> 32 columns; 40 -> 48 (a half panel)
def test_runtime_operands_on_amx_get_a_weight_per_head_in_16_channel_blocks(tokens, blocks):
    scores = _attention_scores(BF16, tokens=tokens, out_dtype="float32")  # AMX tiles accumulate fp32, as AMP asks
    after = dispatch.UseDotKernels({BF16}, amx_dtypes={BF16})(scores)
    kernel = after["relay_amp_dot_kernel1"]
    assert amx.FUSABLE_ATTR in kernel.attrs  # the AMX kernel, not the AVX-512 one
    assert [int(d) for d in kernel.params[1].ty.shape] == [2, blocks, 1, 1, 16, 16, 2]  # heads, 16-column blocks
    assert [int(d) for d in kernel.params[0].ty.shape] == [2, 1, tokens, 32]  # a weight per head: its tokens flat
    relax.analysis.well_formed(after)


def _masked_softmax_input(tokens: int) -> tvm.IRModule:
    """Q.K^T padded to whole vectors with fp32's lowest value, as relay_amp.backend.cpu.rows pads a softmax's rows."""
    lowest = float(np.finfo("float32").min)
    return single_output_module(
        lambda q, k: relax.op.nn.pad(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2]), out_dtype="float32"),
                                     [0, 0, 0, 0, 0, 0, 0, -tokens % 16], pad_value=lowest),
        tensor("q", (1, 2, tokens, 32), BF16), tensor("k", (1, 2, tokens, 32), BF16))


def test_a_pad_of_the_sliced_result_back_to_its_width_is_an_add_on_the_zero_columns():
    dispatched = dispatch.UseDotKernels({BF16}, amx_dtypes={BF16})(_masked_softmax_input(17))
    after = relax.transform.DeadCodeElimination()(dispatched)  # the slice is left unread
    ops = [call_op_name(b.value) for b in after["main"].body.blocks[0].bindings]
    assert "relax.strided_slice" not in ops and ops[-1] == "relax.add"
    tail = after["main"].body.blocks[0].bindings[-1].value.args[1].value.numpy()
    np.testing.assert_array_equal(tail, [0.0] * 17 + [np.finfo("float32").min] * 15)
    fused = FuseKernelEpilogues()(after)
    (kernel_call,) = [b.value for b in fused["main"].body.blocks[0].bindings if call_op_name(b.value) == "relax.call_tir"]
    assert len(kernel_call.args[1].fields) == 3  # data, packed operand, the mask as the epilogue's bias
    relax.analysis.well_formed(fused)


def test_a_pad_of_the_sliced_result_to_fewer_columns_is_an_add_on_the_zero_columns_then_a_slice():
    """40 tokens: the softmax's rows padded to 48, the bf16 kernel's two-column blocks (off AMX) to 64. The mask
    covers columns 40-63 and joins the epilogue; the softmax reads the first 48 columns of the kernel's result."""
    dispatched = dispatch.UseDotKernels({BF16})(_masked_softmax_input(40))
    after = relax.transform.DeadCodeElimination()(dispatched)
    bindings = after["main"].body.blocks[0].bindings
    lowest = float(np.finfo("float32").min)
    assert not [b for b in bindings if call_op_name(b.value) == "relax.nn.pad" and float(b.value.attrs.pad_value) == lowest]
    assert [call_op_name(b.value) for b in bindings[-2:]] == ["relax.add", "relax.strided_slice"]
    np.testing.assert_array_equal(bindings[-2].value.args[1].value.numpy(),
                                  [0.0] * 40 + [lowest] * 24)
    assert tensor_shape(bindings[-1].value) == (1, 2, 40, 48)
    relax.analysis.well_formed(after)


@pytest.mark.parametrize("between, joins", [
    (lambda scores: relax.op.multiply(scores, relax.const(0.125)), True),  # attention's scale keeps zeros zero
    (lambda scores: relax.op.add(scores, relax.const(1.0)), False),  # the extra columns would hold ones
])
def test_a_pad_after_a_sunk_slice_joins_the_epilogue_only_where_the_ops_keep_zeros(between, joins):
    lowest = float(np.finfo("float32").min)
    mod = single_output_module(
        lambda q, k: relax.op.nn.pad(between(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2]),
                                                             out_dtype="float32")),
                                     [0, 0, 0, 0, 0, 0, 0, 15], pad_value=lowest),
        tensor("q", (1, 2, 17, 32), BF16), tensor("k", (1, 2, 17, 32), BF16))
    after = relax.transform.DeadCodeElimination()(dispatch.UseDotKernels({BF16})(mod))
    masks = [b.value for b in after["main"].body.blocks[0].bindings
             if call_op_name(b.value) == "relax.nn.pad" and float(b.value.attrs.pad_value) == lowest]
    assert (not masks) == joins


@pytest.mark.parametrize("target, runs", [
    ("cpu-amx", targets.host_runs_amx),  # 16-column blocks: the mask covers the kernel's padded columns
    ("cpu-avx512-bf16", lambda: targets.host_supports("avx512_bf16")),  # 64 columns, sliced to the rows' 48
])
def test_built_masked_scores_match_numpy(target, runs):
    if not runs():
        pytest.skip(f"host CPU cannot run {target}")
    rng = np.random.default_rng(6)
    q, k = (rng.standard_normal((1, 2, 40, 32)).astype(ml_dtypes.bfloat16) for _ in range(2))
    got = run_executable(build(_masked_softmax_input(40), target), [q, k])[0]
    assert got.shape == (1, 2, 40, 48)
    scores = np.einsum("bhmk,bhnk->bhmn", q.astype("float64"), k.astype("float64"))
    assert np.abs(got[..., :40] - scores).max() <= 1e-5 * np.abs(scores).max()  # fp32 sums of bf16 products
    assert np.all(got[..., 40:] == np.finfo("float32").min)


def _attention_values(dtype: str, heads: int, tokens: int, width: int) -> tvm.IRModule:
    """P.V of two runtime tensors: attention weights over `tokens` times the values (accumulated in 32 bits)."""
    out_dtype = "int32" if dtype == "int8" else "float32"
    return single_output_module(lambda p, v: relax.op.matmul(p, v, out_dtype=out_dtype),
                                tensor("p", (1, heads, tokens, tokens), dtype), tensor("v", (1, heads, tokens, width), dtype))


@pytest.mark.parametrize("dtype, tokens, tolerance", [
    (BF16, 197, 1e-5),  # ViT's P.V: an odd depth, rows off the tiles; fp32 sums of bf16 products, reordered
    ("int8", 20, 0),  # integer arithmetic is exact
])
def test_built_runtime_matmul_on_amx_matches_exact_products(dtype, tokens, tolerance):
    if not targets.host_runs_amx():
        pytest.skip("host CPU (or kernel) has no AMX")
    rng = np.random.default_rng(5)
    shapes = (1, 3, tokens, tokens), (1, 3, tokens, 64)
    if dtype == "int8":
        p, v = (rng.integers(-128, 128, shape).astype("int8") for shape in shapes)
    else:
        p, v = (rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for shape in shapes)
    got = run_executable(build(_attention_values(dtype, 3, tokens, 64), "cpu-amx"), [p, v])[0].astype("float64")
    exact = np.einsum("bhmk,bhkn->bhmn", p.astype("float64"), v.astype("float64"))
    assert np.abs(got - exact).max() <= tolerance * np.abs(exact).max()


def test_signed_int8_runtime_operands_get_run_time_weight_sums():
    after = dispatch.UseDotKernels({"int8"})(_attention_scores("int8", tokens=32))
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    kernel_call = next(c for c in calls if c.op.name == "relax.call_tir")
    sums = kernel_call.args[1].fields[2]
    assert [int(d) for d in sums.ty.shape.values] == [2, 32] and tensor_dtype(sums) == "int32"  # per head, column
    assert "relax.sum" in [c.op.name for c in calls]


@pytest.mark.parametrize("dtype, feature, tolerance, width", [
    (BF16, "avx512_bf16", 8e-3, 32),  # one bf16 rounding of the fp32 sum (TVM's own bf16 matmul sums in bf16: 2e-2)
    (BF16, "avx512_bf16", 8e-3, 33),  # an odd depth: a zero column and a zero row
    ("float32", "avx512f", 1e-6, 32),  # fp32 sums in another order
    ("int8", "avx512_vnni", 0, 32),  # integer arithmetic is exact
    ("int8", "avx512_vnni", 0, 30),  # a depth off the groups of 4: zero products, zero in the weight sums
])
def test_built_runtime_matmul_matches_exact_products(dtype, feature, tolerance, width):
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}")
    rng = np.random.default_rng(4)
    if dtype == "int8":
        q, k = (rng.integers(-128, 128, (1, 2, 16, width)).astype("int8") for _ in range(2))
    else:
        numpy_dtype = ml_dtypes.bfloat16 if dtype == BF16 else "float32"
        q, k = (rng.standard_normal((1, 2, 16, width)).astype(numpy_dtype) for _ in range(2))
    module = _attention_scores(dtype, width=width)
    got = run_executable(build(module, "cpu-avx512-bf16"), [q, k])[0].astype("float64")
    exact = np.einsum("bhmk,bhnk->bhmn", q.astype("float64"), k.astype("float64"))
    assert np.abs(got - exact).max() <= tolerance * np.abs(exact).max()


def _decode_scores(dtype: str, keys_dtype: "str | None" = None) -> tvm.IRModule:
    """One query row's Q.K^T over 40 cached keys, the keys cast after their transpose where `keys_dtype` (AMP's)."""
    def scores(q, k):
        transposed = relax.op.permute_dims(k, [0, 1, 3, 2])
        operand = relax.op.astype(transposed, dtype) if keys_dtype else transposed
        return relax.op.matmul(q, operand, out_dtype="float32")

    return single_output_module(scores, tensor("q", (1, 2, 1, 32), dtype),
                                tensor("k", (1, 2, 40, 32), keys_dtype or dtype))


@pytest.mark.parametrize("keys_dtype", [None, "float32"])
def test_a_few_query_rows_take_the_cached_keys_as_the_kernels_rows(keys_dtype):
    """Packing K^T for a decode step's one query row copied the whole cache every step: the kernel computes
    (K.Q^T)^T instead, the keys as stored its rows and the query its packed operand."""
    after = dispatch.UseDotKernels({BF16})(_decode_scores(BF16, keys_dtype))
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    kernel = next(call for call in calls if call.op.name == "relax.call_tir")
    assert [int(d) for d in kernel.ty.shape.values][-2] == 40  # a row per key
    assert calls[-1].op.name == "relax.permute_dims" and [int(d) for d in calls[-1].ty.shape.values] == [1, 2, 1, 40]
    relax.analysis.well_formed(after)


def test_a_few_queries_over_a_few_keys_are_left_to_the_generic_schedule():
    """Swapped, the keys would be a few rows too (and swap back, without end)."""
    scores = single_output_module(
        lambda q, k: relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2]), out_dtype="float32"),
        tensor("q", (1, 2, 4, 32), BF16), tensor("k", (1, 2, 6, 32), BF16))
    after = dispatch.UseDotKernels({BF16})(scores)
    assert not [gv for gv in after.get_global_vars() if "relay_amp_dot_kernel" in gv.name_hint]


def test_a_few_rows_times_a_runtime_operand_read_in_place_are_left_to_the_generic_schedule():
    values = single_output_module(lambda p, v: relax.op.matmul(p, v, out_dtype="float32"),
                                  tensor("p", (1, 2, 1, 40), BF16), tensor("v", (1, 2, 40, 32), BF16))
    after = dispatch.UseDotKernels({BF16})(values)
    assert not [gv for gv in after.get_global_vars() if "relay_amp_dot_kernel" in gv.name_hint]


@pytest.mark.parametrize("dtype, tolerance", [(BF16, 8e-3), ("float32", 1e-6)])
def test_built_decode_scores_match_exact_products(dtype, tolerance):
    rng = np.random.default_rng(5)
    numpy_dtype = ml_dtypes.bfloat16 if dtype == BF16 else "float32"
    q, k = rng.standard_normal((1, 2, 1, 32)).astype(numpy_dtype), rng.standard_normal((1, 2, 40, 32)).astype(
        numpy_dtype)
    got = run_executable(build(_decode_scores(dtype), "cpu"), [q, k])[0].astype("float64")
    exact = np.einsum("bhmk,bhnk->bhmn", q.astype("float64"), k.astype("float64"))
    assert np.abs(got - exact).max() <= tolerance * np.abs(exact).max()


def _grouped_conv_module(weight_hwio: np.ndarray, groups: int, dtype: str = BF16, out_dtype: str = "float32"):
    channels = weight_hwio.shape[2] * groups
    return single_output_module(
        lambda x: relax.op.nn.conv2d(x, relax.const(weight_hwio), padding=1, groups=groups, data_layout="NHWC",
                                     kernel_layout="HWIO", out_dtype=out_dtype),
        tensor("x", (1, 6, 6, channels), dtype))


def test_grouped_conv_becomes_a_kernel_over_a_block_diagonal_weight():
    """10 groups of 4 channels, the bf16 weight widened to fp32 as WidenArithmetic leaves it: 16-lane blocks of 4
    groups, a last block of 2 reading 8 zero input channels and storing 8 zero outputs, sliced off."""
    weight = _bf16_weight((3, 3, 4, 40)).astype("float32")
    after = dispatch.UseDotKernels({BF16})(_grouped_conv_module(weight, 10))
    relax.analysis.well_formed(after)
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [call_op_name(c) for c in calls] == ["relax.nn.pad", "relax.call_tir", "relax.strided_slice"]
    assert [int(p) for p in calls[0].attrs.pad_width] == [0, 0, 1, 1, 1, 1, 0, 8]
    dense, blocks = kernels.grouped_weight(weight.transpose(3, 2, 0, 1), 10)
    np.testing.assert_array_equal(calls[1].args[1].fields[1].value.numpy().astype("float32"),
                                  kernels.pack_weight(dense, "OIHW", kernels.BF16_DOT).astype("float32"))
    spec = kernels.fusable_spec(after["relay_amp_dot_kernel1"], kernels.FUSABLE_ATTR)
    assert (spec.groups, spec.depth, spec.out_channels) == (blocks, 16, 48)
    assert tensor_shape(calls[-1]) == (1, 6, 6, 40)


def test_groups_of_24_become_a_kernel_of_32_outputs_each_compacted_after():
    """2 groups of 24 (RegNetY-1.6GF's width): each group's outputs padded to two 16-lane blocks, the kernel's 64
    channels reshaped to the groups, 24 of each kept, and reshaped back to 48."""
    weight = _bf16_weight((3, 3, 24, 48)).astype("float32")
    after = dispatch.UseDotKernels({BF16})(_grouped_conv_module(weight, 2))
    relax.analysis.well_formed(after)
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [call_op_name(c) for c in calls] == ["relax.nn.pad", "relax.call_tir", "relax.reshape",
                                                "relax.strided_slice", "relax.reshape"]
    assert [tensor_shape(c) for c in calls[1:]] == [(1, 6, 6, 64), (1, 6, 6, 2, 32), (1, 6, 6, 2, 24), (1, 6, 6, 48)]
    spec = kernels.fusable_spec(after["relay_amp_dot_kernel1"], kernels.FUSABLE_ATTR)
    assert (spec.groups, spec.depth, spec.out_channels) == (2, 24, 64)


@pytest.mark.parametrize("weight,groups", [
    (np.full((3, 3, 4, 40), 0.1, "float32"), 10),  # not a bf16 value: the fp32 weight is not read back narrow
    (np.ones((3, 3, 1, 40), "float32"), 40),  # depthwise: 15 zero products per useful one
    (np.ones((3, 3, 1, 48), "float32"), 16),  # groups of 3 outputs: 13 zero products per 3 useful ones
])
def test_grouped_convs_the_kernels_should_not_take_are_left_alone(weight, groups):
    def module():
        return _grouped_conv_module(weight, groups)
    assert_transforms(dispatch.UseDotKernels({BF16}), module(), relax.transform.FoldConstant()(module()))


@pytest.mark.parametrize("dtype,feature,groups,width", [(BF16, "avx512_bf16", 10, 4), ("float32", "avx512f", 4, 8),
                                                        ("int8", "avx512_vnni", 2, 32), ("uint8", "avx512_vnni", 6, 8),
                                                        (BF16, "avx512_bf16", 2, 24), ("int8", "avx512_vnni", 3, 12),
                                                        ("float32", "avx512f", 2, 20)])
def test_built_grouped_conv_matches_the_generic_build(dtype, feature, groups, width):
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}")
    rng = np.random.default_rng(5)
    if dtype in (BF16, "float32"):
        weight = rng.standard_normal((3, 3, width, width * groups)).astype(ml_dtypes.bfloat16 if dtype == BF16 else dtype)
        data = rng.standard_normal((1, 6, 6, width * groups)).astype(weight.dtype)
        mod, tolerance = _grouped_conv_module(weight, groups, dtype), 1e-5  # fp32 sums in another order
    else:  # a quantized conv's codes: uint8 data over fp32 integer weights (realize), or int8 over int8
        weight = rng.integers(-127, 128, (3, 3, width, width * groups)).astype("int8" if dtype == "int8" else "float32")
        data = rng.integers(-128 if dtype == "int8" else 0, 128 if dtype == "int8" else 256,
                            (1, 6, 6, width * groups)).astype(dtype)
        mod, tolerance = _grouped_conv_module(weight, groups, dtype, "int32" if dtype == "int8" else "float32"), 0
    executable = build(mod, "cpu-avx512-bf16")
    assert "relay_amp_dot_kernel" in executable.mod.imports[0].inspect_source("ll")
    got = run_executable(executable, [data])[0].astype("float64")
    expected = relay_amp.run(mod, [data])[0].astype("float64")
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def _widened_pair_module(between) -> tvm.IRModule:
    """A bf16 1x1 conv to 40 channels (sliced off 48) through `between` (a function of the value), then 10 groups of
    4 (which read 48 channels: 8 zero ones), as a RegNet stage with widths off the 16 lanes reaches dispatch."""
    first, second = _bf16_weight((1, 1, 16, 40), 1), _bf16_weight((3, 3, 4, 40), 2)

    def layers(x):
        value = relax.op.nn.conv2d(x, relax.const(first), data_layout="NHWC", kernel_layout="HWIO",
                                   out_dtype="float32")
        return relax.op.nn.conv2d(between(value), relax.const(second), padding=1, groups=10, data_layout="NHWC",
                                  kernel_layout="HWIO", out_dtype="float32")
    return relax.transform.Normalize()(single_output_module(layers, tensor("x", (1, 6, 6, 16), BF16)))


BIAS40 = np.linspace(-1.0, 1.0, 40, dtype="float32").reshape(1, 1, 1, 40)


def _bias_relu_cast(value: relax.Expr) -> relax.Expr:
    return relax.op.astype(relax.op.nn.relu(relax.op.add(value, relax.const(BIAS40))), BF16)


def _bound(mod: tvm.IRModule) -> list[relax.Call]:
    """The calls main binds, in order (aliases left out)."""
    return [b.value for b in mod["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]


BIAS48 = np.linspace(-1.0, 1.0, 48, dtype="float32").reshape(1, 1, 1, 48)


def _groups_of_24_then(after_conv) -> tvm.IRModule:
    """A bf16 conv in 2 groups of 24 (computed as 2 of 32, compacted after) through `after_conv`."""
    weight = _bf16_weight((3, 3, 24, 48)).astype("float32")

    def layers(x):
        return after_conv(relax.op.nn.conv2d(x, relax.const(weight), padding=1, groups=2, data_layout="NHWC",
                                             kernel_layout="HWIO", out_dtype="float32"))
    return relax.transform.Normalize()(single_output_module(layers, tensor("x", (1, 6, 6, 48), BF16)))


def _bias48_relu_cast(value: relax.Expr) -> relax.Expr:
    return relax.op.astype(relax.op.nn.relu(relax.op.add(value, relax.const(BIAS48))), BF16)


def test_ops_after_a_compacted_grouped_conv_run_on_its_padded_groups_before_the_compaction():
    """The bias (each group's 24 values, then 8 zeros), ReLU and cast follow the kernel, whose epilogue takes them;
    the compaction of its 64 channels to 48 comes after them, on bf16 values."""
    after = relax.transform.DeadCodeElimination()(dispatch.UseDotKernels({BF16})(_groups_of_24_then(
        _bias48_relu_cast)))
    relax.analysis.well_formed(after)
    calls = _bound(after)
    assert [call_op_name(c) for c in calls] == ["relax.nn.pad", "relax.call_tir", "relax.add", "relax.nn.relu",
                                                "relax.astype", "relax.reshape", "relax.strided_slice",
                                                "relax.reshape"]
    bias = calls[2].args[1].value.numpy().reshape(2, 32)
    np.testing.assert_array_equal(bias[:, :24], BIAS48.reshape(2, 24))
    assert not bias[:, 24:].any()
    assert (tensor_shape(calls[-1]), tensor_dtype(calls[-1])) == ((1, 6, 6, 48), BF16)


def test_ops_of_a_compacted_grouped_conv_and_another_tensor_stay_after_the_compaction():
    residual = tensor("r", (1, 6, 6, 48))
    weight = _bf16_weight((3, 3, 24, 48)).astype("float32")
    mod = relax.transform.Normalize()(single_output_module(
        lambda x, r: relax.op.add(relax.op.nn.conv2d(x, relax.const(weight), padding=1, groups=2, data_layout="NHWC",
                                                     kernel_layout="HWIO", out_dtype="float32"), r),
        tensor("x", (1, 6, 6, 48), BF16), residual))
    calls = _bound(dispatch.UseDotKernels({BF16})(mod))
    assert [call_op_name(c) for c in calls][-2:] == ["relax.reshape", "relax.add"]


def test_built_grouped_conv_with_its_epilogue_on_padded_groups_matches_the_generic_build():
    if not targets.host_supports("avx512_bf16"):
        pytest.skip("host CPU lacks avx512_bf16")
    mod = _groups_of_24_then(_bias48_relu_cast)
    assert not [name for name in prepared_function_names(mod) if "relu" in name]  # in the kernel's epilogue
    data = np.random.default_rng(3).standard_normal((1, 6, 6, 48)).astype(ml_dtypes.bfloat16)
    got = run_executable(build(mod, "cpu-avx512-bf16"), [data])[0].astype("float64")
    expected = relay_amp.run(mod, [data])[0].astype("float64")
    assert np.abs(got - expected).max() <= 8e-3 * np.abs(expected).max()  # bf16 rounding of the fp32 sums


def _conv(value: relax.Expr, weight: np.ndarray, groups: int = 1, padding: int = 0) -> relax.Expr:
    return relax.op.nn.conv2d(value, relax.const(weight), padding=padding, groups=groups, data_layout="NHWC",
                              kernel_layout="HWIO", out_dtype="float32")


DEPTHWISE48 = _bf16_weight((3, 3, 1, 48), 3).astype("float32")
GROUPED_1X1 = _bf16_weight((1, 1, 24, 16), 4).astype("float32")  # 2 groups of 24 inputs, 8 outputs each
DENSE_1X1 = _bf16_weight((1, 1, 16, 32), 5).astype("float32")


def _compacted_chain(value: relax.Expr) -> relax.Expr:
    """After 2 groups of 24 (computed as 32 each): bias, ReLU, a depthwise conv, ReLU, a grouped 1x1 conv in the
    same 2 groups, and a dense 1x1 conv of that (16 channels, no padding of its own)."""
    depthwise = relax.op.nn.relu(_conv(_bias48_relu_cast(value), DEPTHWISE48, groups=48, padding=1))
    return _conv(_conv(relax.op.astype(depthwise, BF16), GROUPED_1X1, groups=2), DENSE_1X1)


def test_convs_of_a_compacted_grouped_conv_read_its_padded_groups():
    """The depthwise conv runs on the 64 padded channels (zero weights on each group's 8) and is compacted after
    its ReLU; the grouped 1x1 conv reads those 64 channels too, each group's 24 inputs and 8 zero ones: no
    compaction is left between the convs."""
    after = relax.transform.DeadCodeElimination()(dispatch.UseDotKernels({BF16})(_groups_of_24_then(
        _compacted_chain)))
    relax.analysis.well_formed(after)
    calls = _bound(after)
    assert [call_op_name(c) for c in calls if call_op_name(c) in ("relax.reshape", "relax.strided_slice")] == []
    depthwise = next(c for c in calls if call_op_name(c) == "relax.nn.conv2d")
    assert (tensor_shape(depthwise), int(depthwise.attrs.groups)) == ((1, 6, 6, 64), 64)
    taps = depthwise.args[1].value.numpy().reshape(3, 3, 2, 32)
    np.testing.assert_array_equal(taps[..., :24], DEPTHWISE48.reshape(3, 3, 2, 24))
    assert not taps[..., 24:].any()
    grouped = kernels.fusable_spec(after["relay_amp_dot_kernel2"], kernels.FUSABLE_ATTR)
    assert (grouped.data_shape[-1], grouped.groups, grouped.out_channels) == (64, 1, 16)


def test_built_convs_of_a_compacted_grouped_conv_match_the_generic_build():
    if not targets.host_supports("avx512_bf16"):
        pytest.skip("host CPU lacks avx512_bf16")
    mod = _groups_of_24_then(_compacted_chain)
    assert not [name for name in prepared_function_names(mod) if "strided_slice" in name]
    data = np.random.default_rng(4).standard_normal((1, 6, 6, 48)).astype(ml_dtypes.bfloat16)
    got = run_executable(build(mod, "cpu-avx512-bf16"), [data])[0].astype("float64")
    expected = relay_amp.run(mod, [data])[0].astype("float64")
    assert np.abs(got - expected).max() <= 2e-2 * np.abs(expected).max()  # bf16 roundings of three results


def _convs_reading_compactions(mod: tvm.IRModule) -> list[str]:
    """The kernels and conv functions of `mod`'s prepared main that read a function only compacting padded groups
    (split_reads' depthwise convs of a part, which read their channels at an offset, left out)."""
    compactions, readers = set(), []
    for binding in prepared_module(mod)["main"].body.blocks[0].bindings:
        value = binding.value
        if not (isinstance(value, relax.Call) and isinstance(value.args[0], relax.GlobalVar)):
            continue
        name = value.args[0].name_hint
        if re.fullmatch(r"(fused_)?reshape\d*_strided_slice\d*_reshape\d*", name):
            compactions.add(binding.var)
        elif re.search(r"dot_kernel|conv2d(?!_at)", name) and compactions & set(value.args[1].fields):
            readers.append(name)
    return readers


def test_a_timm_mixnet_xl_compacts_no_groups_for_a_conv(tmp_path):
    """timm's MixNet-XL (grouped pointwise convs in 2 groups off the 16 lanes, widths other than MixNet-S's, which
    this was written on; 3 convs read a compaction before): in fp32 and bf16 no conv reads a compaction of padded
    groups, and the fp32 build matches PyTorch."""
    pytest.importorskip("timm")
    _, imported, x, expected = timm_through_onnx("mixnet_xl", tmp_path)
    assert _convs_reading_compactions(imported) == []
    assert _convs_reading_compactions(relay_amp.to_mixed_precision(imported, BF16)) == []
    got = run_executable(build(imported, targets.host_preset()), [x])[0]
    np.testing.assert_allclose(got, expected, atol=1e-5 * np.abs(expected).max())


def test_a_grouped_conv_reads_the_whole_result_its_producer_sliced_through_elementwise_ops():
    """Its 8 zero input channels come from the first kernel's zero outputs: the bias (padded with zeros), ReLU and
    cast run on all 48 channels, the pad adds no channel, and the first kernel's epilogue takes the three ops. The
    second kernel stores only its leading 40 channels (the slice joins its epilogue)."""
    after = relax.transform.DeadCodeElimination()(dispatch.UseDotKernels({BF16})(_widened_pair_module(
        _bias_relu_cast)))
    relax.analysis.well_formed(after)
    ops = [call_op_name(value) for value in _bound(after)]
    assert ops == ["relax.call_tir", "relax.add", "relax.nn.relu", "relax.astype", "relax.nn.pad", "relax.call_tir",
                   "relax.strided_slice"]
    bias = _bound(after)[1].args[1].value.numpy()
    np.testing.assert_array_equal(bias.reshape(-1), np.concatenate([BIAS40.reshape(-1), np.zeros(8, "float32")]))
    assert [int(p) for p in _bound(after)[4].attrs.pad_width] == [0, 0, 1, 1, 1, 1, 0, 0]
    fused = FuseKernelEpilogues()(after)
    assert [call_op_name(value) for value in _bound(fused)] == ["relax.call_tir", "relax.nn.pad", "relax.call_tir"]
    assert _bound(fused)[0].ty.dtype == BF16 and tensor_shape(_bound(fused)[2])[-1] == 40


@pytest.mark.parametrize("between, reason", [
    (lambda value: relax.op.astype(relax.op.sqrt(relax.op.nn.relu(value)), BF16), "sqrt: not in WIDENABLE"),
    (lambda value: relax.op.astype(relax.op.divide(relax.const(1.0), relax.op.nn.relu(value)), BF16),
     "a tensor divisor: its zero channels would become infinities"),
])
def test_a_grouped_conv_after_other_ops_pads_the_sliced_channels(between, reason):
    after = dispatch.UseDotKernels({BF16})(_widened_pair_module(between))
    pads = [value for value in _bound(after) if call_op_name(value) == "relax.nn.pad"]
    assert [int(p) for p in pads[-1].attrs.pad_width][-1] == 8, reason


def test_built_widened_pair_matches_the_generic_build():
    if not targets.host_supports("avx512_bf16"):
        pytest.skip("host CPU lacks avx512_bf16")
    mod = _widened_pair_module(_bias_relu_cast)
    data = np.random.default_rng(8).standard_normal((1, 6, 6, 16)).astype(ml_dtypes.bfloat16)
    got = run_executable(build(mod, "cpu-avx512-bf16"), [data])[0].astype("float64")
    expected = relay_amp.run(mod, [data])[0].astype("float64")
    # fp32 sums in another order, and the bf16 rounding of the first layer's output they may move across
    assert np.abs(got - expected).max() <= 2 ** -7 * np.abs(expected).max()


def _residual_block_module(dtype: str) -> tvm.IRModule:
    """Two 1x1 convs to 40 channels (each sliced off 48), the first's bias, the sum of both and a ReLU: a RegNet or
    EfficientNet block whose width is off the 16 lanes, ending in its residual add."""
    first, second = (np.random.default_rng(seed).standard_normal((1, 1, 16, 40)).astype(dtype) for seed in (3, 4))

    def layers(x):
        convs = [relax.op.nn.conv2d(x, relax.const(weight), data_layout="NHWC", kernel_layout="HWIO",
                                    out_dtype="float32") for weight in (first, second)]
        return relax.op.nn.relu(relax.op.add(relax.op.add(convs[0], relax.const(BIAS40)), convs[1]))
    return relax.transform.Normalize()(single_output_module(layers, tensor("x", (1, 6, 6, 16), dtype)))


def test_elementwise_ops_of_sliced_results_run_on_the_whole_results_and_the_slice_comes_after():
    """The bias (padded with zeros), the residual add of the two slices and the ReLU move before the one slice
    left, so a kernel's epilogue takes all three (the other kernel's result as its residual) and then that slice:
    it stores 40 of its 48 channels. The slices the ops moved past are gone, or they would still read the kernels'
    results and keep the epilogue from taking the ops (MobileNetV3's fp32 bias adds ran on their own)."""
    after = dispatch.UseDotKernels({"float32"})(_residual_block_module("float32"))
    relax.analysis.well_formed(after)
    assert [call_op_name(value) for value in _bound(after)] == [
        "relax.call_tir", "relax.add", "relax.call_tir", "relax.add", "relax.nn.relu", "relax.strided_slice"]
    assert all(tensor_shape(value)[-1] == 48 for value in _bound(after)[:-1])
    fused = FuseKernelEpilogues()(after)
    assert [call_op_name(value) for value in _bound(fused)] == ["relax.call_tir", "relax.call_tir"]
    assert tensor_shape(_bound(fused)[1])[-1] == 40


def test_built_residual_block_of_sliced_results_matches_the_generic_build():
    if not targets.host_supports("avx512f"):
        pytest.skip("host CPU lacks avx512f")
    mod = _residual_block_module("float32")
    data = np.random.default_rng(9).standard_normal((1, 6, 6, 16)).astype("float32")
    got = run_executable(build(mod, targets.host_preset()), [data])[0]
    expected = relay_amp.run(mod, [data])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())  # fp32 sums reordered


def _depthwise_block_module(dtype: str, tail=None) -> tvm.IRModule:
    """A MobileNetV3 block whose width is off the 16 lanes: a 1x1 conv to 72 channels (a kernel of 80, sliced), its
    bias and ReLU, a 3x3 depthwise conv with its bias and ReLU, `tail` of that (default: nothing), and a 1x1 conv
    to 24 channels."""
    rng = np.random.default_rng(5)
    expand, depthwise, project = (rng.standard_normal(shape).astype(dtype) for shape in
                                  ((1, 1, 16, 72), (3, 3, 1, 72), (1, 1, 72, 24)))
    bias = np.linspace(-1.0, 1.0, 72, dtype="float32").reshape(1, 1, 1, 72)

    def layers(x):
        wide = relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(
            x, relax.const(expand), data_layout="NHWC", kernel_layout="HWIO", out_dtype="float32"), relax.const(bias)))
        filtered = relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(
            relax.op.astype(wide, dtype), relax.const(depthwise), padding=1, groups=72, data_layout="NHWC",
            kernel_layout="HWIO", out_dtype="float32"), relax.const(bias)))
        tailed = filtered if tail is None else tail(filtered)
        return relax.op.nn.conv2d(relax.op.astype(tailed, dtype), relax.const(project), data_layout="NHWC",
                                  kernel_layout="HWIO", out_dtype="float32")
    return relax.transform.Normalize()(single_output_module(layers, tensor("x", (1, 6, 6, 16), dtype)))


def _squeeze_excite(value: relax.Expr) -> relax.Expr:
    """An SE block without its FCs: `value` scaled by the sigmoid of its per-channel mean."""
    return relax.op.multiply(value, relax.op.sigmoid(relax.op.mean(value, axis=[1, 2], keepdims=True)))


def test_a_depthwise_conv_of_a_sliced_result_runs_on_the_whole_result():
    """The depthwise conv reads the first kernel's 80 channels with zero weights on the last 8 (72-channel vectors
    were 8 lanes wide, and a function of their own sliced its input); its bias and ReLU follow it on all 80, and
    the last kernel reads them whole with zero weights too: one slice is left, the last kernel's own."""
    after = dispatch.UseDotKernels({"float32"})(_depthwise_block_module("float32"))
    relax.analysis.well_formed(after)
    calls = _bound(after)
    assert [call_op_name(value) for value in calls].count("relax.strided_slice") == 1
    assert call_op_name(calls[-1]) == "relax.strided_slice"
    depthwise = next(value for value in calls if call_op_name(value) == "relax.nn.conv2d")
    assert int(depthwise.attrs.groups) == 80 and tensor_shape(depthwise.args[0])[-1] == 80
    weight = depthwise.args[1].value.numpy()
    assert weight.shape == (3, 3, 1, 80) and not weight[..., 72:].any()
    assert tensor_shape(calls[-2].args[1].fields[0])[-1] == 80  # the last kernel's input


def test_an_se_block_of_a_sliced_result_pools_and_scales_the_whole_result():
    """The mean over the pixels (per channel), its sigmoid and the product with the broadcast gate run on all 80
    channels too, so nothing slices before the last kernel."""
    after = dispatch.UseDotKernels({"float32"})(_depthwise_block_module("float32", _squeeze_excite))
    relax.analysis.well_formed(after)
    calls = _bound(after)
    assert [call_op_name(value) for value in calls].count("relax.strided_slice") == 1
    assert {tensor_shape(value)[-1] for value in calls if call_op_name(value) in (
        "relax.mean", "relax.sigmoid", "relax.multiply")} == {80}


@pytest.mark.parametrize("tail, reason", [
    (lambda value: relax.op.multiply(value, relax.op.sum(value, axis=[3], keepdims=True)),
     "a sum over the channels would add the extra ones"),
    (lambda value: relax.op.nn.conv2d(value, relax.const(np.ones((3, 3, 2, 72), "float32")), padding=1, groups=36,
                                      data_layout="NHWC", kernel_layout="HWIO"),
     "a grouped conv of two channels a group adds neighbouring channels"),
])
def test_ops_that_mix_the_channels_of_a_sliced_result_keep_the_slice_before_them(tail, reason):
    before = relax.transform.Normalize()(_depthwise_block_module("float32", lambda value: tail(value)))
    calls = _bound(dispatch.UseDotKernels({"float32"})(before))
    names = [call_op_name(value) for value in calls]
    mixing = next(i for i, value in enumerate(calls) if call_op_name(value) in ("relax.sum", "relax.nn.conv2d")
                  and tensor_shape(value.args[0])[-1] == 72)
    assert names[mixing - 1] == "relax.strided_slice", reason


@pytest.mark.parametrize("dtype, feature, tolerance", [
    ("float32", "avx512f", 1e-5),
    (BF16, "avx512_bf16", 2 ** -7),  # fp32 sums in another order, and the bf16 roundings they may move across
])
def test_built_depthwise_se_block_of_a_sliced_result_matches_the_generic_build(dtype, feature, tolerance):
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}")
    mod = _depthwise_block_module(dtype, _squeeze_excite)
    data = np.random.default_rng(10).standard_normal((1, 6, 6, 16)).astype(
        ml_dtypes.bfloat16 if dtype == BF16 else dtype)
    got = run_executable(build(mod, targets.host_preset()), [data])[0].astype("float64")
    expected = relay_amp.run(mod, [data])[0].astype("float64")
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def test_a_timm_mobilenet_v3_runs_its_blocks_off_the_lanes_on_whole_results(tmp_path):
    """timm's MobileNetV3-Small (72, 88 and 120 channels among its widths), a model this was not written on: no
    function of its bf16 build slices a kernel's result (13 did), and it stays as close to PyTorch's fp32."""
    pytest.importorskip("timm")
    if not targets.host_supports("avx512_bf16"):
        pytest.skip("host CPU lacks avx512_bf16")
    _, imported, x, expected = timm_through_onnx("mobilenetv3_small_100", tmp_path)
    mod = relay_amp.to_mixed_precision(imported, BF16)
    names = [gv.name_hint for gv in prepared_module(mod).get_global_vars()]
    assert not [name for name in names if "strided_slice" in name]
    built = run_executable(build(mod, targets.host_preset()), [x])[0].astype("float32")
    assert np.abs(built - expected).max() <= 0.03 * np.abs(expected).max()  # 0.011 here, as before the change


def _pointwise_module(height: int, width: int, channels: int = 32, out_channels: int = 64):
    weight = np.random.default_rng(3).standard_normal((1, 1, channels, out_channels)).astype("float32")
    return single_output_module(
        lambda x: relax.op.nn.conv2d(x, relax.const(weight), data_layout="NHWC", kernel_layout="HWIO"),
        tensor("x", (1, height, width, channels), "float32"))


def test_a_pointwise_conv_on_avx2_runs_its_pixels_as_one_row_where_its_rows_tile_worse():
    """AVX2's register tiles take 4 to 6 pixel rows: a 7x7 map's rows computed whole are 7 rows of 8 pixels, its 49
    pixels in one row 50, in 5-row tiles (MobileNetV3-Large fp32 0.95x the time, EfficientNet-B0 0.98x, on a Zen 3);
    28x28's rows tile exactly and stay as they are, as does every map on AVX-512 (7-row tiles)."""
    avx2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    with avx2:
        after = dispatch.UseDotKernels({"float32"})(_pointwise_module(7, 7))
        exact = dispatch.UseDotKernels({"float32"})(_pointwise_module(28, 28))
    relax.analysis.well_formed(after)
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [call_op_name(c) for c in calls] == ["relax.reshape", "relax.call_tir", "relax.reshape"]
    spec = _kernel_spec(after, calls[1])
    assert spec.data_shape == (1, 1, 50, 32) and spec.stored_width == 49 and spec.out_shape[-1] == 64
    assert tensor_shape(calls[2]) == (1, 7, 7, 64)
    assert _kernel_spec(exact, next(b.value for b in exact["main"].body.blocks[0].bindings
                                    if call_op_name(b.value) == "relax.call_tir")).data_shape == (1, 28, 28, 32)
    with targets.get_target("cpu-avx512-bf16"):
        kept = dispatch.UseDotKernels({"float32"})(_pointwise_module(7, 7))
    assert "relax.reshape" not in [call_op_name(b.value) for b in kept["main"].body.blocks[0].bindings]
    if not all(targets.host_supports(feature) for feature in ("avx2", "fma")):
        pytest.skip("host CPU lacks AVX2 or FMA")
    mod = _pointwise_module(7, 7)
    x = [np.random.default_rng(4).standard_normal((1, 7, 7, 32)).astype("float32")]
    expected = relay_amp.run(mod, x)[0]
    got = run_executable(build(mod, avx2), x)[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()  # the same sums, in another order at most
