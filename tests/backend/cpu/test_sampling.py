"""sampling: grid_sample computed channels-last, each position's corners once and its channels as whole vectors,
with exactly TVM's results."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp.backend.cpu import sampling
from relay_amp.backend.cpu.sampling import GridSamplesChannelsLast
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms, prepared_function_names

SHAPE, GRID = (2, 16, 12, 10), (2, 2, 7, 5)  # TVM's grid is [N, 2 (x, y), H_out, W_out]


def _sampled(method="bilinear", padding="zeros", align_corners=False, shape=SHAPE) -> tvm.IRModule:
    data = relax.Var("data", relax.TensorType(shape, "float32"))
    grid = relax.Var("grid", relax.TensorType((shape[0], *GRID[1:]), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [data, grid]):
        with builder.dataflow():
            out = builder.emit_output(relax.op.image.grid_sample(data, grid, method=method, layout="NCHW",
                                                                 padding_mode=padding, align_corners=align_corners))
        builder.emit_func_output(out)
    return builder.get()


def test_a_grid_sample_reads_its_data_channels_last_and_moves_the_result_back():
    before = _sampled()
    data, grid = before["main"].params
    builder = relax.BlockBuilder()
    with builder.function("main", [data, grid]):
        with builder.dataflow():
            moved = builder.emit(relax.op.permute_dims(data, [0, 2, 3, 1]))
            compute = sampling._sampler("bilinear", "zeros", False, "float32")
            sampled = builder.emit(builder.call_te(compute, moved, grid, primfunc_name_hint="grid_sample"))
            out = builder.emit_output(relax.op.permute_dims(sampled, [0, 3, 1, 2]))
        builder.emit_func_output(out)
    assert_transforms(GridSamplesChannelsLast(), before, builder.get())


@pytest.mark.parametrize("method, padding, align_corners", [
    ("bilinear", "zeros", False), ("bilinear", "zeros", True), ("bilinear", "border", False),
    ("bilinear", "border", True), ("nearest", "zeros", False), ("nearest", "border", True)])
def test_sampling_channels_last_gives_tvms_results_exactly(method, padding, align_corners, monkeypatch):
    """Positions past every edge (the grid spans [-1.3, 1.3]) and on pixel centres; the CPU build against the same
    build with TVM's grid_sample (the same target: LLVM contracts the same products into FMAs), and within 1e-5
    of TVM's default build."""
    before = _sampled(method, padding, align_corners)
    assert "grid_sample" in prepared_function_names(before)
    rng = np.random.default_rng(0)
    data = rng.standard_normal(SHAPE).astype("float32")
    grid = rng.uniform(-1.3, 1.3, GRID).astype("float32")
    grid[0, :, 0, :] = np.linspace(-1, 1, 5)  # exact pixel positions
    got = run_executable(relay_amp.build(before, relay_amp.targets.host_preset()), [data, grid])[0]
    monkeypatch.setattr(sampling, "_channels_last", lambda call, builder: None)
    tvms = run_executable(relay_amp.build(before, relay_amp.targets.host_preset()), [data, grid])[0]
    np.testing.assert_array_equal(got, tvms)
    np.testing.assert_allclose(got, relay_amp.run(before, [data, grid])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method, padding, shape", [
    ("bicubic", "zeros", SHAPE), ("bilinear", "reflection", SHAPE),
    ("bilinear", "zeros", (2, sampling.MIN_CHANNELS - 1, 12, 10))])
def test_other_samplings_and_few_channels_stay_tvms(method, padding, shape):
    before = _sampled(method, padding, shape=shape)
    assert_transforms(GridSamplesChannelsLast(), before, before)


LEVELS, QUERIES, POINTS = ((12, 10), (6, 5)), 7, 3


def _deformable(keepdims: bool = False, method: str = "bilinear", levels_apart: bool = False) -> tvm.IRModule:
    """Multi-scale deformable attention's core as exporters write `ms_deform_attn_core_pytorch`: each level's
    grid_sample, stacked on a new axis after the points, flattened, times the attention weights, summed (with
    `levels_apart`, the levels reshaped into the queries' axis: a sum over each level's points alone)."""
    maps = [relax.Var(f"map{level}", relax.TensorType((2, 16, h, w), "float32")) for level, (h, w) in enumerate(LEVELS)]
    grids = [relax.Var(f"grid{level}", relax.TensorType((2, 2, QUERIES, POINTS), "float32"))
             for level in range(len(LEVELS))]
    flat = (2, 16, QUERIES * len(LEVELS), POINTS) if levels_apart else (2, 16, QUERIES, len(LEVELS) * POINTS)
    weights = relax.Var("weights", relax.TensorType((2, 1, *flat[2:]), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [*maps, *grids, weights]):
        with builder.dataflow():
            samples = [builder.emit(relax.op.expand_dims(relax.op.image.grid_sample(
                data, grid, method=method, layout="NCHW", padding_mode="zeros", align_corners=False), [3]))
                for data, grid in zip(maps, grids)]
            stacked = builder.emit(relax.op.reshape(relax.op.concat(samples, axis=-2), flat))
            out = builder.emit_output(relax.op.sum(relax.op.multiply(stacked, weights), axis=[-1], keepdims=keepdims))
        builder.emit_func_output(out)
    return builder.get()


def test_deformable_attentions_weighted_sum_is_computed_as_it_samples():
    """The stacked samples (89 MB a Deformable DETR encoder layer at 512x512) are never stored: one TE function
    samples the channels-last maps and sums each query's points."""
    before = _deformable()
    *maps, grid0, grid1, weights = before["main"].params
    builder = relax.BlockBuilder()
    with builder.function("main", [*maps, grid0, grid1, weights]):
        with builder.dataflow():
            moved = [builder.emit(relax.op.permute_dims(data, [0, 2, 3, 1])) for data in maps]
            summed = builder.emit(builder.call_te(sampling._weighted_sampler(2, False), *moved, grid0, grid1, weights,
                                                  primfunc_name_hint="weighted_grid_samples"))
            out = builder.emit_output(relax.op.permute_dims(summed, [0, 2, 1]))
        builder.emit_func_output(out)
    assert_transforms(sampling.FuseWeightedSamples(), before, builder.get())
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((2, 16, h, w)).astype("float32") for h, w in LEVELS]
    data += [rng.uniform(-1.2, 1.2, (2, 2, QUERIES, POINTS)).astype("float32") for _ in LEVELS]
    data.append(rng.uniform(0, 1, (2, 1, QUERIES, len(LEVELS) * POINTS)).astype("float32"))
    got = run_executable(relay_amp.build(before, relay_amp.targets.host_preset()), data)[0]
    np.testing.assert_allclose(got, relay_amp.run(before, data)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keepdims, method, levels_apart", [
    (True, "bilinear", False), (False, "nearest", False), (False, "bilinear", True)])
def test_other_sums_of_samples_stay(keepdims, method, levels_apart):
    before = _deformable(keepdims, method, levels_apart)
    assert_transforms(sampling.FuseWeightedSamples(), before, before)
