"""amx: AMX tile kernels are in the generated code, match numpy, and take only the shapes their tiles fit."""

import subprocess
import sys

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

import relay_amp
from relay_amp import targets
from relay_amp.backend.cpu import amx, kernels

from conv_cases import max_relative_error, random_operands, reference_conv

BF16, F32 = "bfloat16", "float32"
CASES = {
    "bf16_matmul": kernels.ConvSpec((1, 1, 64, 96), (1, 1), 64),
    "bf16_matmul_17_rows_flat": kernels.ConvSpec((1, 1, 17, 64), (1, 1), 32),  # 2 tiles, the input gets a row
    "bf16_conv_stride2_batch2": kernels.ConvSpec((2, 17, 17, 64), (3, 3), 64, (2, 2)),  # 8 rows x 8 wide
    "bf16_stem_7x7": kernels.ConvSpec((1, 23, 23, 4), (7, 7), 32, (2, 2)),  # K steps of 28 values, 9 tiles
    "int8_conv": kernels.ConvSpec((1, 10, 10, 32), (3, 3), 64, (1, 1), "int8", "int32"),
    "bf16_7x7_output_flat": kernels.ConvSpec((1, 9, 9, 64), (3, 3), 64),  # tiles over the 9-wide input
    "int8_3x3_output_flat_batch2": kernels.ConvSpec((2, 5, 5, 32), (3, 3), 32, (1, 1), "int8", "int32"),
    "uint8_matmul": kernels.ConvSpec((1, 1, 48, 128), (1, 1), 32, (1, 1), "uint8", "int32"),
    "bf16_48_channels": kernels.ConvSpec((1, 1, 64, 64), (1, 1), 48),  # the last panel overlaps the first
    "int8_3x3_80_channels": kernels.ConvSpec((1, 6, 6, 32), (3, 3), 80, (1, 1), "int8", "int32"),
    "bf16_conv1d_19_outputs_stride2": kernels.ConvSpec((1, 1, 39, 64), (1, 3), 32, (1, 2)),  # padded rows: 2 tiles
    "int8_3x17_output_stride2": kernels.ConvSpec((1, 7, 35, 32), (3, 3), 64, (2, 2), "int8", "int32"),  # padded rows
    "bf16_grouped_pointwise": kernels.ConvSpec((1, 4, 16, 80), (1, 1), 64, groups=2),  # 40 channels in, 32 out a group
    "bf16_grouped_3x3_48_a_group": kernels.ConvSpec((1, 6, 10, 96), (3, 3), 96, groups=2),  # overlapping panels
    "int8_grouped_conv1d": kernels.ConvSpec((1, 1, 40, 128), (1, 5), 64, data_dtype="int8", out_dtype="int32",
                                            groups=2),  # 5 taps of 64 codes a group
    "bf16_3x3_16_channels": kernels.ConvSpec((1, 10, 12, 32), (3, 3), 16),  # one block, a zero one beside it
    "int8_16_channels": kernels.ConvSpec((1, 1, 40, 64), (1, 1), 16, data_dtype="int8", out_dtype="int32"),
    "bf16_atrous_3x3_rate_2": kernels.ConvSpec((1, 20, 20, 64), (3, 3), 64, dilation=(2, 2)),  # DeepLab's
    "bf16_atrous_7x7_output_flat": kernels.ConvSpec((1, 11, 11, 32), (3, 3), 32, dilation=(2, 2)),  # zero rows read
    "int8_atrous_rows_apart": kernels.ConvSpec((1, 12, 24, 32), (3, 3), 64, (1, 1), "int8", "int32",
                                               dilation=(3, 1)),  # taps together along a row, rows 3 apart
    "bf16_atrous_strided_grouped": kernels.ConvSpec((1, 19, 19, 64), (3, 3), 64, (2, 2), groups=2,
                                                    dilation=(2, 2)),
    "bf16_matmul_57_units": kernels.ConvSpec((1, 1, 608, 64), (1, 1), 96),  # 19 pairs x 3 panels on 32 workers
    "bf16_matmul_weight_past_the_cache": kernels.ConvSpec((1, 1, 100, 1024), (1, 1), 288),  # 590 KB, by panels
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_uses_tiles_and_matches_numpy(case):
    spec = CASES[case]
    func = amx.conv2d_nhwc(spec).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=targets.get_target("cpu-amx"))
    assembly = lib.mod.inspect_source("asm")
    assert amx.PRODUCTS[spec.data_dtype].instruction in assembly and "ldtilecfg" in assembly
    if not (targets.host_runs_amx()):
        pytest.skip("host CPU (or kernel) has no AMX: the code is checked, not run")
    data, weight = random_operands(spec, np.random.default_rng(0))
    tiles = amx.tiling(spec)
    buffer = np.zeros(tiles.data_shape, data.dtype)
    buffer[:, :spec.data_shape[1]] = data
    packed = amx.padded_weight(kernels.pack_weight(weight, "OIHW", spec.dot), spec)
    tensors = [tvm.runtime.tensor(buffer), tvm.runtime.tensor(packed),
               tvm.runtime.empty(spec.out_shape, spec.out_dtype, tvm.cpu())]
    lib["main"](*tensors)
    got = tensors[-1].numpy()
    tolerance = 0 if "int" in spec.data_dtype else 1e-5  # fp32 tile sums in another order; integers are exact
    assert max_relative_error(got, reference_conv(data, weight, spec)) <= tolerance


def test_the_cases_take_both_parallel_orders():
    """Runs of pixel tiles through every panel (a weight in cache) and panels through every run."""
    assert {amx.pixels_outermost(spec) for spec in CASES.values()} == {True, False}


def test_a_weight_in_cache_larger_than_the_data_takes_pixels_outermost():
    """MobileNetV2's 7x7x160 -> 960 (a 307 KB weight, 16 KB of data): by pixels on AMX, where the dot-product
    kernels split it by panels; a weight past CACHE_BYTES stays split by panels."""
    expansion = kernels.ConvSpec((1, 7, 7, 160), (1, 1), 960)
    assert amx.pixels_outermost(expansion) and not kernels.pixels_outermost(expansion)
    assert not amx.pixels_outermost(CASES["bf16_matmul_weight_past_the_cache"])


@pytest.mark.parametrize("pixels_first", [True, False])
def test_workers_take_even_runs_of_units_each_unit_once(pixels_first):
    """7 pairs x 12 panels (ViT-S/16's projection) on 32 workers: every (panel, pair) once, each worker 2 or 3
    units; by pixels the first half of the workers (one of two threads) takes pairs 0-3 and the second 3-6."""
    pairs, panels, workers = 7, 12, 32
    runs = [[amx._unit_panel_and_pair(unit, panels, pairs, pixels_first)
             for unit in range(worker * pairs * panels // workers, (worker + 1) * pairs * panels // workers)]
            for worker in range(workers)]
    assert sorted(unit for run in runs for unit in run) == [(panel, pair) for panel in range(panels)
                                                            for pair in range(pairs)]
    assert {len(run) for run in runs} == {2, 3}
    if pixels_first:
        halves = [{pair for run in runs[half * 16:(half + 1) * 16] for _, pair in run} for half in range(2)]
        assert halves == [{0, 1, 2, 3}, {3, 4, 5, 6}]


def test_the_kernel_configures_the_tiles_once_a_worker():
    """57 units on 32 parallel workers (no target names the cores): each configures the tiles, runs its units
    (block calls alone), releases."""
    func = amx.conv2d_nhwc(CASES["bf16_matmul_57_units"])
    parallel = [loop for loop in _nodes(func.body, tvm.tirx.For) if loop.kind == tvm.tirx.ForKind.PARALLEL]
    assert [int(loop.extent) for loop in parallel] == [amx.PARALLEL_ITEMS]
    units = [loop for loop in _nodes(parallel[0].body, tvm.tirx.For) if not isinstance(loop.min, tvm.tirx.IntImm)]
    assert len(units) == 1  # from worker x 57 // 32 on
    assert _externs(parallel[0].body) - _externs(units[0].body) == {"relay_amp_amx_tdpbf16ps_config",
                                                                     "relay_amp_amx_tdpbf16ps_release"}
    assert _externs(units[0].body) == {"relay_amp_amx_tdpbf16ps"}


@pytest.mark.parametrize("cores, workers", [(2, 2), (8, 8), (64, 57)])
def test_the_kernel_runs_one_worker_a_core_of_its_target(cores, workers):
    """Built for a target of `cores` cores, a kernel of 57 units runs as many workers (at most one a unit)."""
    with tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": cores}):
        func = amx.conv2d_nhwc(CASES["bf16_matmul_57_units"])
    parallel = [loop for loop in _nodes(func.body, tvm.tirx.For) if loop.kind == tvm.tirx.ForKind.PARALLEL]
    assert [int(loop.extent) for loop in parallel] == [workers]


def _nodes(root, node_type) -> list:
    """The nodes of type `node_type` under `root`."""
    found = []
    tvm_ffi.structural_walk(root, [(node_type, found.append)])
    return found


def _externs(root) -> set:
    """The names of the external functions called under `root`."""
    return {str(call.args[0].value) for call in _nodes(root, tvm.ir.Call) if call.op.name == "tirx.call_extern"}


def test_an_overlapping_last_panel_stores_its_own_channels_through_the_epilogue():
    """80 channels: the third block computes channels 48-79 and stores 64-79, each with its own bias and residual."""
    spec = kernels.ConvSpec((1, 1, 32, 64), (1, 1), 80)
    epilogue = kernels.Epilogue((kernels.Step(kernels.BIAS), kernels.Step(kernels.RESIDUAL)), F32, F32)
    func = amx.conv2d_nhwc(spec, epilogue).with_attr("global_symbol", "main")
    script = func.script()
    assert "T.min(" in script and script.count("T.vectorized(16)") == 4  # the panel's start; 2 tiles, 2 halves each
    if not targets.host_runs_amx():
        pytest.skip("host CPU (or kernel) has no AMX: the code is checked, not run")
    rng = np.random.default_rng(2)
    data, weight = random_operands(spec, rng)
    bias = rng.standard_normal(80).astype(F32)
    residual = rng.standard_normal(spec.out_shape).astype(F32)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=targets.get_target("cpu-amx"))
    tensors = [tvm.runtime.tensor(x) for x in (data, kernels.pack_weight(weight, "OIHW", spec.dot), bias, residual)]
    out = tvm.runtime.empty(spec.out_shape, F32, tvm.cpu())
    lib["main"](*tensors, out)
    expected = reference_conv(data, weight, spec) + bias + residual
    assert max_relative_error(out.numpy(), expected) <= 1e-5  # fp32 tile sums in another order


def test_an_exported_amx_kernel_runs_in_a_fresh_process(tmp_path):
    """The kernel asks Linux for the tile state itself: a process that never imported relay_amp runs it."""
    if not targets.host_runs_amx():
        pytest.skip("host CPU (or kernel) has no AMX")
    spec = CASES["bf16_matmul"]
    func = amx.conv2d_nhwc(spec).with_attr("global_symbol", "main")
    tvm.compile(tvm.IRModule({"main": func}), target=targets.get_target("cpu-amx")).export_library(tmp_path / "k.so")
    data, weight = random_operands(spec, np.random.default_rng(1))
    np.save(tmp_path / "data.npy", data.view("uint16"))
    np.save(tmp_path / "packed.npy", kernels.pack_weight(weight, "OIHW", spec.dot).view("uint16"))
    script = f"""
import ml_dtypes, numpy as np, tvm
lib = tvm.runtime.load_module("{tmp_path / 'k.so'}")
data, packed = (tvm.runtime.tensor(np.load("{tmp_path}/" + name + ".npy").view(ml_dtypes.bfloat16))
                for name in ("data", "packed"))
out = tvm.runtime.empty({spec.out_shape}, "float32", tvm.cpu())
lib["main"](data, packed, out)
np.save("{tmp_path / 'out.npy'}", out.numpy())
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    got = np.load(tmp_path / "out.npy")
    assert max_relative_error(got, reference_conv(data, weight, spec)) <= 1e-5  # fp32 tile sums, reordered


def _call_arguments(spec: kernels.ConvSpec) -> tuple[list[int], list[int]]:
    """The integer arguments of the kernel's tile configuration and of its block call."""
    sch = tvm.s_tir.Schedule(amx.conv2d_nhwc(spec))
    _, config, pairs, _ = sch.get(sch.get_sblock("amx_block")).body.seq  # scratch, configure, loop over pairs, release
    call = pairs.body.seq[0].value  # the block call; the epilogue's stores follow it
    assert call.args[0].value == amx.PRODUCTS[spec.data_dtype].symbol
    return [int(arg) for arg in config.value.args[1:]], [int(arg) for arg in call.args[6:]]


def test_a_strided_conv_walks_its_input_with_tile_strides():
    spec = kernels.ConvSpec((1, 9, 9, 64), (3, 3), 64, (2, 2))  # 4x4 output
    # tiles of 4 rows, K steps of 64 bytes; next pixel 2 x 64 x 2 bytes on, next kernel row 9 x 64 x 2 bytes on,
    # 3 kernel rows of 3 x 64 x 2 bytes, accumulator pixels 32 x 4 bytes apart in the scratch tiles
    assert _call_arguments(spec) == ([4, 64], [64, 256, 1152, 3, 384, 128, 1, 128, 3, 1])  # all rows run


def test_a_grouped_conv_steps_over_each_tap_of_its_groups_channels():
    spec = kernels.ConvSpec((1, 6, 10, 96), (3, 3), 96, groups=2)  # 4x8 outputs, tiled flat over the 10-wide input
    # K steps of 48 bytes (48 bf16 channels a group: 96 bytes a tap), pixels 96 x 2 bytes apart, kernel rows 10 x 96
    # x 2 bytes apart, 3 kernel rows of 3 taps of 96 bytes, each tap 96 x 2 bytes after the one before
    assert _call_arguments(spec) == ([16, 48], [48, 192, 1920, 3, 288, 128, 3, 192, 3, 3])  # all rows, taps run


def test_an_atrous_conv_reads_its_taps_and_kernel_rows_dilation_apart():
    spec = kernels.ConvSpec((1, 20, 20, 64), (3, 3), 64, dilation=(2, 2))  # DeepLab's rate 2: 16x16 outputs
    # tiles of 16 pixels, K steps of 64 bytes; next pixel 64 x 2 bytes on, next kernel row 2 x 20 x 64 x 2 bytes on,
    # 3 kernel rows of 3 taps of 128 bytes each, each tap 2 x 64 x 2 bytes after the one before
    assert _call_arguments(spec) == ([16, 64], [64, 128, 5120, 3, 384, 128, 3, 256, 3, 3])  # all rows, taps run


def test_small_stride_1_outputs_tile_flat_over_the_input_width():
    tiles = amx.tiling(kernels.ConvSpec((1, 9, 9, 512), (3, 3), 512))  # ResNet-18's last stage: 7x7 outputs
    # 61 flat pixels (6 rows of 9, then 7) in 4 tiles of 16, the last from pixel 45 (it overlaps the third): it
    # reads up to the input's last pixel, so no zero rows
    assert (tiles.tile_rows, tiles.tiles_per_image, tiles.run_span) == (16, 4, 61)
    assert tiles.data_shape == (1, 9, 9, 512) and tiles.out_shape == (1, 7, 9, 512)
    assert [int(tiles.tile_start(t)) for t in range(4)] == [0, 16, 32, 45]
    tiny = amx.tiling(kernels.ConvSpec((1, 4, 4, 64), (3, 3), 64))  # 2x2 outputs: 6 flat pixels, one tile
    assert (tiny.tiles_per_image, tiny.data_shape, tiny.run_tiles) == (1, (1, 7, 4, 64), 0)  # zero rows to read
    rows = amx.tiling(kernels.ConvSpec((1, 16, 16, 256), (3, 3), 256))  # 14 of 16 rows filled either way
    assert (rows.tile_rows, rows.data_shape, rows.out_shape) == (14, (1, 16, 16, 256), (1, 14, 14, 256))


def test_strided_outputs_that_tile_badly_take_tiles_of_16_along_each_row():
    """wav2vec2's conv1d of 799 outputs (17 x 47: rows tile only by 1) as 50 tiles of 16, the last one from pixel
    783 (it recomputes 784-799's 15 pixels before it): no input read past the row. In 2-D, per output row."""
    conv1d = amx.tiling(kernels.ConvSpec((1, 1, 1599, 512), (1, 3), 512, (1, 2)))
    assert (conv1d.tile_rows, conv1d.tiles_per_image, conv1d.run_tiles, conv1d.run_span) == (16, 50, 50, 799)
    assert conv1d.data_shape == (1, 1, 1599, 512) and conv1d.out_shape == (1, 1, 799, 512)
    assert [int(conv1d.tile_start(t)) for t in (0, 1, 48, 49)] == [0, 16, 768, 783]
    image = amx.tiling(kernels.ConvSpec((1, 7, 35, 32), (3, 3), 64, (2, 2)))  # 3 x 17 outputs in 3 x 2 tiles
    assert (image.tiles_per_image, image.data_shape, image.out_shape) == (6, (1, 7, 35, 32), (1, 3, 17, 64))
    assert [int(image.tile_start(t)) for t in range(6)] == [0, 1, 17, 18, 34, 35]
    rows = amx.tiling(kernels.ConvSpec((1, 16, 16, 64), (3, 3), 64, (2, 2)))  # 7 of 16 rows filled either way
    assert (rows.tile_rows, rows.out_shape, rows.run_tiles) == (7, (1, 7, 7, 64), 0)


@pytest.mark.parametrize("spec, reason", [
    (kernels.ConvSpec((1, 1, 64, 64), (1, 1), 16, out_dtype=BF16), "tiles accumulate fp32 (16 channels)"),
    (kernels.ConvSpec((1, 1, 64, 64), (1, 1), 40), "output channels not in 16-blocks"),
    (kernels.ConvSpec((1, 1, 64, 64), (1, 1), 64, out_dtype=BF16), "tiles accumulate fp32"),
    (kernels.ConvSpec((1, 1, 64, 64), (1, 1), 64, data_dtype=F32, out_dtype=F32), "no fp32 tiles"),
    (kernels.ConvSpec((1, 1, 64, 64), (1, 1), 64, data_dtype="int8", out_dtype=F32), "int8 accumulates int32"),
    (kernels.ConvSpec((1, 1, 5, 64), (1, 1), 64, (1, 2)), "3 pixels at stride 2: 3 of 16 rows filled either way"),
    (kernels.ConvSpec((1, 1, 16, 6), (1, 1), 32, data_dtype="int8", out_dtype="int32"), "6 int8 channels: 4-byte groups"),
    (kernels.ConvSpec((1, 1, 84, 64), (1, 1), 64, stored_width=79), "a row's computed pixels past those stored"),
    (kernels.ConvSpec((1, 1, 64, 64), (1, 1), 64, stored_channels=48), "the leading channels stored"),
    (kernels.ConvSpec((1, 1, 64, 64), (1, 1), 64, groups=4), "16 output channels a group: no panel of 32"),
    (kernels.ConvSpec((1, 1, 64, 6), (1, 1), 64, groups=2), "3 bf16 channels a group: not 4-byte groups"),
])
def test_shapes_the_tiles_do_not_fit_are_refused(spec, reason):
    assert not amx.supports(spec), reason
    with pytest.raises(relay_amp.DTypeError, match="AMX kernel"):
        amx.conv2d_nhwc(spec)


def test_a_16_channel_conv_stores_one_block_of_a_panel_whose_weight_ends_in_zeros():
    spec = kernels.ConvSpec((1, 4, 16, 64), (1, 1), 16)
    packed = kernels.pack_weight(np.ones((16, 64, 1, 1), F32), "OIHW", spec.dot)
    padded = amx.padded_weight(packed, spec)
    assert padded.shape == (2, *packed.shape[1:]) and not padded[1].any() and (padded[0] == packed[0]).all()
    wide = kernels.ConvSpec((1, 4, 16, 64), (1, 1), 48)
    assert amx.padded_weight(packed, wide) is packed
    script = amx.conv2d_nhwc(spec).script()
    assert script.count("T.vectorized(16)") == 2 and "T.vectorized(32)" not in script  # 2 tiles, their first half


def test_target_dtypes_follow_the_target_features():
    assert amx.target_dtypes(targets.get_target("cpu-amx")) == {BF16, "int8", "uint8"}
    assert not amx.target_dtypes(targets.get_target("cpu-avx512-bf16"))
    assert not amx.target_dtypes(targets.get_target("cuda-tensorcore"))


def test_the_scratch_tiles_keep_every_row_through_tvms_buffer_compaction():
    """A 2x2 output stores 4 pixels of each 16-row tile, but the tile store writes all 16: TVM's compaction must
    not cut the scratch accumulator to the rows the epilogue reads (it did, and the store overran the stack)."""
    spec = kernels.ConvSpec((1, 2, 2, 64), (1, 1), 64)
    assert amx.tiling(spec).tile_rows == 16
    compacted = tvm.s_tir.transform.CompactBufferAllocation()(tvm.IRModule({"main": amx.conv2d_nhwc(spec)}))
    assert "T.alloc_buffer((2, 16, 32))" in compacted["main"].script()


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_built_conv_on_fewer_pixels_than_a_tile_runs_and_matches_numpy(dtype):
    """relay_amp's own build (its stack buffers) of a 1x1 conv over a 2x2 image: 4 pixels in a 16-row tile."""
    from builders import single_output_module, tensor

    rng = np.random.default_rng(3)
    weight = np.round(rng.standard_normal((64, 96, 1, 1)) * 3).astype(F32)  # integers: int8 holds them exactly
    mod = single_output_module(lambda x: relax.op.nn.conv2d(x, relax.const(weight), data_layout="NHWC",
                                                             kernel_layout="OIHW"), tensor("x", (1, 2, 2, 96)))
    low = relay_amp.recast(mod, dtype, "int32") if dtype == "int8" else \
        relay_amp.to_mixed_precision(mod, dtype)
    executable = relay_amp.build(low, targets.get_target("cpu-amx"))  # a Target: built on any host
    assert "ldtilecfg" in executable.mod.imports[0].inspect_source("asm")
    if not targets.host_runs_amx():
        pytest.skip("host CPU (or kernel) has no AMX: the code is checked, not run")
    x = rng.standard_normal((1, 2, 2, 96)).astype(F32)
    if dtype == "int8":
        x = np.round(x * 20)
    got = relay_amp.runtime.run_executable(executable, [x])[0]
    expected = np.einsum("bhwi,oi->bhwo", x, weight[:, :, 0, 0])
    assert max_relative_error(got, expected) <= (0 if dtype == "int8" else 0.02)  # bf16 operands round


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("shape, channels, kernel, groups, padding", [
    ((1, 8, 8, 80), 64, (1, 1), 2, (0, 0, 0, 0)),  # MixNet's grouped pointwise convs: 40 in, 32 out a group
    ((1, 1, 50, 96), 96, (1, 16), 2, (0, 8, 0, 7)),  # wav2vec2's positional conv: 48 a group, overlapping panels
    ((1, 8, 8, 48), 48, (3, 3), 6, (1, 1, 1, 1)),  # RegNetY's groups of 8: four a 32-channel panel, block diagonal
    ((1, 14, 14, 32), 16, (1, 1), 1, (0, 0, 0, 0)),  # MobileNetV2's first projection: 16 channels, a zero block added
    ((1, 8, 8, 96), 24, (1, 1), 2, (0, 0, 0, 0)),  # MixNet-S's groups of 12, each padded to 16, both in one panel
])
def test_a_built_conv_of_part_panels_runs_on_tiles_and_matches_numpy(dtype, shape, channels, kernel, groups, padding):
    """relay_amp's own build for cpu-amx of a conv whose groups' output channels are not whole 32-channel panels:
    each group's channels per tap on AMX tiles, or a 16-channel conv's one block beside a zero block."""
    from builders import single_output_module, tensor

    rng = np.random.default_rng(4)
    weight = np.round(rng.standard_normal((channels, shape[3] // groups, *kernel)) * 3).astype(F32)
    mod = single_output_module(lambda x: relax.op.nn.conv2d(x, relax.const(weight), padding=padding, groups=groups,
                                                             data_layout="NHWC", kernel_layout="OIHW"),
                               tensor("x", shape))
    low = relay_amp.recast(mod, dtype, "int32") if dtype == "int8" else relay_amp.to_mixed_precision(mod, dtype)
    executable = relay_amp.build(low, targets.get_target("cpu-amx"))  # a Target: built on any host
    assert "ldtilecfg" in executable.mod.imports[0].inspect_source("asm")
    if not targets.host_runs_amx():
        pytest.skip("host CPU (or kernel) has no AMX: the code is checked, not run")
    x = np.round(rng.standard_normal(shape) * (20 if dtype == "int8" else 1)).astype(F32)
    top, left, bottom, right = padding
    padded = np.pad(x, [(0, 0), (top, bottom), (left, right), (0, 0)]).astype(F32)
    spec = kernels.ConvSpec(padded.shape, kernel, channels, groups=groups)
    got = relay_amp.runtime.run_executable(executable, [x])[0]
    assert max_relative_error(got, reference_conv(padded, weight, spec)) <= (0 if dtype == "int8" else 0.02)


def test_a_runtime_matmul_of_16_columns_packs_a_zero_block_beside_its_operand():
    """Both operands at run time, 16 output columns: the packed operand gains its zero block by Relax ops."""
    from builders import single_output_module, tensor

    mod = single_output_module(relax.op.matmul, tensor("x", (1, 64, 32)), tensor("y", (1, 32, 16)))
    executable = relay_amp.build(relay_amp.to_mixed_precision(mod, BF16), targets.get_target("cpu-amx"))
    assert "ldtilecfg" in executable.mod.imports[0].inspect_source("asm")
    if not targets.host_runs_amx():
        pytest.skip("host CPU (or kernel) has no AMX: the code is checked, not run")
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((1, 64, 32)).astype(F32), rng.standard_normal((1, 32, 16)).astype(F32)
    got = relay_amp.runtime.run_executable(executable, [x, y])[0]
    assert max_relative_error(got, x @ y) <= 0.02  # bf16 operands round
