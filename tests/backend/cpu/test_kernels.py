"""kernels: the vdpbf16ps / vpdpbusd kernels are in the generated code and match numpy."""

import dataclasses
import json

import numpy as np
import pytest
import tvm
from tvm import te
from tvm.s_tir import meta_schedule as ms

import relay_amp
from relay_amp import targets
from relay_amp._ir import import_tensor_intrinsics
from relay_amp.backend.cpu import formula, kernels
from relay_amp.passes.quantize import realize

from conv_cases import max_relative_error, random_operands, reference_conv

CASES = {
    # name: (spec, host feature needed to run it)
    "bf16_matmul": (kernels.ConvSpec((1, 1, 24, 64), (1, 1), 48, (1, 1), "bfloat16", "float32"), "avx512_bf16"),
    "int8_conv_stride2": (kernels.ConvSpec((1, 9, 9, 8), (3, 3), 32, (2, 2), "int8", "int32"), "avx512_vnni"),
    "uint8_conv": (kernels.ConvSpec((2, 6, 6, 4), (3, 3), 16, (1, 1), "uint8", "int32"), "avx512_vnni"),
    "fp32_conv": (kernels.ConvSpec((1, 8, 8, 5), (3, 3), 32, (1, 1), "float32", "float32"), "avx512f"),
    # pixel tiles outermost: a 4 KB weight over 14 KB of data (the cases above: panels, their weights outweigh it)
    "fp32_matmul_pixels_first": (kernels.ConvSpec((1, 8, 14, 32), (1, 1), 32, (1, 1), "float32", "float32"),
                                 "avx512f"),
    # grouped: each 16-lane block reduces over its own 16 input channels; two 32-lane columns per group of 8 inputs
    "bf16_grouped_conv": (kernels.ConvSpec((1, 8, 8, 64), (3, 3), 64, (1, 1), "bfloat16", "float32", groups=4),
                          "avx512_bf16"),
    "int8_grouped_conv": (kernels.ConvSpec((1, 7, 7, 16), (3, 3), 64, (2, 2), "int8", "int32", groups=2),
                          "avx512_vnni"),
    # dilated (atrous, as DeepLab's): taps 2 and 3 pixels apart, in both dtypes the kernels reduce in lanes
    "bf16_dilated_conv": (kernels.ConvSpec((1, 11, 12, 16), (3, 3), 32, (1, 1), "bfloat16", "float32",
                                           dilation=(2, 3)), "avx512_bf16"),
    "int8_dilated_conv_stride2": (kernels.ConvSpec((1, 13, 13, 8), (3, 3), 16, (2, 2), "int8", "int32",
                                                   dilation=(3, 3)), "avx512_vnni"),
    # rows off the register tiles: the last tile's rows past the data are computed from its last pixel, not stored
    "bf16_matmul_stored_rows": (kernels.ConvSpec((1, 1, 25, 64), (1, 1), 48, (1, 1), "bfloat16", "float32",
                                                 stored_width=23), "avx512_bf16"),
    "int8_conv_stride2_stored_pixels": (kernels.ConvSpec((1, 9, 11, 8), (3, 3), 32, (2, 2), "int8", "int32",
                                                         stored_width=4), "avx512_vnni"),
    # channels off the weight's 16-lane blocks: 48 computed, the leading 45 (and 23 of 25 rows) stored
    "bf16_matmul_stored_channels": (kernels.ConvSpec((1, 1, 25, 64), (1, 1), 48, (1, 1), "bfloat16", "float32",
                                                     stored_width=23, stored_channels=45), "avx512_bf16"),
    # 8-bit codes on AVX2 hosts (no vpdpbusd): widened to int16, pairs of products summed by vpmaddwd
    "int8_conv_stride2_int16_pairs": (kernels.ConvSpec((1, 9, 9, 8), (3, 3), 32, (2, 2), "int8", "int32",
                                                       instruction=kernels.INT16_DOT.name), "avx2"),
    "uint8_matmul_int16_pairs_stored_rows": (kernels.ConvSpec((1, 1, 25, 64), (1, 1), 48, (1, 1), "uint8", "int32",
                                                              stored_width=23, instruction=kernels.INT16_DOT.name),
                                             "avx2"),
    # ... or, where the weight codes fit seven bits, uint8 data times them by vpmaddubsw (int8 data shifted)
    "int8_conv_stride2_byte_pairs": (kernels.ConvSpec((1, 9, 9, 8), (3, 3), 32, (2, 2), "int8", "int32",
                                                      instruction=kernels.AVX2_BYTE_DOT.name), "avx2"),
    "uint8_matmul_byte_pairs_stored_rows": (kernels.ConvSpec((1, 1, 25, 64), (1, 1), 48, (1, 1), "uint8", "int32",
                                                             stored_width=23, instruction=kernels.AVX2_BYTE_DOT.name),
                                            "avx2"),
    # ... on AVX-512 hosts without VNNI (Skylake-SP): vpmaddwd on zmm registers
    "int8_conv_stride2_int16_pairs_zmm": (kernels.ConvSpec((1, 9, 9, 8), (3, 3), 32, (2, 2), "int8", "int32",
                                                           instruction=kernels.AVX512_INT16_DOT.name), "avx512bw"),
    # ... on AVX-VNNI hosts without AVX-512 (Intel's client CPUs): vpdpbusd on ymm registers
    "int8_conv_stride2_avx_vnni": (kernels.ConvSpec((1, 9, 9, 8), (3, 3), 32, (2, 2), "int8", "int32",
                                                    instruction=kernels.AVX_VNNI_DOT.name), "avx_vnni"),
    # a 557 KB weight: output-channel panels outermost
    "fp32_matmul_large_weight": (kernels.ConvSpec((1, 2, 7, 256), (1, 1), 544, (1, 1), "float32", "float32"),
                                 "avx512f"),
}
INSTRUCTION = {kernels.BF16_DOT: "vdpbf16ps", kernels.INT8_DOT: "vpdpbusd", kernels.AVX_VNNI_DOT: "vpdpbusd",
               kernels.AVX512_INT16_DOT: "vpmaddwd", kernels.INT16_DOT: "vpmaddwd", kernels.FP32_FMA: "vfmadd",
               kernels.AVX2_BYTE_DOT: "vpmaddubsw"}
YMM_HOSTS = {"avx2": "haswell", "avx_vnni": "alderlake"}  # host feature -> an LLVM cpu with it and no AVX-512
NO_VNNI_CPU = "skylake-avx512"  # AVX-512 without VNNI: LLVM fuses no vpmaddwd and add into vpdpwssd there


@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c][1] not in (*YMM_HOSTS, "avx512bw")))  # see below
def test_kernel_uses_the_instruction_and_matches_numpy(case):
    spec, feature = CASES[case]
    func = kernels.conv2d_nhwc(spec).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=targets.get_target("cpu-avx512-bf16"))
    assert INSTRUCTION[spec.dot] in lib.mod.inspect_source("asm")
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}: the code is checked, not run")
    _assert_matches_numpy(lib, spec)


@pytest.mark.parametrize("case", ["fp32_conv", "fp32_matmul_large_weight",
                                  *(c for c in CASES if CASES[c][1] in YMM_HOSTS)])
def test_a_kernel_for_a_host_without_avx512_runs_in_ymm_registers_and_matches_numpy(case):
    """AVX2 hosts (Zen 3, Intel client CPUs) have no AVX-512: their fp32 FMA, int16-pair and AVX-VNNI kernels
    split each 16-lane vector into two ymm halves, in AVX2's register tile."""
    spec, feature = CASES[case]
    target = tvm.target.Target({"kind": "llvm", "mcpu": YMM_HOSTS.get(feature, "haswell")})
    with target:
        func = kernels.conv2d_nhwc(spec).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    asm = lib.mod.inspect_source("asm")
    assert INSTRUCTION[spec.dot] in asm and "ymm" in asm and "zmm" not in asm
    if not all(targets.host_supports(needed) for needed in ("avx2", "fma", feature)):
        pytest.skip(f"host CPU lacks AVX2, FMA or {feature}: the code is checked, not run")
    _assert_matches_numpy(lib, spec)


def test_8_bit_codes_on_avx512_without_vnni_take_int16_pairs_in_zmm_registers():
    spec, feature = CASES["int8_conv_stride2_int16_pairs_zmm"]
    target = tvm.target.Target({"kind": "llvm", "mcpu": NO_VNNI_CPU})
    with target:
        func = kernels.conv2d_nhwc(spec).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    assert "vpmaddwd" in lib.mod.inspect_source("asm") and "zmm" in lib.mod.inspect_source("asm")
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}: the code is checked, not run")
    _assert_matches_numpy(lib, spec)


def test_a_bf16_kernel_reads_its_broadcast_operand_in_the_product_instruction():
    """Each vdpbf16ps takes its input pair as an embedded-broadcast memory operand ({1to16}): with one column of
    output channels (208 = 13 blocks), a broadcast of its own before every product doubled the instructions the
    products took (RegNetY-400MF's 1x1 and grouped convs over 112 and 208 channels ran 1.24-1.30x over fp32)."""
    spec = kernels.ConvSpec((1, 14, 14, 208), (1, 1), 208, (1, 1), "bfloat16", "float32")
    func = kernels.conv2d_nhwc(spec).with_attr("global_symbol", "main")
    asm = tvm.compile(tvm.IRModule({"main": func}), target=targets.get_target("cpu-avx512-bf16")).mod.inspect_source("asm")
    products = [line for line in asm.splitlines() if "vdpbf16ps" in line]
    assert products and all("{1to16}" in line for line in products)
    assert "vbroadcastss" not in asm and "vpbroadcastd" not in asm


def _assert_matches_numpy(lib, spec: kernels.ConvSpec) -> None:
    """Run a compiled kernel on random operands (packed weight, + weight sums for int8) and compare with numpy."""
    data, weight = random_operands(spec, np.random.default_rng(0))
    expected = reference_conv(data, weight, spec)[:, :, :spec.stored_shape[2], :spec.stored_shape[3]]
    packed = kernels.pack_weight(weight, "OIHW", spec.dot)
    args = [np.ascontiguousarray(data[:, :, :spec.input_shape[2]]), packed]
    args += [kernels.weight_sums(packed)] if spec.shifted else []
    tensors = [tvm.runtime.tensor(a) for a in args] + [tvm.runtime.empty(spec.stored_shape, spec.out_dtype, tvm.cpu())]
    lib["main"](*tensors)
    tolerance = 0 if "int" in spec.data_dtype else 1e-5  # fp32 sums in another order; integers are exact
    assert max_relative_error(tensors[-1].numpy(), expected) <= tolerance


def test_a_spec_at_its_default_dilation_writes_the_json_earlier_tuning_records_hold():
    spec = kernels.ConvSpec((1, 8, 8, 16), (3, 3), 32)
    assert set(json.loads(kernels.spec_json(spec))) == {"data_shape", "kernel_size", "out_channels", "strides",
                                                         "data_dtype", "out_dtype", "weight_batch", "groups"}
    dilated = dataclasses.replace(spec, dilation=(2, 3))
    assert json.loads(kernels.spec_json(dilated))["dilation"] == [2, 3]
    assert kernels.spec_from_json(kernels.spec_json(spec)) == spec
    assert kernels.spec_from_json(kernels.spec_json(dilated)) == dilated
    assert dilated.window == (5, 7) and dilated.out_shape == (1, 4, 2, 32)


def test_8_bit_codes_take_vpdpbusd_where_the_target_has_it_and_int16_pairs_on_avx2_without_it():
    avx2, avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}), targets.get_target("cpu-avx512-bf16")
    assert kernels.target_intrinsic("int8", avx2) is kernels.target_intrinsic("uint8", avx2) is kernels.INT16_DOT
    alder_lake = tvm.target.Target({"kind": "llvm", "mcpu": "alderlake"})  # AVX-VNNI, no AVX-512
    assert kernels.target_intrinsic("int8", alder_lake) is kernels.AVX_VNNI_DOT
    skylake = tvm.target.Target({"kind": "llvm", "mcpu": NO_VNNI_CPU})
    assert kernels.target_intrinsic("uint8", skylake) is kernels.AVX512_INT16_DOT
    assert kernels.target_intrinsic("int8", avx512) is kernels.target_intrinsic("int8") is kernels.INT8_DOT
    assert kernels.target_intrinsic("bfloat16", avx2) is kernels.BF16_DOT  # dispatch widens bf16 there instead
    with avx2:
        assert kernels.instruction_name("int8", kernels.target_intrinsic("int8")) == kernels.INT16_DOT.name
        assert kernels.instruction_name("float32", kernels.target_intrinsic("float32")) == ""
    # pairs along axis 0: (127, 1) and (-127, -1) sum to 128 in magnitude, (127, 2) to 129; along axis 1 the pairs
    # (127, -128) and (2, -1) are of opposite signs, which never saturate
    fitting, saturating = np.array([[127, -127], [1, -1]], "int8"), np.array([[127, -128], [2, -1]], "int8")
    assert kernels.weight_intrinsic(kernels.INT16_DOT, fitting, 0) is kernels.AVX2_BYTE_DOT
    assert kernels.weight_intrinsic(kernels.INT16_DOT, saturating, 0) is kernels.INT16_DOT
    assert kernels.weight_intrinsic(kernels.INT16_DOT, saturating, 1) is kernels.AVX2_BYTE_DOT
    assert kernels.weight_intrinsic(kernels.INT16_DOT, np.array([1, 2, 127, 2], "int8"), 0) is kernels.INT16_DOT
    assert kernels.weight_intrinsic(kernels.INT16_DOT, fitting.astype("float32"), 0) is kernels.INT16_DOT
    for other in (kernels.AVX512_INT16_DOT, kernels.AVX_VNNI_DOT, kernels.INT8_DOT):  # AVX2's only
        assert kernels.weight_intrinsic(other, fitting, 0) is other
    with avx2:
        assert kernels.instruction_name("uint8", kernels.AVX2_BYTE_DOT) == kernels.AVX2_BYTE_DOT.name
    spec = kernels.ConvSpec((1, 4, 4, 8), (1, 1), 16, data_dtype="int8", instruction=kernels.INT16_DOT.name)
    assert spec.dot is kernels.INT16_DOT and not spec.shifted  # widened, not shifted: no weight sums
    assert spec.input_stage == "widened" and dataclasses.replace(spec, instruction="").input_stage == "shifted"
    assert dataclasses.replace(spec, data_dtype="uint8", instruction="").input_stage == ""
    with pytest.raises(relay_amp.DTypeError, match="vpdpwssd"):
        _ = dataclasses.replace(spec, instruction="vpdpwssd").dot
    assert kernels.pack_weight(np.ones((16, 8, 1, 1), "int8"), "OIHW", kernels.INT16_DOT).dtype == np.int16


def test_a_spec_storing_fewer_pixels_reads_only_the_input_they_need():
    spec = kernels.ConvSpec((1, 9, 11, 8), (3, 3), 32, (2, 2), stored_width=4)  # 5 outputs computed, 4 stored
    assert (spec.out_shape, spec.stored_shape, spec.input_shape) == ((1, 4, 5, 32), (1, 4, 4, 32), (1, 9, 9, 8))
    assert json.loads(kernels.spec_json(spec))["stored_width"] == 4
    assert kernels.spec_from_json(kernels.spec_json(spec)) == spec
    whole = dataclasses.replace(spec, stored_width=0)
    assert whole.stored_shape == whole.out_shape and whole.input_shape == whole.data_shape


def test_a_spec_storing_fewer_channels_gives_its_operands_every_computed_channel():
    spec = kernels.ConvSpec((1, 1, 25, 64), (1, 1), 48, stored_width=23, stored_channels=45)
    assert (spec.stored_shape, spec.operand_shape) == ((1, 1, 23, 45), (1, 1, 23, 48))
    assert json.loads(kernels.spec_json(spec))["stored_channels"] == 45
    assert "stored_channels" not in json.loads(kernels.spec_json(dataclasses.replace(spec, stored_channels=0)))


def test_grouped_weights_are_block_diagonal_over_16_lane_blocks():
    weight = np.random.default_rng(0).standard_normal((40, 3, 3, 3)).astype("float32")  # 10 groups of 4 channels
    dense, blocks = kernels.grouped_weight(weight, 10)
    assert blocks == 3 and dense.shape == (48, 12, 3, 3)  # 4 groups per block; a last block of 2, 8 zero outputs
    for out in range(40):
        slot = out // 4 % 4
        np.testing.assert_array_equal(dense[out, 3 * slot:3 * slot + 3], weight[out])
        assert not np.delete(dense[out], np.s_[3 * slot:3 * slot + 3], axis=0).any()
    assert not dense[40:].any()
    assert kernels.grouped_weight(np.ones((64, 2, 3, 3)), 2)[1] == 2  # groups of 32 outputs: no zeros
    assert kernels.grouped_weight(np.ones((64, 1, 3, 3)), 64) is None  # depthwise: 15 zeros per product
    assert kernels.grouped_weight(np.ones((48, 1, 3, 3)), 16) is None  # groups of 3: 16 lanes, 13 zeros


def test_grouped_weights_fill_amx_panels_of_32_outputs_when_asked():
    weight = np.random.default_rng(2).standard_normal((48, 8, 3, 3)).astype("float32")  # 6 groups of 8 (RegNetY's)
    dense, blocks = kernels.grouped_weight(weight, 6, block=32)
    assert blocks == 2 and dense.shape == (64, 32, 3, 3)  # 4 groups a panel; the last one 2, 16 zero outputs
    for out in range(48):
        slot = out // 8 % 4
        np.testing.assert_array_equal(dense[out, 8 * slot:8 * slot + 8], weight[out])
        assert not np.delete(dense[out], np.s_[8 * slot:8 * slot + 8], axis=0).any()
    assert kernels.grouped_weight(np.ones((96, 3, 3, 3)), 2, block=32)[1] == 2  # groups of 48: whole, overlapping
    assert kernels.grouped_weight(np.ones((64, 1, 3, 3)), 16, block=32) is None  # groups of 4: 8 a panel, 7 zeros


def test_groups_off_the_16_lanes_get_zero_outputs_up_to_whole_blocks_each():
    weight = np.random.default_rng(1).standard_normal((48, 24, 3, 3)).astype("float32")  # 2 groups of 24
    dense, blocks = kernels.grouped_weight(weight, 2)
    assert blocks == 2 and dense.shape == (64, 24, 3, 3)
    np.testing.assert_array_equal(dense[:24], weight[:24])
    np.testing.assert_array_equal(dense[32:56], weight[24:])
    assert not dense[24:32].any() and not dense[56:].any()
    assert [kernels.padded_group_width(w) for w in (4, 8, 16, 32, 6, 12, 24, 56)] == [4, 8, 16, 32, 16, 16, 32, 64]


def test_padded_groups_fill_amx_panels_where_they_fill_them_whole():
    weight = np.random.default_rng(3).standard_normal((24, 48, 1, 1)).astype("float32")  # MixNet-S: 2 groups of 12
    dense, blocks = kernels.grouped_weight(weight, 2, block=32)
    assert blocks == 1 and dense.shape == (32, 96, 1, 1)  # each group padded to 16, both in one block diagonal panel
    np.testing.assert_array_equal(dense[:12, :48], weight[:12])
    np.testing.assert_array_equal(dense[16:28, 48:], weight[12:])
    assert not dense[:, 48:][:16].any() and not dense[:, :48][16:].any() and not dense[12:16].any()
    assert kernels.grouped_weight(np.ones((36, 48, 1, 1)), 3, block=32)[1] == 3  # 3 groups of 16: not whole panels
    assert kernels.grouped_weight(np.ones((12, 48, 1, 1)), 2, block=32)[1] == 2  # groups of 6: 16 x 2 > 4 x 6


def test_quantize_keeps_fp32_sums_exactly_for_the_group_widths_no_kernel_takes():
    """realize.MIN_KERNEL_GROUP_WIDTH restates this module's rule (passes import no backend): they must agree."""
    for width in range(1, 65):
        taken = kernels.grouped_weight(np.ones((2 * width, 1, 3, 3)), 2) is not None
        assert taken == (width >= realize.MIN_KERNEL_GROUP_WIDTH), width


def test_pixel_tiles_go_outermost_when_the_weight_fits_in_cache_and_is_no_larger_than_the_data_or_per_image():
    assert kernels.pixels_outermost(kernels.ConvSpec((1, 56, 56, 64), (1, 1), 256, data_dtype="float32"))  # 64 KB
    assert kernels.pixels_outermost(kernels.ConvSpec((1, 28, 28, 512), (1, 1), 512, data_dtype="bfloat16"))  # 512 KB
    assert not kernels.pixels_outermost(kernels.ConvSpec((1, 28, 28, 512), (1, 1), 512, data_dtype="float32"))
    assert not kernels.pixels_outermost(CASES["fp32_matmul_large_weight"][0])  # 557 KB
    # ViT-S/16's projections: a 295 KB weight read by 197 tokens (151 KB)
    assert not kernels.pixels_outermost(kernels.ConvSpec((1, 208, 1, 384), (1, 1), 384, data_dtype="bfloat16"))
    # attention's P.V: a weight (27 KB) per head, one head's data (27 KB); its Q.K^T: keys a bit larger than the
    # queries (208 and 197 tokens), and in cache all the same; a per-image weight past the cache
    assert kernels.pixels_outermost(kernels.ConvSpec((6, 208, 1, 64), (1, 1), 64, data_dtype="bfloat16",
                                                     weight_batch=6))
    assert kernels.pixels_outermost(kernels.ConvSpec((6, 197, 1, 64), (1, 1), 208, data_dtype="bfloat16",
                                                     weight_batch=6))
    assert not kernels.pixels_outermost(kernels.ConvSpec((2, 64, 1, 1024), (1, 1), 1024, data_dtype="bfloat16",
                                                         weight_batch=2))
    assert not kernels.pixels_outermost(CASES["bf16_matmul"][0])  # a 6 KB weight over 3 KB of data
    assert kernels.pixels_outermost(CASES["fp32_matmul_pixels_first"][0])


def test_the_packed_weight_bytes_count_one_images_weight_in_its_packed_dtype():
    """A bf16 7x7x160 -> 960 conv: 160 x 960 x 2 bytes; an int8 3x3 conv's weight one byte a value; attention's
    keys one head's."""
    assert kernels.packed_weight_bytes(kernels.ConvSpec((1, 7, 7, 160), (1, 1), 960, data_dtype="bfloat16")) == 307200
    assert kernels.packed_weight_bytes(kernels.ConvSpec((1, 9, 9, 30), (3, 3), 64, data_dtype="int8",
                                                        out_dtype="int32")) == 3 * 3 * 30 * 64
    assert kernels.packed_weight_bytes(kernels.ConvSpec((6, 197, 1, 64), (1, 1), 208, data_dtype="bfloat16",
                                                        weight_batch=6)) == 64 * 208 * 2


def test_packing_does_not_depend_on_the_source_layout():
    weight = np.arange(32 * 8 * 3 * 3, dtype="float32").reshape(32, 8, 3, 3)
    from_oihw = kernels.pack_weight(weight, "OIHW", kernels.BF16_DOT)
    from_hwio = kernels.pack_weight(weight.transpose(2, 3, 1, 0), "HWIO", kernels.BF16_DOT)
    np.testing.assert_array_equal(from_oihw, from_hwio)
    assert from_oihw.shape == (2, 3, 3, 4, 16, 2)
    np.testing.assert_array_equal(from_oihw[1, 2, 0, 3, 5, 1], weight[16 + 5, 3 * 2 + 1, 2, 0])


def test_matmul_weights_pack_like_a_1x1_conv():
    weight = np.arange(8 * 16, dtype="float32").reshape(8, 16)
    np.testing.assert_array_equal(kernels.pack_weight(weight, "IO", kernels.INT8_DOT),
                                  kernels.pack_weight(weight.T[:, :, None, None], "OIHW", kernels.INT8_DOT))


def test_unsupported_dtype_and_channel_counts_are_dtype_errors():
    with pytest.raises(relay_amp.DTypeError, match="float16"):
        kernels.intrinsic_for("float16")
    with pytest.raises(relay_amp.DTypeError, match="input channels by 2; got 16 and 3"):
        kernels.conv2d_nhwc(kernels.ConvSpec((1, 4, 4, 3), (1, 1), 16))
    with pytest.raises(relay_amp.DTypeError, match="divisible by 16"):
        kernels.conv2d_nhwc(kernels.ConvSpec((1, 4, 4, 8), (1, 1), 24))
    with pytest.raises(relay_amp.DTypeError, match="by 2 in each of 4 groups; got 64 and 12"):
        kernels.conv2d_nhwc(kernels.ConvSpec((1, 4, 4, 12), (1, 1), 64, groups=4))  # 3 input channels per group


def _design_space(spec: kernels.ConvSpec) -> tuple:
    import_tensor_intrinsics()  # a TuneContext imports them otherwise, with TVMScript's slow frame scan
    mod = tvm.IRModule({"main": kernels.conv2d_nhwc_compute(spec).with_attr("global_symbol", "main")})
    context = ms.TuneContext(mod=mod, target=targets.get_target("cpu-avx512-bf16"), space_generator="post-order-apply",
                             task_name="kernel")
    return mod, context, context.generate_design_space()


def _instructions(trace, kind: str) -> list:
    return [inst for inst in trace.insts if inst.kind.name == kind]


@pytest.mark.parametrize("case", ["bf16_matmul", "int8_conv_stride2"])
def test_metaschedule_samples_register_tiles_of_the_tensorized_kernel(case):
    spec, feature = CASES[case]
    mod, context, spaces = _design_space(spec)
    assert len(spaces) == 1
    trace = spaces[0].trace
    assert [str(inst.attrs[0]) for inst in _instructions(trace, "Tensorize")] == [spec.dot.name]
    (rows,) = _instructions(trace, "SamplePerfectTile")
    column_samples = _instructions(trace, "SampleCategorical")[:1] if spec.out_channels % 32 == 0 else []
    out_w = spec.out_shape[2]
    variants = [[(rows, [out_w // r, r])] + [(c, 1 - trace.decisions[c]) for c in column_samples] for r in (1, out_w)]
    for decisions in variants:  # every sampled tile is a valid, tensorized, correct kernel
        sch = tvm.s_tir.Schedule(mod)
        variant = trace
        for inst, decision in decisions:
            variant = variant.with_decision(inst, decision, remove_postproc=True)
        variant.apply_to_schedule(sch, remove_postproc=True)
        for postproc in context.space_generator.postprocs:
            assert postproc.apply(sch)
        lib = tvm.compile(sch.mod, target=context.target)
        assert INSTRUCTION[spec.dot] in lib.mod.inspect_source("asm")
        if targets.host_supports(feature):
            _assert_matches_numpy(lib, spec)


def test_default_rule_gives_kernel_computes_the_default_tile_and_leaves_other_functions():
    spec, _ = CASES["int8_conv_stride2"]
    target = targets.get_target("cpu-avx512-bf16")
    scheduled = kernels.DotKernelRule().apply(kernels.conv2d_nhwc_compute(spec), target, False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"].with_attr("tirx.is_scheduled", True),
                                   kernels.conv2d_nhwc(spec))
    a, b = te.placeholder((16, 16), name="a"), te.placeholder((16, 16), name="b")
    k = te.reduce_axis((0, 16), "k")
    matmul = te.compute((16, 16), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k))
    assert kernels.DotKernelRule().apply(te.create_prim_func([a, b, matmul]), target, False) is None


@pytest.mark.parametrize("case", ["int8_conv_stride2", "int8_conv_stride2_stored_pixels", "bf16_matmul"])
def test_the_write_back_runs_unrolled_over_the_tiles_rows_and_columns_a_16_lane_vector_each(case):
    """The accumulators' copy to the output (where an epilogue runs) takes the register tile's pixel rows and
    output-channel columns unrolled, each a 16-lane vector, as the accumulators are: rolled, LLVM kept them in a
    stack buffer; 48 lanes as one vector (3 columns: bf16_matmul) made it move them lane by lane in the reduction
    loop. So too under a predicate (stored_pixels: the tile's rows past the stored width are not stored)."""
    spec, _ = CASES[case]
    sch = kernels.DotKernelRule().apply(kernels.conv2d_nhwc_compute(spec), targets.get_target("cpu-avx512-bf16"),
                                        False)
    *_, rows, columns, lanes = (sch.get(loop) for loop in sch.get_loops(sch.get_sblock("acc_global")))
    tile_columns, tile_rows = kernels.default_tile(spec.out_shape[2], spec.out_channels)
    assert (rows.kind, int(rows.extent)) == (tvm.tirx.ForKind.UNROLLED, tile_rows)
    assert (columns.kind, int(columns.extent)) == (tvm.tirx.ForKind.UNROLLED, tile_columns)
    assert (lanes.kind, int(lanes.extent)) == (tvm.tirx.ForKind.VECTORIZED, kernels.LANES)


@pytest.mark.parametrize("mcpu, registers", [("znver3", kernels.AVX2_REGISTERS), ("haswell", kernels.AVX2_REGISTERS),
                                             ("znver4", kernels.AVX512_REGISTERS),
                                             ("sapphirerapids", kernels.AVX512_REGISTERS)])
def test_the_untuned_register_tile_fits_the_targets_registers(mcpu, registers):
    """AVX-512's 32 zmm registers hold 15 accumulator vectors; on AVX2 each 16-lane vector takes two of 16 ymm
    registers, so a tile's accumulators, a weight vector per column and the broadcast fit in 16 (a 2 x 3 tile
    spilled: ResNet-50 fp32 in AVX2 code ran 1.84x slower than in 2 x 2 tiles on Zen 5)."""
    with tvm.target.Target({"kind": "llvm", "mcpu": mcpu}):
        assert kernels.register_file() == registers
        for width, channels in [(56, 64), (128, 768), (197, 384), (7, 2048), (28, 144)]:
            columns, rows = kernels.default_tile(kernels.padded_width(width, channels), channels)
            assert registers.per_vector * (columns * rows + columns) + 1 <= registers.registers
            assert columns * rows <= kernels.MAX_ROWS
    assert kernels.register_file() == kernels.AVX512_REGISTERS  # no target: AVX-512's


@pytest.mark.parametrize("width, channels, tile, padded", [
    (56, 64, (2, 7), 56),  # ResNet's convs: 14 accumulators, as before
    (56, 144, (1, 14), 56),  # one column where two do not divide the outputs
    (128, 768, (3, 4), 128),  # BERT's 128 tokens: 12 accumulators, not 2 x 4
    (128, 512, (4, 3), 129),  # 4 x 3 with one zero row, not 2 x 4
    (197, 384, (3, 5), 200),  # ViT's 197 tokens: 3 zero rows
    (394, 32, (2, 7), 399),
])
def test_the_untuned_tile_on_avx512_takes_the_most_accumulators_it_can_feed(width, channels, tile, padded):
    assert [kernels.row_budget(c) for c in (1, 2, 3, 4)] == [15, 7, 5, 3]  # the stack's 15 accumulators bind
    assert kernels.padded_width(width, channels) == padded
    assert kernels.default_tile(padded, channels) == tile


def test_the_untuned_tile_takes_the_columns_whose_weight_stays_in_a_cores_cache():
    """Each of an output's pixel tiles reads its columns' packed weight over the whole reduction again: DeepLabV3's
    atrous 3x3 convs over 2048 channels (18432 products an output, 1.2 MB of fp32 weight a column) take one column,
    as many as fit SLICE_BYTES where some do, and the usual tile where all fit (ResNet-50's last 3x3 convs)."""
    aspp = kernels.ConvSpec((1, 34, 34, 2048), (3, 3), 256, data_dtype="float32")
    assert kernels._weight_column_bytes(aspp) == 18432 * kernels.LANES * 4
    assert kernels.default_tile(32, 256) == (2, 4)
    assert kernels.default_tile(32, 256, kernels._weight_column_bytes(aspp)) == (1, 8)
    assert kernels.default_tile(128, 768, kernels.SLICE_BYTES // 2) == (2, 4)  # 3 x 4 rated best, 2 fit
    resnet = kernels.ConvSpec((1, 9, 9, 512), (3, 3), 512, data_dtype="float32")
    assert kernels.default_tile(7, 512, kernels._weight_column_bytes(resnet)) == kernels.default_tile(7, 512)
    sch = kernels.DotKernelRule().apply(kernels.conv2d_nhwc_compute(aspp), targets.get_target("cpu-avx512-bf16"),
                                        False)
    *_, rows, columns, _ = (sch.get(loop) for loop in sch.get_loops(sch.get_sblock("acc_global")))
    assert (int(rows.extent), int(columns.extent)) == (8, 1)


def test_the_untuned_tile_on_avx2_keeps_one_column_where_two_would_spill_rows():
    with tvm.target.Target({"kind": "llvm", "mcpu": "znver3"}):
        assert [kernels.row_budget(c) for c in (1, 2, 3, 4)] == [6, 2, 1, 0]
        assert kernels.default_tile(56, 144) == (1, 4)  # not 3 x 1: three accumulators, latency-bound
        assert kernels.default_tile(kernels.padded_width(197, 384), 384) == (1, 6)


@pytest.mark.parametrize("width, channels, tile, padded", [
    (56, 64, (1, 4), 56),  # ResNet's convs: not 2 x 2, which streams a weight vector for every 2 products
    (128, 768, (1, 4), 128),  # BERT's tokens
    (7, 512, (1, 4), 8),  # one zero row, not a 6-row tile's five
    (14, 256, (1, 5), 15),
])
def test_the_untuned_tile_on_avx2_streams_at_most_16_weight_bytes_a_cycle(width, channels, tile, padded):
    """Where a layer's weight panel outgrows L1, a Zen 3 core streams about 16 bytes of it a cycle from L2: a
    column's 64-byte weight vector then feeds at least 4 rows of products."""
    with tvm.target.Target({"kind": "llvm", "mcpu": "znver3"}):
        assert kernels.padded_width(width, channels) == padded
        assert kernels.default_tile(padded, channels) == tile
        columns, rows = tile
        assert columns * kernels.LANES * 4 / kernels.AVX2_REGISTERS.weight_bytes_per_cycle <= rows


def test_an_epilogue_stored_in_bf16_computes_its_exps_to_bf16s_accuracy():
    silu = formula.activation("relax.nn.silu", formula.X, fast=True)
    epilogue = kernels.Epilogue(steps=(kernels.Step(kernels.MAP, formula=silu),))
    accumulator = tvm.tirx.Var("accumulator", "float32")
    for out_dtype, computed in (("bfloat16", formula.narrowed(silu)), ("float16", formula.narrowed(silu)),
                                ("float32", silu)):
        expected = formula.expression(computed, tvm.tirx.Cast("float32", accumulator))
        tvm.ir.assert_structural_equal(epilogue.apply(accumulator, out_dtype, None),
                                       tvm.tirx.Cast(out_dtype, expected))
    assert formula.narrowed(silu) != silu


@pytest.mark.parametrize("out_dtype", ["int8", "uint8"])
def test_an_epilogue_requantized_to_8_bits_computes_its_gelu_without_a_division(out_dtype):
    """A quantized model's GELU write-back rounds to 8-bit steps of its range: its erf is the narrow
    polynomial (no quotient); the same GELU stored in bf16 keeps TVM's fast_erf (a quotient of polynomials)."""
    gelu = formula.activation("relax.nn.gelu", formula.X, fast=True)
    epilogue = kernels.Epilogue(steps=(kernels.Step(kernels.MAP, formula=gelu),))
    accumulator = tvm.tirx.Var("accumulator", "float32")
    computed = formula.expression(formula.narrowed(gelu, requantized=True), tvm.tirx.Cast("float32", accumulator))
    stored = epilogue.apply(accumulator, out_dtype, None)
    tvm.ir.assert_structural_equal(stored, tvm.tirx.Cast(out_dtype, computed))
    assert "divide" not in str(stored) and "relay_amp.fast_divide" in str(epilogue.apply(accumulator, "bfloat16", None))


@pytest.mark.parametrize("kind,shape,index", [
    (kernels.BIAS, (64,), (5,)), (kernels.SCALE, (64,), (5,)),
    (kernels.RESIDUAL, (1, 8, 4, 64), (0, 2, 3, 5)), (kernels.ROW_SCALE, (1, 8, 4, 1), (0, 2, 3, 0))])
def test_each_operand_step_reads_its_buffer_where_the_output_element_is(kind, shape, index):
    epilogue = kernels.Epilogue((kernels.Step(kernels.CLIP, low=0.0), kernels.Step(kind)), "bfloat16", "float32")
    dtype = "bfloat16" if kind == kernels.RESIDUAL else "float32"
    assert epilogue.operand_buffer(kernels.Step(kind), (1, 8, 4, 64)) == (shape, dtype)
    assert epilogue.operand_index(kernels.Step(kind), (0, 2, 3, 5)) == index
