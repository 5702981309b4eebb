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
