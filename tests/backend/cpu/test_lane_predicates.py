"""lane_predicates: a vector loop whose predicate cuts its last lanes runs in whole vectors where every lane passes,
lane by lane only where the vector is cut."""

import numpy as np
import pytest
import tvm
from tvm import tirx
from tvm.script import tirx as T

import relay_amp
from relay_amp.backend.cpu import lane_predicates
from relay_amp.backend.cpu.pipeline import untuned_schedule
from relay_amp.compile.tuning import prepare
from relay_amp.runtime import run_executable
from relay_amp.tools import models

from builders import seeded_torchvision_through_onnx
from pass_checks import assert_transforms


@T.prim_func(private=True, s_tir=True)
def _stored_channels(acc: T.Buffer((4, 32), "float32"), out: T.Buffer((3, 20), "float32")):
    """A write-back of 20 of 32 computed channels and 3 of 4 computed rows, in 16-lane vectors."""
    for row, column in T.grid(4, 2):
        for lane in T.vectorized(16):
            with T.sblock("store"):
                v_row = T.axis.spatial(4, row)
                v_channel = T.axis.spatial(32, column * 16 + lane)
                T.where(row < 3 and column * 16 + lane < 20)
                out[v_row, v_channel] = acc[v_row, v_channel]


@T.prim_func(private=True, s_tir=True)
def _stored_in_whole_vectors(acc: T.Buffer((4, 32), "float32"), out: T.Buffer((3, 20), "float32")):
    for row, column in T.grid(4, 2):
        if column * 16 - 20 + 15 < 0:
            for lane in T.vectorized(16):
                with T.sblock("store"):
                    v_row = T.axis.spatial(4, row)
                    v_channel = T.axis.spatial(32, column * 16 + lane)
                    T.where(row < 3)
                    out[v_row, v_channel] = acc[v_row, v_channel]
        else:
            for lane in range(16):
                with T.sblock("store"):
                    v_row = T.axis.spatial(4, row)
                    v_channel = T.axis.spatial(32, column * 16 + lane)
                    T.where(row < 3 and column * 16 + lane < 20)
                    out[v_row, v_channel] = acc[v_row, v_channel]


def test_a_cut_write_back_runs_in_whole_vectors_and_lane_by_lane_where_cut():
    """The rows' bound, the same for every lane, stays on the vectors; the channels' bound becomes the test of the
    vector's last lane."""
    after = assert_transforms(lane_predicates.WholeVectorWriteBacks, tvm.IRModule({"main": _stored_channels}),
                              tvm.IRModule({"main": _stored_in_whole_vectors}))
    assert tirx.analysis.verify_ssa(after["main"])  # the lane-by-lane copy defines variables of its own


@T.prim_func(private=True, s_tir=True)
def _cut_from_below(acc: T.Buffer((32,), "float32"), out: T.Buffer((32,), "float32")):
    for column in range(2):
        for lane in T.vectorized(16):
            with T.sblock("store"):
                v = T.axis.spatial(32, column * 16 + lane)
                T.where(12 - column * 16 - lane < 0)
                out[v] = acc[v]


@T.prim_func(private=True, s_tir=True)
def _cut_by_parity(acc: T.Buffer((32,), "float32"), out: T.Buffer((32,), "float32")):
    for column in range(2):
        for lane in T.vectorized(16):
            with T.sblock("store"):
                v = T.axis.spatial(32, column * 16 + lane)
                T.where(lane % 2 < 1)
                out[v] = acc[v]


@T.prim_func(private=True, s_tir=True)
def _serial(acc: T.Buffer((32,), "float32"), out: T.Buffer((20,), "float32")):
    for channel in range(32):
        with T.sblock("store"):
            v = T.axis.spatial(32, channel)
            T.where(channel < 20)
            out[v] = acc[v]


@pytest.mark.parametrize("func", [_cut_from_below, _cut_by_parity, _serial, _stored_in_whole_vectors],
                         ids=["bound-below", "parity", "serial", "already-split"])
def test_loops_whose_lanes_are_not_bounded_from_above_in_a_vector_are_left(func):
    module = tvm.IRModule({"main": func})
    assert lane_predicates.WholeVectorWriteBacks(module)["main"].same_as(module["main"])


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_attention_scores_over_197_tokens_store_whole_vectors_and_match_numpy(dtype, tolerance):
    """Q.K^T of 12 heads over 197 tokens, the model's output: the kernel computes 208 or 224 channels and stores
    197. Its write-back is split, and the build matches numpy within fp32's or bf16's rounding (of the largest
    score)."""
    mod = models.attention_scores(tokens=197)
    if dtype != "float32":
        mod = relay_amp.to_mixed_precision(mod, dtype)
    target = relay_amp.targets.get_target("cpu-avx512-bf16")
    with target:
        prepared = prepare(mod, target)
    kernels = [func for gv, func in prepared.functions.items() if "dot_kernel" in gv.name_hint]
    split = lane_predicates.WholeVectorWriteBacks(untuned_schedule(kernels[0], target).mod)
    assert "T.vectorized" in split.script() and "else:" in split.script()
    if not relay_amp.targets.host_supports("avx512_bf16"):
        pytest.skip("the host cannot run the cpu-avx512-bf16 build")
    query, key = models.example_inputs(mod)
    got = run_executable(relay_amp.build(mod, target), [query, key])[0]
    expected = np.matmul(query.astype("float64"), key.astype("float64"))
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def test_torchvisions_resnet18_stores_its_1000_logits_in_whole_vectors_and_matches_pytorch():
    """A model the change was not made on (random weights, 64x64): its classifier's kernel computes 1008 or 1024
    channels and stores the 1000 logits, the model's output; the write-back is split, and the build matches
    PyTorch within 1e-5 of the largest logit (fp32)."""
    mod, x, expected = seeded_torchvision_through_onnx("resnet18", 64)
    target = relay_amp.targets.get_target(relay_amp.targets.host_preset())
    with target:
        prepared = prepare(mod, target)
    kernels = [func for gv, func in prepared.functions.items() if "dot_kernel" in gv.name_hint]
    split = [func for func in kernels
             if "else:" in lane_predicates.WholeVectorWriteBacks(untuned_schedule(func, target).mod).script()]
    assert len(split) == 1  # the classifier's
    got = run_executable(relay_amp.build(mod, target), [x])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
