"""tap_skips: a kernel whose spec names its padding skips, for each register tile, the taps that read only it."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import tirx as T

import relay_amp
from relay_amp import targets
from relay_amp.backend.cpu import amx, dispatch, kernels, tap_skips
from relay_amp.backend.cpu.pipeline import candidate_passes, untuned_schedule
from relay_amp.compile.build import build
from relay_amp.compile.tuning import prepare
from relay_amp.runtime import run_executable

from builders import seeded_torchvision_through_onnx, single_output_module, tensor
from conv_cases import max_relative_error, random_operands, reference_conv
from pass_checks import assert_transforms

# a 3x3 window dilated by 2 over a 2x2 image padded by 2 on every side: a 2x2 output
SPEC = kernels.spec_json(kernels.ConvSpec((1, 6, 6, 16), (3, 3), 16, data_dtype="float32", dilation=(2, 2),
                                          padding=(2, 2, 2, 2)))


@T.prim_func(private=True, s_tir=True)
def _register_tiles(data: T.Buffer((1, 6, 6, 16), "float32"), packed: T.Buffer((1, 3, 3, 16, 16, 1), "float32"),
                    acc: T.Buffer((1, 2, 2, 16), "float32")):
    """A kernel's accumulation: a tile of two pixels of an output row (unrolled) x 16 channels per tap."""
    for y in T.parallel(2):
        for row, col, chan in T.grid(3, 3, 16):
            for x in T.unroll(2):
                for lane in T.vectorized(16):
                    with T.sblock("acc_update"):
                        v_y, v_x, v_o = T.axis.remap("SSS", [y, x, lane])
                        v_row, v_col, v_chan = T.axis.remap("RRR", [row, col, chan])
                        T.sblock_attr({kernels.SPEC_ANNOTATION: SPEC})
                        acc[0, v_y, v_x, v_o] = acc[0, v_y, v_x, v_o] + data[
                            0, v_y + v_row * 2, v_x + v_col * 2, v_chan] * packed[0, v_row, v_col, v_chan, v_o, 0]


@T.prim_func(private=True, s_tir=True)
def _register_tiles_skipping(data: T.Buffer((1, 6, 6, 16), "float32"), packed: T.Buffer((1, 3, 3, 16, 16, 1),
                                                                                   "float32"),
                             acc: T.Buffer((1, 2, 2, 16), "float32")):
    for y in T.parallel(2):
        for row, col in T.grid(3, 3):
            if 2 <= row * 2 + y and row * 2 + y < 4 and 1 <= col and col < 2:
                for chan in range(16):
                    for x in T.unroll(2):
                        for lane in T.vectorized(16):
                            with T.sblock("acc_update"):
                                v_y, v_x, v_o = T.axis.remap("SSS", [y, x, lane])
                                v_row, v_col, v_chan = T.axis.remap("RRR", [row, col, chan])
                                T.sblock_attr({kernels.SPEC_ANNOTATION: SPEC})
                                acc[0, v_y, v_x, v_o] = acc[0, v_y, v_x, v_o] + data[
                                    0, v_y + v_row * 2, v_x + v_col * 2, v_chan] * packed[
                                        0, v_row, v_col, v_chan, v_o, 0]


def test_each_tap_is_tested_for_a_pixel_of_the_image_in_the_tile():
    """Around each tap's reduction over the channels: the tile's row (one) and its columns (two, unrolled inside
    the test) against the image's rows and columns 2 and 3."""
    assert_transforms(tap_skips.SkipPaddedTaps, tvm.IRModule({"main": _register_tiles}),
                      tvm.IRModule({"main": _register_tiles_skipping}))


def test_the_test_wraps_a_reduction_loop_not_a_serial_pixel_loop_inside_it():
    """The tile's pixels in a serial loop (a schedule that does not unroll them): the test still wraps the tap
    loop's body, over both pixels."""
    def serial(func):
        return tvm.IRModule({"main": tvm.script.from_source(func.script().replace("T.unroll(2)", "range(2)"))})

    assert_transforms(tap_skips.SkipPaddedTaps, serial(_register_tiles), serial(_register_tiles_skipping))


def test_a_kernel_without_padding_is_left():
    unpadded = kernels.spec_json(kernels.ConvSpec((1, 6, 6, 16), (3, 3), 16, data_dtype="float32",
                                                  dilation=(2, 2)))
    text = _register_tiles.script().replace(SPEC.replace('"', '\\"'), unpadded.replace('"', '\\"'))
    func = tvm.script.from_source(text)
    assert "padding" not in func.script()
    assert_transforms(tap_skips.SkipPaddedTaps, tvm.IRModule({"main": func}), tvm.IRModule({"main": func}))


@pytest.mark.parametrize("size,taps,stride,dilation,before,after,share", [
    (80, 3, 1, 24, 24, 24, 0.5),  # DeepLabV3's rate-24 ASPP conv on a 32x32 map: half the rows' taps read padding
    (9, 3, 1, 1, 1, 1, 2 / 21),  # a 3x3 conv on a 7x7 map: the first and last rows' outer taps
    (58, 3, 1, 1, 1, 1, 2 / 168),
    (9, 3, 2, 1, 1, 0, 1 / 12),  # stride 2, padded before only: the first output's first tap
])
def test_the_share_of_products_reading_padding(size, taps, stride, dilation, before, after, share):
    assert tap_skips.padded_products_share(size, taps, stride, dilation, before, after) == pytest.approx(share)


def test_only_kernels_skipping_enough_products_are_told_their_padding():
    """Dot-product kernels (a tile in one output row): their share along the height, 25% for ASPP's rate-12 conv
    on a 32x32 map, 9.5% for a 3x3 conv on a 7x7 map, 4.8% on a 14x14 one. AMX tile pairs: theirs, 25% for ASPP's
    conv (a pair is a row of 32 pixels), none on a 7x7 map (tiles flat across its rows) or 14x14 (a pair: 2 rows)."""
    aspp = kernels.ConvSpec((1, 56, 56, 2048), (3, 3), 256, dilation=(12, 12))
    assert amx.skipped_share(dataclasses.replace(aspp, padding=(12,) * 4)) == pytest.approx(0.25)
    assert tap_skips.worth_skipping(aspp, (12,) * 4, on_amx=False) and tap_skips.worth_skipping(aspp, (12,) * 4, True)
    for size, skips in ((7, True), (14, False)):
        spec = kernels.ConvSpec((1, size + 2, size + 2, 256), (3, 3), 256)
        assert amx.skipped_share(dataclasses.replace(spec, padding=(1,) * 4)) == 0
        assert tap_skips.worth_skipping(spec, (1,) * 4, on_amx=False) == skips
        assert not tap_skips.worth_skipping(spec, (1,) * 4, on_amx=True)


def test_int8_data_shifted_to_uint8_skips_no_taps_and_on_amx_it_does():
    """The dot-product kernel adds 128 to int8 data and takes 128 x each tap's weight sum back: its padding reads
    128. AMX multiplies the int8 data as it is (tdpbssd)."""
    aspp = kernels.ConvSpec((1, 56, 56, 64), (3, 3), 32, data_dtype="int8", out_dtype="int32", dilation=(12, 12))
    assert aspp.shifted and not tap_skips.worth_skipping(aspp, (12, 12, 12, 12), on_amx=False)
    assert tap_skips.worth_skipping(aspp, (12, 12, 12, 12), on_amx=True)


def _tests_taps(func: tirx.PrimFunc) -> bool:
    tests = []
    tvm_ffi.structural_walk(func.body, [(tirx.IfThenElse, tests.append)])
    return bool(tests)


def _compiled(spec: kernels.ConvSpec):
    """The scheduled kernel of `spec` after the passes a build gives it, and its library."""
    func = kernels.conv2d_nhwc(spec).with_attr("global_symbol", "main")
    target = targets.get_target("cpu-avx512-bf16")
    mod = candidate_passes(target)(tvm.IRModule({"main": func}))
    return mod["main"], tvm.compile(mod, target=target, tir_pipeline="relay_amp_cpu")


CASES = {  # spec (the padding added below), host feature needed to run it
    "fp32_rate_3": (kernels.ConvSpec((1, 12, 14, 16), (3, 3), 32, data_dtype="float32", out_dtype="float32",
                                     dilation=(3, 3)), "avx512f"),
    "bf16_rate_4_stride_2": (kernels.ConvSpec((1, 16, 15, 32), (3, 3), 16, (2, 2), "bfloat16", "float32",
                                              dilation=(4, 4)), "avx512_bf16"),
    "uint8_rate_2": (kernels.ConvSpec((1, 10, 11, 8), (3, 3), 16, data_dtype="uint8", out_dtype="int32",
                                      dilation=(2, 2)), "avx512_vnni"),
    "fp32_unstored_pixels": (kernels.ConvSpec((1, 12, 13, 16), (3, 3), 16, data_dtype="float32",
                                              out_dtype="float32", dilation=(3, 3), stored_width=6), "avx512f"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_skipping_taps_give_the_same_sums(case):
    """fp32 FMAs, bf16 pairs (vdpbf16ps), uint8 x int8 (vpdpbusd), a tile's unstored pixels: the
    kernel tests its taps, and its sums are the unskipping kernel's, bit for bit (the skipped taps add zeros), and
    numpy's."""
    spec, feature = CASES[case]
    dilation = spec.dilation[0]
    padded = dataclasses.replace(spec, padding=(dilation, dilation, dilation, dilation - 1))
    skipping, skipping_lib = _compiled(padded)
    whole, whole_lib = _compiled(spec)
    assert _tests_taps(skipping) and not _tests_taps(whole)
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}: the code is checked, not run")
    data, weight = random_operands(spec, np.random.default_rng(0))
    top, left, bottom, right = padded.padding
    height, width = spec.input_shape[1:3]
    outside = np.ones(spec.data_shape, bool)
    outside[:, top:height - bottom, left:width - right] = False
    data[outside] = 0
    packed = kernels.pack_weight(weight, "OIHW", spec.dot)
    outs = []
    for lib in (skipping_lib, whole_lib):
        args = [tvm.runtime.tensor(np.ascontiguousarray(data[:, :, :width])), tvm.runtime.tensor(packed)]
        args.append(tvm.runtime.empty(spec.stored_shape, spec.out_dtype, tvm.cpu()))
        lib["main"](*args)
        outs.append(args[-1].numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    expected = reference_conv(data, weight, spec)[:, :, :spec.stored_shape[2]]
    assert max_relative_error(outs[0], expected) < 1e-5


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_tuning_candidates_sampled_tile_skips_taps_too(seed):
    """MetaSchedule's candidates (a sampled register tile, its copies left to LLVM) get the test from the passes
    every candidate gets, and sum as the untuned kernel does."""
    spec = dataclasses.replace(CASES["fp32_rate_3"][0], padding=(3, 3, 3, 3))
    sch = tvm.s_tir.Schedule(kernels.conv2d_nhwc_compute(spec), seed=seed)
    kernels.schedule_kernel(sch, sch.get_sblock("acc"), tunable=True)
    target = targets.get_target("cpu-avx512-bf16")
    candidate = candidate_passes(target)(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}))
    assert _tests_taps(candidate["main"])
    if not targets.host_supports("avx512f"):
        pytest.skip("host CPU lacks avx512f: the code is checked, not run")
    data, weight = random_operands(spec, np.random.default_rng(0))
    data[:, :3] = data[:, -3:] = data[:, :, :3] = data[:, :, -3:] = 0
    packed = kernels.pack_weight(weight, "OIHW", spec.dot)
    outs = []
    for lib in (tvm.compile(candidate, target=target, tir_pipeline="relay_amp_cpu"), _compiled(spec)[1]):
        args = [tvm.runtime.tensor(data), tvm.runtime.tensor(packed),
                tvm.runtime.empty(spec.out_shape, "float32", tvm.cpu())]
        lib["main"](*args)
        outs.append(args[-1].numpy())
    assert max_relative_error(outs[0], outs[1].astype("float64")) < 1e-6  # tiles sum in other orders


def test_torchvisions_resnet18_skips_its_padded_taps_and_matches_pytorch():
    """A model the change was not made on (random weights, 64x64): its 3x3 convs on the 8x8, 4x4 and 2x2 maps read
    padding with 8% to 33% of their rows' products; their kernels test their taps, the stem's, the 16x16 map's, the
    1x1 convs' and the classifier's do not, and the fp32 build matches PyTorch within 1e-5 of the largest logit."""
    mod, x, expected = seeded_torchvision_through_onnx("resnet18", 64)
    target = relay_amp.targets.get_target(relay_amp.targets.host_preset())
    with target:
        prepared = prepare(mod, target)
    kernel_funcs = [func for gv, func in prepared.functions.items() if "dot_kernel" in gv.name_hint]
    padded = [spec for spec in map(tap_skips.annotated_spec, kernel_funcs) if any(spec.padding)]
    assert {spec.data_shape[1] - 2 for spec in padded} == {8, 4, 2}
    tested = [func for func in kernel_funcs
              if _tests_taps(tap_skips.SkipPaddedTaps(untuned_schedule(func, target).mod)["main"])]
    assert len(tested) == len(padded) < len(kernel_funcs)
    got = run_executable(relay_amp.build(mod, target), [x])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


AMX_CASES = {  # tile rows x taps: which kernel rows and taps a pair of tiles reads depends on where its pixels lie
    "bf16_rate_3_rows": kernels.ConvSpec((1, 15, 22, 64), (3, 3), 32, dilation=(3, 3)),  # 16-wide rows, taps apart
    "bf16_rate_2_flat": kernels.ConvSpec((1, 11, 11, 32), (3, 3), 32, dilation=(2, 2)),  # tiles across rows
    "bf16_3x3_one_run_a_row": kernels.ConvSpec((1, 9, 9, 32), (3, 3), 64),  # a kernel row's taps in one run
    "int8_rate_2_stride_2": kernels.ConvSpec((1, 21, 37, 32), (3, 3), 64, (2, 2), "int8", "int32",
                                             dilation=(2, 2)),  # overlapping tiles along 17-pixel rows
    "bf16_rate_2_grouped": kernels.ConvSpec((1, 12, 12, 64), (3, 3), 64, groups=2, dilation=(2, 2)),
}


@pytest.mark.parametrize("case", sorted(AMX_CASES))
def test_amx_kernels_skipping_taps_give_the_same_sums(case):
    """A pair of AMX tiles runs the kernel rows (and, where each tap is a run of its own, the taps) through which
    one of its pixels reads the image: the sums are the kernel's over every tap, bit for bit, and numpy's."""
    spec = AMX_CASES[case]
    dilation = spec.dilation[0]
    skipping = dataclasses.replace(spec, padding=(dilation, dilation, dilation, dilation))
    libs = [tvm.compile(tvm.IRModule({"main": amx.conv2d_nhwc(kernel).with_attr("global_symbol", "main")}),
                        target=targets.get_target("cpu-amx")) for kernel in (skipping, spec)]
    assert "T.Select" in amx.conv2d_nhwc(skipping).script() or amx.tiling(spec).taps == 1
    if not targets.host_runs_amx():
        pytest.skip("host CPU (or kernel) has no AMX: the code is checked, not run")
    data, weight = random_operands(spec, np.random.default_rng(0))
    data[:, :dilation] = data[:, -dilation:] = data[:, :, :dilation] = data[:, :, -dilation:] = 0
    buffer = np.zeros(amx.tiling(spec).data_shape, data.dtype)
    buffer[:, :spec.data_shape[1]] = data
    packed = amx.padded_weight(kernels.pack_weight(weight, "OIHW", spec.dot), spec)
    outs = []
    for lib in libs:
        tensors = [tvm.runtime.tensor(buffer), tvm.runtime.tensor(packed),
                   tvm.runtime.empty(spec.out_shape, spec.out_dtype, tvm.cpu())]
        lib["main"](*tensors)
        outs.append(tensors[-1].numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    tolerance = 0 if "int" in spec.data_dtype else 1e-5
    assert max_relative_error(outs[0], reference_conv(data, weight, spec)) <= tolerance


def _aspp_conv(weight_hwio: np.ndarray) -> tvm.IRModule:
    """DeepLab's rate-12 ASPP conv on a 32x32 map: a quarter of its products read padding in each direction."""
    return single_output_module(
        lambda x: relax.op.nn.conv2d(x, relax.const(weight_hwio), padding=12, dilation=12, data_layout="NHWC",
                                     kernel_layout="HWIO", out_dtype="float32"),
        tensor("x", (1, 32, 32, weight_hwio.shape[2]), "bfloat16"))


@pytest.mark.parametrize("amx_dtypes, attr, target", [(set(), kernels.FUSABLE_ATTR, "cpu-avx512-bf16"),
                                                      ({"bfloat16"}, amx.FUSABLE_ATTR, "cpu-amx")])
def test_a_dilated_convs_kernel_is_told_its_padding_and_its_build_matches_tvm(amx_dtypes, attr, target):
    """The dot-product kernel and the AMX kernel alike; the build against TVM's conv on the padded input."""
    weight = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(ml_dtypes.bfloat16)
    mod = _aspp_conv(weight)
    after = dispatch.UseDotKernels({"bfloat16"}, amx_dtypes=amx_dtypes)(mod)
    assert kernels.fusable_spec(after["relay_amp_dot_kernel1"], attr).padding == (12, 12, 12, 12)
    feature = "amx_bf16" if amx_dtypes else "avx512_bf16"
    if not (targets.host_runs_amx() if amx_dtypes else targets.host_supports(feature)):
        pytest.skip(f"host CPU lacks {feature}")
    data = np.random.default_rng(1).standard_normal((1, 32, 32, 32)).astype(ml_dtypes.bfloat16)
    got = run_executable(build(mod, target), [data])[0]
    expected = relay_amp.run(mod, [data])[0]
    assert max_relative_error(got, expected.astype("float64")) < 1e-5
