"""schedules: rule-based CPU schedules give correct results and cover every operator of the built-in models."""

import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, te, topi
from tvm.script import tirx as T

import relay_amp
from relay_amp import models, targets
from relay_amp.backend.cpu import schedules
from relay_amp.backend.cpu.pipeline import candidate_passes
from relay_amp.compile import tuning
from relay_amp.compile.build import build
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor

TOLERANCE = 1e-4  # relative to the output's largest magnitude: fp32 sums in another order


@pytest.fixture(autouse=True)
def parallel_at_any_size(monkeypatch):
    """The structural cases here are far smaller than the blocks the rules exist for: each block gets the loops a
    large one would, pool launch included (`test_a_block_writing_few_values_runs_serially` checks the bound)."""
    monkeypatch.setattr(schedules, "MIN_PARALLEL_VALUES", 1)


def _module(build_body, *params):
    return single_output_module(build_body, *(tensor(name, shape) for name, shape in params))


CASES = {
    "matmul_even": (lambda x, w: relax.op.matmul(x, w), ("x", (64, 96)), ("w", (96, 128))),
    "matmul_odd": (lambda x, w: relax.op.matmul(x, w), ("x", (7, 30)), ("w", (30, 13))),
    "dense_bias_gelu": (lambda x, w, b: relax.op.nn.gelu(relax.op.add(relax.op.matmul(x, w), b)),
                        ("x", (2, 8, 40)), ("w", (40, 48)), ("b", (48,))),
    "batch_matmul": (lambda a, b: relax.op.matmul(a, b), ("a", (2, 4, 16, 8)), ("b", (2, 4, 8, 24))),
    # 17 (ViT-tiny's tokens) has no divisor up to 16: a 1x1 register tile, whose write-back has no loop of its own
    "matmul_prime": (lambda x, w: relax.op.matmul(x, w), ("x", (17, 32)), ("w", (32, 17))),
    "attention_scores_prime": (lambda q, k: relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2])),
                               ("q", (1, 2, 17, 32)), ("k", (1, 2, 17, 32))),
    "conv_nchw_stride2": (lambda x, w: relax.op.nn.conv2d(x, w, strides=2, padding=1),
                          ("x", (1, 8, 15, 15)), ("w", (16, 8, 3, 3))),
    "conv_nhwc": (lambda x, w: relax.op.nn.relu(relax.op.nn.conv2d(x, w, padding=1, data_layout="NHWC",
                                                                    kernel_layout="HWIO")),
                  ("x", (1, 14, 14, 16)), ("w", (3, 3, 16, 32))),
    "depthwise_conv_nhwc": (lambda x, w: relax.op.nn.conv2d(x, w, padding=2, groups=32, data_layout="NHWC",
                                                             kernel_layout="HWOI"),
                            ("x", (1, 14, 14, 32)), ("w", (5, 5, 32, 1))),
    # GhostNetV2's attention map: a depthwise conv over channels padded to 32, a sigmoid, the 24 channels sliced back
    "depthwise_conv_sliced": (lambda x, w: relax.op.strided_slice(relax.op.sigmoid(relax.op.nn.conv2d(
        x, w, padding=[2, 0, 2, 0], groups=32, data_layout="NHWC", kernel_layout="HWOI")), axes=[3], begin=[0],
        end=[24]), ("x", (1, 6, 14, 32)), ("w", (5, 1, 32, 1))),
    # MixNet's 9x9 depthwise conv: 81 taps, a window read in place and unrolled by rows of 9
    "depthwise_conv_9x9": (lambda x, w: relax.op.nn.conv2d(x, w, padding=4, groups=16, data_layout="NHWC",
                                                            kernel_layout="HWOI"),
                           ("x", (1, 7, 7, 16)), ("w", (9, 9, 16, 1))),
    # a dilated 1-D depthwise conv as a conv2d of one row (ConvTasNet's): its parallel tiles come from the row alone
    "depthwise_conv_one_row": (lambda x, w: relax.op.nn.conv2d(x, w, padding=[0, 4, 0, 4], dilation=[1, 4], groups=32,
                                                                data_layout="NHWC", kernel_layout="HWOI"),
                               ("x", (1, 1, 480, 32)), ("w", (1, 3, 32, 1))),
    # a residual add of a kernel result's first channels (StarNet's 24 of a padded 32): the slice is inlined into
    # the add, which then joins the conv's write-back
    "depthwise_conv_sliced_residual": (lambda x, w, r: relax.op.add(relax.op.nn.conv2d(
        x, w, padding=1, groups=24, data_layout="NHWC", kernel_layout="HWOI"), relax.op.strided_slice(
        r, axes=[3], begin=[0], end=[24])), ("x", (1, 9, 9, 24)), ("w", (3, 3, 24, 1)), ("r", (1, 9, 9, 32))),
    "max_pool": (lambda x: relax.op.nn.max_pool2d(x, pool_size=3, strides=2, padding=1), ("x", (1, 4, 15, 15))),
    # dispatch pads a depthwise conv's output rows for an AMX matmul: a pad that cannot inline into the write-back
    "depthwise_conv_padded_rows": (lambda x, w: relax.op.nn.pad(
        relax.op.nn.conv2d(x, w, padding=1, groups=32, data_layout="NHWC", kernel_layout="HWOI"),
        [0, 0, 0, 3, 0, 0, 0, 0]), ("x", (1, 7, 7, 32)), ("w", (3, 3, 32, 1))),
    "softmax_layer_norm": (lambda x, g, b: relax.op.nn.layer_norm(relax.op.nn.softmax(x), g, b, axes=[-1]),
                           ("x", (4, 33)), ("g", (33,)), ("b", (33,))),
    # rows of whole vectors: RowReductionRule's vector partial sums (the layer norm over 33 above stays with TVM's)
    "softmax_layer_norm_rows": (lambda x, g, b: relax.op.nn.layer_norm(relax.op.nn.softmax(x), g, b, axes=[-1]),
                                ("x", (3, 5, 64)), ("g", (64,)), ("b", (64,))),
    # rows of whole 8-lane vectors (ConvNeXt-atto's 40 channels): partial sums in 8 lanes
    "layer_norm_rows_by_8": (lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1]),
                             ("x", (1, 3, 5, 40)), ("g", (40,)), ("b", (40,))),
    # a layer norm of half a tensor's channels (gMLP's gate), which reads the window of the whole tensor
    "layer_norm_of_a_slice": (lambda x, g, b: relax.op.nn.layer_norm(relax.op.strided_slice(
        x, axes=[2], begin=[32], end=[64]), g, b, axes=[-1]), ("x", (1, 5, 64)), ("g", (32,)), ("b", (32,))),
    # the layer norm's result read by one elementwise block, the output: stored by the layer norm's block
    "layer_norm_scaled_rows": (lambda x, g, b: relax.op.multiply(relax.op.nn.layer_norm(x, g, b, axes=[-1]),
                                                                 relax.const(2.0, "float32")),
                               ("x", (3, 64)), ("g", (64,)), ("b", (64,))),
    # a global average pool over NHWC's H and W: ColumnReductionRule's vectors of channels
    "channels_last_mean": (lambda x: relax.op.mean(x, axis=[1, 2], keepdims=True), ("x", (1, 7, 5, 48))),
    # a narrow innermost axis whose rows (40 values) are off 16 lanes: vectors of 8 inside the rows
    "narrow_axis_rows_off_vectors": (lambda x: relax.op.multiply(x, relax.const(2.0, "float32")),
                                     ("x", (1, 10, 10, 4))),
    # pixels that split evenly between the cores: partial sums a core in chains, summed after (a max: TVM's rfactor
    # of another reducer; a batch of two: a spatial loop beside the vectors); 7 x 7 does not split: a vector an item
    "channels_last_mean_split_by_pixels": (lambda x: relax.op.mean(x, axis=[1, 2], keepdims=True),
                                           ("x", (1, 16, 16, 48))),
    "channels_last_max_split_by_pixels": (lambda x: relax.op.max(x, axis=[1, 2]), ("x", (2, 16, 8, 32))),
    # channels off 16 lanes (RegNetY's 104): vectors of 8
    "channels_last_mean_by_8": (lambda x: relax.op.mean(x, axis=[1, 2], keepdims=True), ("x", (1, 7, 5, 104))),
    # a function ending in its reduction (a dynamic int8 matmul's row scales): no elementwise block after it
    "row_abs_max": (lambda x: relax.op.max(relax.op.abs(x), axis=[-1], keepdims=True), ("x", (2, 5, 64))),
    # concatenations along the channels with a batch norm's scale and a ReLU: runs of 32 and 16 channels (vector
    # loops of their own), and runs of 12 and 10 (off 8 lanes: the vectors that cross runs are serial loops)
    "concat_scale_relu": (lambda a, b, c: relax.op.nn.relu(relax.op.multiply(
        relax.op.concat([a, b, c], axis=3), relax.const(np.linspace(-1, 1, 80).astype("float32")))),
        ("a", (1, 3, 5, 32)), ("b", (1, 3, 5, 16)), ("c", (1, 3, 5, 32))),
    "concat_off_lanes_relu": (lambda a, b: relax.op.nn.relu(relax.op.concat([a, b], axis=3)),
                              ("a", (1, 3, 5, 12)), ("b", (1, 3, 5, 12))),
    "concat_off_lanes_scale_silu": (lambda a, b, c, d: relax.op.nn.silu(relax.op.multiply(
        relax.op.concat([a, b, c, d], axis=3), relax.const(np.linspace(-1, 1, 40).astype("float32")))),
        ("a", (1, 3, 5, 10)), ("b", (1, 3, 5, 10)), ("c", (1, 3, 5, 10)), ("d", (1, 3, 5, 10))),
    "concat_off_lanes": (lambda a, b, c: relax.op.concat([a, b, c], axis=3),
                         ("a", (1, 3, 5, 2)), ("b", (1, 3, 5, 18)), ("c", (1, 3, 5, 12))),
    # transposing blocks with a narrow innermost axis, vectorized across the axis before it: two 8-channel parts of
    # a split (MixNet's), loaded 24 channels apart; 13 tokens padded to 16 and packed in pairs of channels (a
    # run-time K packing), whose padded column block runs apart
    "split_parts_added": (lambda x: relax.op.add(relax.op.split(x, 3, axis=3)[0], relax.op.split(x, 3, axis=3)[2]),
                          ("x", (1, 6, 16, 24))),
    "token_pairs_packed": (lambda x: relax.op.permute_dims(relax.op.reshape(
        relax.op.nn.pad(relax.op.multiply(x, relax.const(0.5, "float32")), [0, 3, 0, 0]), (2, 8, 4, 2)),
        [0, 2, 1, 3]), ("x", (13, 8))),
    # a softmax over NHWC's W (attention's keys where the heads are channels: EfficientFormerV2's talking heads)
    "softmax_middle_axis": (lambda x: relax.op.nn.softmax(x, axis=2), ("x", (1, 5, 7, 16))),
    # ... with 4 or 3 heads kept (ONNX Runtime's transpose optimizer leaves CaiT's so): a row at a time all the same
    "softmax_middle_axis_of_4": (lambda x: relax.op.nn.softmax(x, axis=2), ("x", (1, 9, 7, 4))),
    "softmax_middle_axis_of_3": (lambda x: relax.op.nn.softmax(x, axis=2), ("x", (2, 9, 7, 3))),
    # a pool over the pixels of 12 channels: vectors of 4
    "column_mean_of_12": (lambda x: relax.op.mean(x, axis=[1, 2]), ("x", (1, 5, 6, 12))),
    # one reduction over rows off whole vectors (longer than the windows ContractionRule takes), alone and with an
    # elementwise block after it: vector partial sums and a serial tail (RowReductionRule's _reduction_with_tail)
    "row_sum_off_vectors": (lambda x: relax.op.sum(x, axis=[-1]), ("x", (3, 5, 100))),
    "row_mean_of_squares_off_vectors": (lambda x: relax.op.sqrt(relax.op.mean(relax.op.multiply(x, x), axis=[-1])),
                                        ("x", (6, 70))),
    # an argmax over such rows (a value and its index): left to TVM's rule
    "row_argmax_off_vectors": (lambda x: relax.op.argmax(x, axis=-1), ("x", (3, 100))),
    "rms_norm_rows": (lambda x: relax.op.divide(x, relax.op.sqrt(relax.op.mean(relax.op.multiply(x, x), axis=[-1],
                                                                                keepdims=True))),
                      ("x", (6, 48))),
    # rows of 6 and 24 vectors: partial sums in two and four vectors (independent chains of adds), halved after
    "layer_norm_rows_of_96": (lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1]),
                              ("x", (1, 3, 5, 96)), ("g", (96,)), ("b", (96,))),
    "softmax_rows_of_384": (lambda x: relax.op.nn.softmax(x), ("x", (2, 3, 384))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_scheduled_build_matches_tvm_default(case):
    body, *params = CASES[case]
    mod = _module(body, *params)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(shape).astype("float32") for _, shape in params]
    got = run_executable(build(mod, "cpu"), inputs)[0]
    expected = relay_amp.run(mod, inputs)[0]
    assert np.abs(got - expected).max() <= TOLERANCE * np.abs(expected).max()


@pytest.mark.parametrize("rows,cols", [("n", 32), (4, "m")])
def test_symbolic_shapes_build_and_match(rows, cols):
    dims = {"n": tvm.tirx.Var("n", "int64"), "m": tvm.tirx.Var("m", "int64")}
    mod = single_output_module(relax.op.matmul, tensor("x", (dims.get(rows, rows), 16)),
                               tensor("w", (16, dims.get(cols, cols))))
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((5 if rows == "n" else rows, 16)).astype("float32"),
              rng.standard_normal((16, 7 if cols == "m" else cols)).astype("float32")]
    got = run_executable(build(mod, "cpu"), inputs)[0]
    np.testing.assert_allclose(got, inputs[0] @ inputs[1], rtol=1e-4, atol=1e-4)


def _dynamic_int8(mod: tvm.IRModule) -> tvm.IRModule:
    return relay_amp.quantize(mod, [models.example_inputs(mod)], dynamic_matmuls=True)


@pytest.mark.parametrize("name, convert", [("resnet18", None), ("bert", None), ("bert", _dynamic_int8)])
def test_every_operator_of_the_built_in_models_gets_a_schedule(name, convert):
    target = targets.get_target("cpu")
    mod = models.get_model(name)
    with target:
        scheduled = schedules.default_schedules()(tuning.prepare(convert(mod) if convert else mod, target))
    unscheduled = [gv.name_hint for gv, func in scheduled.functions_items()
                   if isinstance(func, tvm.tirx.PrimFunc) and "tirx.is_scheduled" not in func.attrs]
    assert unscheduled == [], unscheduled


def test_contraction_rule_declines_other_functions_and_targets():
    mod = tuning.prepare(_module(*CASES["softmax_layer_norm"]), targets.get_target("cpu"))
    softmax = next(f for gv, f in mod.functions_items() if "softmax" in gv.name_hint)
    assert schedules.ContractionRule().apply(softmax, targets.get_target("cpu"), False) is None
    matmul = tuning.prepare(_module(*CASES["matmul_even"]), targets.get_target("cpu"))
    func = next(f for _, f in matmul.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    assert schedules.ContractionRule().apply(func, targets.get_target("cuda-tensorcore"), False) is None


@T.prim_func(private=True, s_tir=True)
def _matmul_bias(x: T.Buffer((T.int64(8), T.int64(16)), "float32"), w: T.Buffer((T.int64(16), T.int64(32)), "float32"),
                 b: T.Buffer((T.int64(32),), "float32"), out: T.Buffer((T.int64(8), T.int64(32)), "float32")):
    T.func_attr({"tirx.noalias": True})
    mm = T.sblock_alloc_buffer((T.int64(8), T.int64(32)))
    for i, j, k in T.grid(T.int64(8), T.int64(32), T.int64(16)):
        with T.sblock("matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                mm[vi, vj] = T.float32(0)
            mm[vi, vj] = mm[vi, vj] + x[vi, vk] * w[vk, vj]
    for i, j in T.grid(T.int64(8), T.int64(32)):
        with T.sblock("add"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = mm[vi, vj] + b[vj]


@T.prim_func(private=True, s_tir=True)
def _matmul_bias_scheduled(x: T.Buffer((T.int64(8), T.int64(16)), "float32"),
                           w: T.Buffer((T.int64(16), T.int64(32)), "float32"), b: T.Buffer((T.int64(32),), "float32"),
                           out: T.Buffer((T.int64(8), T.int64(32)), "float32")):
    T.func_attr({"tirx.noalias": True})
    mm_global = T.sblock_alloc_buffer((T.int64(8), T.int64(32)))
    for tile in T.parallel(T.int64(2)):
        for column, row_block in T.grid(T.int64(1), T.int64(1)):
            for row_init in T.unroll(T.int64(4)):
                for lane_init in T.vectorized(T.int64(32)):
                    with T.sblock("matmul_init"):
                        v0 = T.axis.spatial(T.int64(8), tile * T.int64(4) + row_block * T.int64(4) + row_init)
                        v1 = T.axis.spatial(T.int64(32), column * T.int64(32) + lane_init)
                        T.reads()
                        T.writes(mm_global[v0, v1])
                        mm_global[v0, v1] = T.float32(0.0)
            for k in range(T.int64(16)):
                for row in T.unroll(T.int64(4)):
                    for lane in T.vectorized(T.int64(32)):
                        with T.sblock("matmul_update"):
                            v0 = T.axis.spatial(T.int64(8), tile * T.int64(4) + row_block * T.int64(4) + row)
                            v1 = T.axis.spatial(T.int64(32), column * T.int64(32) + lane)
                            v2 = T.axis.reduce(T.int64(16), k)
                            T.reads(mm_global[v0, v1], x[v0, v2], w[v2, v1])
                            T.writes(mm_global[v0, v1])
                            mm_global[v0, v1] = mm_global[v0, v1] + x[v0, v2] * w[v2, v1]
            for row in T.unroll(T.int64(4)):
                for lane in T.vectorized(T.int64(32)):
                    with T.sblock("mm_global"):
                        v0 = T.axis.spatial(T.int64(8), tile * T.int64(4) + row)
                        v1 = T.axis.spatial(T.int64(32), lane)
                        T.reads(mm_global[v0, v1], b[v1])
                        T.writes(out[v0, v1])
                        out[v0, v1] = mm_global[v0, v1] + b[v1]


def test_contraction_rule_blocks_vectorizes_and_fuses_the_epilogue():
    """4 rows x 32 lanes (two zmm) of accumulators: under 1 KiB, so on the stack and in registers; a cache tile
    of row blocks over the whole (L2-sized) reduction, as few rows as leave PARALLEL_TILES parallel tiles where
    there are rows for them (here two); the bias add fused into the write-back, which is unrolled over the rows
    (rolled, it read the accumulators back from a stack buffer)."""
    scheduled = schedules.ContractionRule().apply(_matmul_bias, targets.get_target("cpu"), False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _matmul_bias_scheduled)


def test_a_depthwise_conv_keeps_rows_of_pixels_in_registers_sharing_each_weight_vector():
    """Both operands are read along the channels (the vector axis): the weight vector, which does not move with
    the output's x, is shared by 7 pixels' accumulators (before: one pixel, a chain of dependent FMAs)."""
    mod = relax.transform.LegalizeOps()(_module(*CASES["depthwise_conv_nhwc"]))
    sch = schedules.ContractionRule().apply(mod["conv2d"], targets.get_target("cpu"), False)
    *_, rows, lanes = (sch.get(loop) for loop in sch.get_loops(sch.get_sblock("group_conv2d_nhwc_update")))
    assert (int(rows.extent), rows.kind) == (7, tvm.tirx.ForKind.UNROLLED)
    assert (int(lanes.extent), lanes.kind) == (32, tvm.tirx.ForKind.VECTORIZED)


def test_a_conv_over_one_row_splits_the_row_into_parallel_tiles():
    """A cache tile over the whole row (480 outputs, 6 a register tile) left one parallel tile, so one core ran
    ConvTasNet's 1-D depthwise convs; the row now gives PARALLEL_TILES of them."""
    mod = relax.transform.LegalizeOps()(_module(*CASES["depthwise_conv_one_row"]))
    sch = schedules.ContractionRule().apply(mod["conv2d"], targets.get_target("cpu"), False)
    parallel = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("group_conv2d_nhwc_update"))
                if sch.get(loop).kind == tvm.tirx.ForKind.PARALLEL]
    assert [int(loop.extent) for loop in parallel] == [schedules.PARALLEL_TILES]


def test_an_epilogue_that_does_not_inline_is_scheduled_too():
    """The pad after a depthwise conv (case built and checked against the reference above) runs in parallel, by
    vectors of channels (before: a serial scalar loop nest, 2x the conv's own time on MobileNetV2's 7x7x960)."""
    prepared = tuning.prepare(_module(*CASES["depthwise_conv_padded_rows"]), targets.get_target("cpu"))
    func = next(f for _, f in prepared.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and "pad" in str(f))
    sch = schedules.ContractionRule().apply(func, targets.get_target("cpu"), False)
    pad = next(block for block in sch.get_child_blocks(sch.get_sblock("root")) if "Pad" in sch.get(block).name_hint)
    kinds = [sch.get(loop).kind for loop in sch.get_loops(pad)]
    assert kinds[0] == tvm.tirx.ForKind.PARALLEL and kinds[-1] == tvm.tirx.ForKind.VECTORIZED


def test_a_depthwise_conv_unrolls_its_window_rows_so_neighbouring_pixels_share_their_loads():
    """The 5 taps of a window row are unrolled with the 7 pixels: the 11 inputs they read are loaded (and, for
    bf16, widened) once each rather than 35 times. A matmul's reduction stays a loop."""
    mod = relax.transform.LegalizeOps()(_module(*CASES["depthwise_conv_nhwc"]))
    sch = schedules.ContractionRule().apply(mod["conv2d"], targets.get_target("cpu"), False)
    *_, window_row, _, _ = (sch.get(loop) for loop in sch.get_loops(sch.get_sblock("group_conv2d_nhwc_update")))
    assert (int(window_row.extent), window_row.kind) == (5, tvm.tirx.ForKind.UNROLLED)
    matmul = relax.transform.LegalizeOps()(_module(*CASES["batch_matmul"]))
    sch = schedules.ContractionRule().apply(matmul["matmul"], targets.get_target("cpu"), False)
    assert all(sch.get(loop).kind != tvm.tirx.ForKind.UNROLLED or int(sch.get(loop).extent) != 8
               for loop in sch.get_loops(sch.get_sblock("matmul_update")))


def test_a_write_back_of_a_channel_slice_runs_in_vectors_of_8_that_the_slice_keeps_whole():
    """A depthwise conv over 32 channels written back sliced to 24 (case built and checked against the reference
    above): the write-back's predicate (channel < 24) tells the lanes of a 16-lane vector apart, and TVM's vectorizer
    ran such a loop lane by lane (GhostNetV2's sliced sigmoid maps: 0.116 ms in bf16, 0.019 in fp32). It now runs in
    8-lane vectors, each wholly inside or outside the slice, unrolled (4 of them over the tile's 32 channels)."""
    prepared = tuning.prepare(_module(*CASES["depthwise_conv_sliced"]), targets.get_target("cpu"))
    func = next(f for gv, f in prepared.functions_items() if "strided_slice" in gv.name_hint)
    sch = schedules.ContractionRule().apply(func, targets.get_target("cpu"), False)
    write_back = next(block for block in sch.get_child_blocks(sch.get_sblock("root"))
                      if "T.where" in sch.get(sch.get_loops(block)[-1]).body.script())
    *_, vectors, lanes = (sch.get(loop) for loop in sch.get_loops(write_back))
    assert (int(vectors.extent), vectors.kind) == (4, tvm.tirx.ForKind.UNROLLED)
    assert (int(lanes.extent), lanes.kind) == (8, tvm.tirx.ForKind.VECTORIZED)


def test_a_large_depthwise_window_reads_its_input_in_place_with_its_rows_unrolled():
    """MixNet's 9x9 depthwise convs (81 taps, over MAX_WINDOW) stored a padded copy of their input and looped over
    each tap: 65 us for a 14x14x90 conv whose 7x7 neighbour took 8. A window that is all a block reduces now reads
    its input in place up to MAX_WINDOW_TAPS, its 9-tap rows unrolled (8 us). A conv over channels keeps its copy."""
    mod = relax.transform.LegalizeOps()(_module(*CASES["depthwise_conv_9x9"]))
    sch = schedules.ContractionRule().apply(mod["conv2d"], targets.get_target("cpu"), False)
    assert [sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))][0] != "pad_temp"
    *_, window_row, _, _ = (sch.get(loop) for loop in sch.get_loops(sch.get_sblock("group_conv2d_nhwc_update")))
    assert (int(window_row.extent), window_row.kind) == (9, tvm.tirx.ForKind.UNROLLED)
    conv = relax.transform.LegalizeOps()(_module(*CASES["conv_nhwc"]))  # 3x3 taps of 16 channels each
    sch = schedules.ContractionRule().apply(conv["conv2d"], targets.get_target("cpu"), False)
    sch.get_sblock("pad_temp")  # the padded copy (raises when it is missing)


@pytest.mark.parametrize("stride, step, taps, slides", [
    (1, 1, 3, True),  # a 3x3 conv's rows
    (2, 1, 3, True),  # strided by 2: neighbouring windows still share a row
    (1, 4, 3, True),  # dilated by 4
    (2, 1, 2, False),  # a patch embedding's (stride = kernel): no input read twice
    (16, 1, 16, False),  # a flattened index (i * 16 + k), a matmul operand reshaped in its function
])
def test_a_window_slides_only_where_neighbouring_outputs_overlap(stride, step, taps, slides):
    """Only an overlapping window takes the depthwise path (its input read in place, up to MAX_WINDOW_TAPS): taken
    for any index adding a reduction var to an output var, some function of MobileViT-XXS's fp32 build ran 1.5%
    slower; with the overlap required its schedules are those of the session before."""
    out, tap = tvm.tirx.Var("out", "int64"), tvm.tirx.Var("tap", "int64")
    index = out * stride + tap * step
    assert bool(schedules._overlapping(index, {out}, {tap: taps})) == slides


def test_an_output_width_without_a_vector_divisor_is_padded_to_whole_vectors():
    """17 columns (prime, like ViT's 197 tokens): the second operand is copied into a zero-padded buffer, the
    contraction runs on two whole 16-lane vectors, the write-back trims the padding (before: scalar tiles)."""
    mod = relax.transform.LegalizeOps()(_module(relax.op.matmul, ("q", (1, 2, 17, 32)), ("k", (1, 2, 32, 17))))
    sch = schedules.ContractionRule().apply(mod["matmul"], targets.get_target("cpu"), False)
    sch.get_sblock("k_pad")  # the zero-padded copy of the second operand (raises when it is missing)
    loops = sch.get_loops(sch.get_sblock("matmul_update"))  # 17 columns of accumulators as 2 x 16 lanes
    assert int(sch.get(loops[-1]).extent) == 32 and sch.get(loops[-1]).kind == tvm.tirx.ForKind.VECTORIZED
    q, k = (np.random.default_rng(seed).standard_normal(shape).astype("float32")
            for seed, shape in ((0, (1, 2, 17, 32)), (1, (1, 2, 32, 17))))
    out = tvm.runtime.empty((1, 2, 17, 17), "float32")
    func = sch.mod["main"].with_attr("global_symbol", "main")
    tvm.compile(tvm.IRModule({"main": func}), target=targets.get_target("cpu"))["main"](
        *map(tvm.runtime.tensor, (q, k)), out)
    np.testing.assert_allclose(out.numpy(), q @ k, rtol=1e-5, atol=1e-5)  # fp32 sums of 32 products


@T.prim_func(private=True, s_tir=True)
def _pad_rows(x: T.Buffer((T.int64(3), T.int64(4), T.int64(19)), "float32"),
              out: T.Buffer((T.int64(3), T.int64(4), T.int64(20)), "float32")):
    T.func_attr({"tirx.noalias": True})
    for i, j, k in T.grid(T.int64(3), T.int64(4), T.int64(20)):
        with T.sblock("pad"):
            vi, vj, vk = T.axis.remap("SSS", [i, j, k])
            out[vi, vj, vk] = T.if_then_else(vk < T.int64(19), x[vi, vj, vk], T.float32(0))


@T.prim_func(private=True, s_tir=True)
def _pad_rows_scheduled(x: T.Buffer((T.int64(3), T.int64(4), T.int64(19)), "float32"),
                        out: T.Buffer((T.int64(3), T.int64(4), T.int64(20)), "float32")):
    T.func_attr({"tirx.noalias": True})
    for row in T.parallel(T.int64(12)):
        with T.sblock("pad_ax2_common"):
            T.reads()
            T.writes()
            with T.sblock("pad_ax20_partition"):
                T.reads()
                T.writes()
                for column_block in range(T.int64(1)):
                    for column in T.vectorized(T.int64(16)):
                        with T.sblock("pad_ax20"):
                            v0 = T.axis.spatial(T.int64(3), row // T.int64(4))
                            v1 = T.axis.spatial(T.int64(4), row % T.int64(4))
                            v2 = T.axis.spatial(T.int64(16), column_block * T.int64(16) + column)
                            T.reads(x[T.int64(0):T.int64(3), T.int64(0):T.int64(4), T.int64(0):T.int64(16)])
                            T.writes(out[T.int64(0):T.int64(3), T.int64(0):T.int64(4), T.int64(0):T.int64(16)])
                            out[v0, v1, v2] = T.if_then_else(v2 < T.int64(19), x[v0, v1, v2], T.float32(0.0))
            with T.sblock("pad_ax21_partition"):
                T.reads()
                T.writes()
                for tail in range(T.int64(16), T.int64(20)):
                    with T.sblock("pad_ax21"):
                        v0 = T.axis.spatial(T.int64(3), row // T.int64(4))
                        v1 = T.axis.spatial(T.int64(4), row % T.int64(4))
                        v2 = T.axis.spatial((T.int64(16), T.int64(20)), tail)
                        T.reads(x[T.int64(0):T.int64(3), T.int64(0):T.int64(4), T.int64(16):T.int64(20)])
                        T.writes(out[T.int64(0):T.int64(3), T.int64(0):T.int64(4), T.int64(16):T.int64(20)])
                        out[v0, v1, v2] = T.if_then_else(v2 < T.int64(19), x[v0, v1, v2], T.float32(0.0))


def test_elementwise_rule_vectorizes_rows_off_whole_vectors_within_each_row():
    """20 columns (like ViT's 197 tokens): vectors of the flat index would straddle rows and gather lane by lane;
    the rows run in parallel, each row's whole vectors vectorized and the rest in a serial loop (a partial last
    vector's predicate made TVM scalarize every lane)."""
    scheduled = schedules.ElementwiseRule().apply(_pad_rows, targets.get_target("cpu"), False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _pad_rows_scheduled)
    lib = tvm.compile(tvm.IRModule({"main": scheduled.mod["main"].with_attr("global_symbol", "main")}),
                      target=targets.get_target("cpu"))
    x = np.arange(3 * 4 * 19, dtype="float32").reshape(3, 4, 19)
    out = tvm.runtime.tensor(np.full((3, 4, 20), -1.0, "float32"))
    lib["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_array_equal(out.numpy(), np.pad(x, ((0, 0), (0, 0), (0, 1))))


@T.prim_func(private=True, s_tir=True)
def _slice_add(x: T.Buffer((4, 32), "float32"), bias: T.Buffer((24,), "float32"), out: T.Buffer((4, 24), "bfloat16")):
    for i, j in T.grid(4, 24):
        with T.sblock("add"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = T.Cast("bfloat16", x[vi, vj] + bias[vj])


@T.prim_func(private=True, s_tir=True)
def _slice_add_scheduled(x: T.Buffer((4, 32), "float32"), bias: T.Buffer((24,), "float32"),
                         out: T.Buffer((4, 24), "bfloat16")):
    for ax0_fused in T.parallel(4):
        for ax1_0 in range(3):
            for ax1_1 in T.vectorized(8):
                with T.sblock("add"):
                    v0 = T.axis.spatial(4, ax0_fused)
                    v1 = T.axis.spatial(24, ax1_0 * 8 + ax1_1)
                    T.reads(x[v0, v1], bias[v1])
                    T.writes(out[v0, v1])
                    out[v0, v1] = T.Cast("bfloat16", x[v0, v1] + bias[v1])


def test_elementwise_rule_takes_half_registers_where_they_divide_a_row_and_whole_ones_do_not():
    """24 channels (a kernel's 32 sliced to EfficientNet's 24): three 8-lane vectors, not a 16-lane one and a
    partial one, which TVM's vectorizer would run lane by lane."""
    scheduled = schedules.ElementwiseRule().apply(_slice_add, targets.get_target("cpu"), False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _slice_add_scheduled)
    rng = np.random.default_rng(3)
    x, bias = rng.standard_normal((4, 32)).astype("float32"), rng.standard_normal(24).astype("float32")
    out = tvm.runtime.empty((4, 24), "bfloat16", tvm.cpu())
    module = tvm.IRModule({"main": scheduled.mod["main"].with_attr("global_symbol", "main")})
    tvm.compile(module, target="llvm")["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(bias), out)
    expected = (x[:, :24] + bias).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out.numpy().view("uint16"), expected.view("uint16"))


def _run_scheduled(scheduled, inputs: list, out_shape: tuple) -> np.ndarray:
    """The fp32 output of a scheduled single-function module, built for the host, on `inputs`."""
    out = tvm.runtime.empty(out_shape, "float32", tvm.cpu())
    module = tvm.IRModule({"main": scheduled.mod["main"].with_attr("global_symbol", "main")})
    tvm.compile(module, target="llvm")["main"](*(tvm.runtime.tensor(x) for x in inputs), out)
    return out.numpy()


@T.prim_func(private=True, s_tir=True)
def _concat_relu(x0: T.Buffer((4, 32), "float32"), x1: T.Buffer((4, 16), "float32"), out: T.Buffer((4, 48), "float32")):
    for i, j in T.grid(4, 48):
        with T.sblock("relu"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = T.max(T.if_then_else(32 <= vj, x1[vi, vj - 32], x0[vi, vj]), T.float32(0.0))


@T.prim_func(private=True, s_tir=True)
def _concat_relu_scheduled(x0: T.Buffer((4, 32), "float32"), x1: T.Buffer((4, 16), "float32"),
                           out: T.Buffer((4, 48), "float32")):
    for ax0_fused in T.parallel(4):
        with T.sblock("relu_ax1_0_common"):
            T.reads()
            T.writes()
            with T.sblock("relu_ax1_00_partition"):
                T.reads()
                T.writes()
                for ax1_00 in range(2):
                    for ax1_1 in T.vectorized(16):
                        with T.sblock("relu_ax1_00"):
                            v0 = T.axis.spatial(4, ax0_fused)
                            v1 = T.axis.spatial(48, ax1_00 * 16 + ax1_1)
                            T.reads(x1[v0, v1 + -32], x0[v0, v1])
                            T.writes(out[v0, v1])
                            out[v0, v1] = T.max(T.if_then_else(32 <= v1, x1[v0, v1 - 32], x0[v0, v1]), T.float32(0.0))
            with T.sblock("relu_ax1_01_partition"):
                T.reads()
                T.writes()
                for ax1_01 in range(2, 3):
                    for ax1_1 in T.vectorized(16):
                        with T.sblock("relu_ax1_01"):
                            v0 = T.axis.spatial(4, ax0_fused)
                            v1 = T.axis.spatial(48, ax1_01 * 16 + ax1_1)
                            T.reads(x1[v0, v1 + -32], x0[v0, v1])
                            T.writes(out[v0, v1])
                            out[v0, v1] = T.max(T.if_then_else(32 <= v1, x1[v0, v1 - 32], x0[v0, v1]), T.float32(0.0))


def test_a_concatenation_along_the_row_reads_each_input_in_a_vector_loop_of_its_own():
    """A ReLU of two inputs concatenated along the innermost axis (DenseNet's concat, batch norm, ReLU): the row's
    vectors are partitioned where the input changes, so each loop's if_then_else folds away when lowered; over the
    whole row, every lane evaluated the chain of conditions and loaded its input apart."""
    scheduled = schedules.ElementwiseRule().apply(_concat_relu, targets.get_target("cpu"), False)
    # as printed: loop_partition's two blocks share their iter vars, which assert_structural_equal cannot map
    assert scheduled.mod["main"].script() == _concat_relu_scheduled.script()
    rng = np.random.default_rng(5)
    x0, x1 = rng.standard_normal((4, 32)).astype("float32"), rng.standard_normal((4, 16)).astype("float32")
    expected = np.maximum(np.concatenate([x0, x1], axis=1), 0)
    np.testing.assert_array_equal(_run_scheduled(scheduled, [x0, x1], (4, 48)), expected)


@T.prim_func(private=True, s_tir=True)
def _concat_of_heads(x0: T.Buffer((4, 16), "float32"), x1: T.Buffer((4, 32), "float32"),
                     out: T.Buffer((4, 48), "float32")):
    for i, j in T.grid(4, 48):
        with T.sblock("heads"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = T.if_then_else(16 <= vj // 8 * 8 + vj % 8, x1[vi, vj // 8 * 8 + vj % 8 - 16],
                                         x0[vi, vj // 8 * 8 + vj % 8]) * T.float32(2.0)


@T.prim_func(private=True, s_tir=True)
def _directions_flattened(x0: T.Buffer((4, 48), "float32"), x1: T.Buffer((4, 48), "float32"),
                          out: T.Buffer((4, 96), "float32")):
    for i, j in T.grid(4, 96):
        with T.sblock("flattened"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = T.if_then_else(1 <= vj // 48, x1[vi, vj % 48], x0[vi, vj % 48]) * T.float32(2.0)


@pytest.mark.parametrize("func, widths", [(_concat_of_heads, (16, 32)), (_directions_flattened, (48, 48))])
def test_a_concatenation_indexed_through_arithmetic_reads_each_input_in_a_loop_of_its_own(func, widths):
    """The run where each input is read is found through the arithmetic, as for a plain axis: CoaT's concatenated
    channels split into heads of 8 (fused, the concat's axis reads c // 8 * 8 + c % 8), and two tensors joined along
    an axis that a reshape then merges into the row (a bidirectional recurrence's directions, [steps, batch, 2,
    hidden] flattened to [steps, batch, 2 * hidden]: the condition reads c // 48). Vectorized over the whole row,
    every lane loaded its input apart: CoaT-Lite-Tiny's function took 0.225 ms in bf16 against 0.047, a
    bidirectional LSTM's output function over 16 steps 0.397 ms against 0.018."""
    scheduled = schedules.ElementwiseRule().apply(func, targets.get_target("cpu"), False)
    text = scheduled.mod["main"].script()
    assert text.count("_partition") == 2 and text.count("T.vectorized(16)") == 2, text
    rng = np.random.default_rng(7)
    x0, x1 = (rng.standard_normal((4, width)).astype("float32") for width in widths)
    np.testing.assert_array_equal(_run_scheduled(scheduled, [x0, x1], (4, sum(widths))),
                                  np.concatenate([x0, x1], axis=1) * 2)


@T.prim_func(private=True, s_tir=True)
def _concat_scale(x0: T.Buffer((4, 12), "float32"), x1: T.Buffer((4, 12), "float32"),
                  out: T.Buffer((4, 24), "float32")):
    for i, j in T.grid(4, 24):
        with T.sblock("scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = T.if_then_else(12 <= vj, x1[vi, vj - 12], x0[vi, vj]) * T.float32(2.0)


@T.prim_func(private=True, s_tir=True)
def _concat_scale_scheduled(x0: T.Buffer((4, 12), "float32"), x1: T.Buffer((4, 12), "float32"),
                            out: T.Buffer((4, 24), "float32")):
    for ax0_fused in T.parallel(4):
        with T.sblock("scale_ax1_common"):
            T.reads()
            T.writes()
            with T.sblock("scale_ax10_partition"):
                T.reads()
                T.writes()
                for ax10 in T.vectorized(12):
                    with T.sblock("scale_ax10"):
                        v0, v1 = T.axis.remap("SS", [ax0_fused, ax10])
                        T.reads(x1[v0, v1 + -12], x0[0:4, 0:12])
                        T.writes(out[0:4, 0:12])
                        out[v0, v1] = T.if_then_else(12 <= v1, x1[v0, v1 - 12], x0[v0, v1]) * T.float32(2.0)
            with T.sblock("scale_ax11_partition"):
                T.reads()
                T.writes()
                for ax11 in T.vectorized(12, 24):
                    with T.sblock("scale_ax11"):
                        v0, v1 = T.axis.remap("SS", [ax0_fused, ax11])
                        T.reads(x1[v0, v1 + -12], x0[0:4, 12:24])
                        T.writes(out[0:4, 12:24])
                        out[v0, v1] = T.if_then_else(12 <= v1, x1[v0, v1 - 12], x0[v0, v1]) * T.float32(2.0)


@T.prim_func(private=True, s_tir=True)
def _concat_long_runs(x0: T.Buffer((4, 24), "float32"), x1: T.Buffer((4, 300), "float32"),
                      out: T.Buffer((4, 324), "float32")):
    for i, j in T.grid(4, 324):
        with T.sblock("scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = T.if_then_else(24 <= vj, x1[vi, vj - 24], x0[vi, vj]) * T.float32(2.0)


@T.prim_func(private=True, s_tir=True)
def _concat_long_runs_scheduled(x0: T.Buffer((4, 24), "float32"), x1: T.Buffer((4, 300), "float32"),
                                out: T.Buffer((4, 324), "float32")):
    for ax0_fused in T.parallel(4):
        with T.sblock("scale_ax1_common"):
            T.reads()
            T.writes()
            with T.sblock("scale_ax10_partition"):
                T.reads()
                T.writes()
                for ax10 in T.vectorized(24):
                    with T.sblock("scale_ax10"):
                        v0, v1 = T.axis.remap("SS", [ax0_fused, ax10])
                        T.reads(x1[v0, v1 + -24], x0[0:4, 0:24])
                        T.writes(out[0:4, 0:24])
                        out[v0, v1] = T.if_then_else(24 <= v1, x1[v0, v1 - 24], x0[v0, v1]) * T.float32(2.0)
            with T.sblock("scale_ax11_partition"):
                T.reads()
                T.writes()
                for ax11 in T.vectorized(24, 280):
                    with T.sblock("scale_ax11"):
                        v0, v1 = T.axis.remap("SS", [ax0_fused, ax11])
                        T.reads(x1[v0, v1 + -24], x0[0:4, 24:280])
                        T.writes(out[0:4, 24:280])
                        out[v0, v1] = T.if_then_else(24 <= v1, x1[v0, v1 - 24], x0[v0, v1]) * T.float32(2.0)
            with T.sblock("scale_ax12_partition"):
                T.reads()
                T.writes()
                for ax12 in T.vectorized(280, 324):
                    with T.sblock("scale_ax12"):
                        v0, v1 = T.axis.remap("SS", [ax0_fused, ax12])
                        T.reads(x1[v0, v1 + -24], x0[0:4, 280:324])
                        T.writes(out[0:4, 280:324])
                        out[v0, v1] = T.if_then_else(24 <= v1, x1[v0, v1 - 24], x0[v0, v1]) * T.float32(2.0)


@pytest.mark.parametrize("before, expected, runs", [(_concat_scale, _concat_scale_scheduled, (12, 12)),
                                                    (_concat_long_runs, _concat_long_runs_scheduled, (24, 300))])
def test_a_concatenation_of_runs_off_16_lanes_reads_each_run_in_one_vector(before, expected, runs):
    """Runs off 16-lane vectors: each run is a loop of its own vectorized by its whole length, in pieces of at most
    256 (a run of 300: 256 and 44). Two runs of 12 (GhostNet's ghost modules concatenate runs of 12, 20, 36, 60 and
    100): in 8-lane vectors, the one crossing from one input to the next ran lane by lane (GhostNet's concat, cast and
    residual add over 56x56x24 in bf16: 40 us, 16 us a run at a time); over the whole row, TVM computed every lane
    apart (a SiLU of four 90-channel inputs: 37 times slower than of one). Runs of 24 (on 8-lane vectors, off 16)
    and 300: the 24 is one vector (a 16-lane register and an 8-lane one, against three 8-lane vectors). MixNet's SiLU
    of two concatenated runs of 120 over 28x28 ran in 8-lane vectors (0.062 ms in bf16, 0.033 a run at a time), and
    its runs of 300 left the 8-lane vectors crossing runs serial (0.022 ms, 0.018 now)."""
    scheduled = schedules.ElementwiseRule().apply(before, targets.get_target("cpu"), False)
    assert scheduled.mod["main"].script() == expected.script()
    rng = np.random.default_rng(6)
    inputs = [rng.standard_normal((4, run)).astype("float32") for run in runs]
    np.testing.assert_array_equal(_run_scheduled(scheduled, inputs, (4, sum(runs))), np.concatenate(inputs, axis=1) * 2)


@T.prim_func(private=True, s_tir=True)
def _compaction_add(x: T.Buffer((2, 64), "float32"), r: T.Buffer((2, 40), "float32"),
                    out: T.Buffer((2, 40), "float32")):
    for i, j in T.grid(2, 40):
        with T.sblock("add"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = x[vi, vj // 20 * 32 + vj % 20] + r[vi, vj]


@T.prim_func(private=True, s_tir=True)
def _compaction_add_scheduled(x: T.Buffer((2, 64), "float32"), r: T.Buffer((2, 40), "float32"),
                              out: T.Buffer((2, 40), "float32")):
    for ax0_fused in T.parallel(2):
        for ax1_0 in range(2):
            for ax1_1 in T.vectorized(20):
                with T.sblock("add"):
                    v0 = T.axis.spatial(2, ax0_fused)
                    v1 = T.axis.spatial(40, ax1_0 * 20 + ax1_1)
                    T.reads(x[v0, v1 // 20 * 32 + v1 % 20], r[v0, v1])
                    T.writes(out[v0, v1])
                    out[v0, v1] = x[v0, v1 // 20 * 32 + v1 % 20] + r[v0, v1]


def test_a_row_read_in_groups_off_the_vectors_is_vectorized_a_group_at_a_time():
    """A residual add of a compaction of padded groups (MixNet's: two groups of 20 channels, each padded to 32 by
    the grouped kernel): one vector of 20 lanes per group, each loading contiguous channels. In 8-lane vectors the
    third straddled the groups and loaded each lane apart (MixNet-S's add took 13 us in bf16, 2 us after)."""
    scheduled = schedules.ElementwiseRule().apply(_compaction_add, targets.get_target("cpu"), False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _compaction_add_scheduled)
    rng = np.random.default_rng(8)
    x, r = rng.standard_normal((2, 64)).astype("float32"), rng.standard_normal((2, 40)).astype("float32")
    compacted = np.concatenate([x[:, :20], x[:, 32:52]], axis=1)
    np.testing.assert_array_equal(_run_scheduled(scheduled, [x, r], (2, 40)), compacted + r)


@pytest.mark.parametrize("name, index", [
    ("groups on whole 8-lane vectors: the vectors never straddle them", lambda j: j // 16 * 32 + j % 16),
    ("groups narrower than a vector", lambda j: j // 4 * 8 + j % 4),
    ("no contiguous groups: a transpose of a 4x10 tile", lambda j: j % 4 * 10 + j // 4),
    ("groups of 20 interleaved, not contiguous", lambda j: j % 20 * 2 + j // 20),
])
def test_a_row_without_groups_off_the_vectors_keeps_its_vectors(name, index):
    """Reads the groups rule leaves to the whole-vector one: their rows vectorize as they did."""
    @T.prim_func(private=True, s_tir=True)
    def gathered(x: T.Buffer((2, 80), "float32"), out: T.Buffer((2, 40), "float32")):
        for i, j in T.grid(2, 40):
            with T.sblock("copy"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = x[vi, index(vj)]

    sch = s_tir.Schedule(gathered)
    assert schedules._contiguous_group(sch, sch.get_sblock("copy"), 40) is None, name


@T.prim_func(private=True, s_tir=True)
def _image_to_nhwc4(x: T.Buffer((T.int64(1), T.int64(3), T.int64(8), T.int64(8)), "float32"),
                    out: T.Buffer((T.int64(1), T.int64(10), T.int64(10), T.int64(4)), "float32")):
    for n, h, w, c in T.grid(T.int64(1), T.int64(10), T.int64(10), T.int64(4)):
        with T.sblock("pad"):
            vn, vh, vw, vc = T.axis.remap("SSSS", [n, h, w, c])
            out[vn, vh, vw, vc] = T.if_then_else(T.int64(1) <= vh and vh < T.int64(9) and T.int64(1) <= vw
                                                 and vw < T.int64(9) and vc < T.int64(3),
                                                 x[vn, vc, vh - T.int64(1), vw - T.int64(1)], T.float32(0.0))


@T.prim_func(private=True, s_tir=True)
def _image_to_nhwc4_scheduled(x: T.Buffer((T.int64(1), T.int64(3), T.int64(8), T.int64(8)), "float32"),
                              out: T.Buffer((T.int64(1), T.int64(10), T.int64(10), T.int64(4)), "float32")):
    for ax0_fused in T.parallel(T.int64(10)):
        for ax1 in range(T.int64(10)):
            for ax2 in T.unroll(T.int64(4)):
                with T.sblock("pad"):
                    v0, v1, v2 = T.axis.remap("SSS", [ax0_fused, ax1, ax2])
                    T.reads(x[T.int64(0), v2, v0 + T.int64(-1), v1 + T.int64(-1)])
                    T.writes(out[T.int64(0), v0, v1, v2])
                    out[T.int64(0), v0, v1, v2] = T.if_then_else(
                        T.int64(1) <= v0 and v0 < T.int64(9) and T.int64(1) <= v1 and v1 < T.int64(9)
                        and v2 < T.int64(3),
                        x[T.int64(0), v2, v0 - T.int64(1), v1 - T.int64(1)], T.float32(0.0))


def test_a_transposing_pad_to_a_narrow_axis_runs_rows_in_parallel_not_gathered_vectors():
    """A model's NCHW input to NHWC with 3 channels padded to 4: vectors of the flat index would gather each lane
    (ResNet-50's bf16 input took 0.4-0.6 ms so); rows run in parallel, each row's pixels serially (LLVM vectorizes
    that loop), the 4 channels unrolled. The build matches numpy."""
    target = targets.get_target("cpu")
    scheduled = schedules.ElementwiseRule().apply(_image_to_nhwc4, target, False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _image_to_nhwc4_scheduled)
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype("float32")
    out = tvm.runtime.empty((1, 10, 10, 4), "float32")
    built = tvm.compile(tvm.IRModule({"main": scheduled.mod["main"].with_attr("global_symbol", "main")}),
                        target=target)
    built["main"](tvm.runtime.tensor(x), out)
    expected = np.pad(x.transpose(0, 2, 3, 1), [(0, 0), (1, 1), (1, 1), (0, 1)])
    np.testing.assert_array_equal(out.numpy(), expected)


@T.prim_func(private=True, s_tir=True)
def _pack_tokens(x: T.Buffer((T.int64(13), T.int64(8)), "float32"),
                 out: T.Buffer((T.int64(2), T.int64(4), T.int64(8), T.int64(2)), "bfloat16")):
    for b, p, t, k in T.grid(T.int64(2), T.int64(4), T.int64(8), T.int64(2)):
        with T.sblock("pack"):
            vb, vp, vt, vk = T.axis.remap("SSSS", [b, p, t, k])
            out[vb, vp, vt, vk] = T.if_then_else(
                vb * T.int64(8) + vt < T.int64(13),
                T.Cast("bfloat16", x[vb * T.int64(8) + vt, vp * T.int64(2) + vk] * T.float32(0.5)), T.bfloat16(0.0))


@T.prim_func(private=True, s_tir=True)
def _pack_tokens_scheduled(x: T.Buffer((T.int64(13), T.int64(8)), "float32"),
                           out: T.Buffer((T.int64(2), T.int64(4), T.int64(8), T.int64(2)), "bfloat16")):
    with T.sblock("root"):
        T.reads()
        T.writes()
        with T.sblock("pack_ax0_ax1_fused_common"):
            with T.sblock("pack_ax0_ax1_fused0_partition"):
                T.reads()
                T.writes()
                for ax0_ax1_fused0 in T.parallel(T.int64(4)):
                    for ax3 in T.unroll(T.int64(2)):
                        for ax2_0 in range(T.int64(1)):
                            for ax2_1 in T.vectorized(T.int64(8)):
                                with T.sblock("pack_ax0_ax1_fused0"):
                                    v0 = T.axis.spatial(T.int64(2), ax0_ax1_fused0 // T.int64(4))
                                    v1 = T.axis.spatial(T.int64(4), ax0_ax1_fused0 % T.int64(4))
                                    v2 = T.axis.spatial(T.int64(8), ax2_0 * T.int64(8) + ax2_1)
                                    v3 = T.axis.spatial(T.int64(2), ax3)
                                    out[v0, v1, v2, v3] = T.if_then_else(
                                        v0 * T.int64(8) + v2 < T.int64(13),
                                        T.Cast("bfloat16", x[v0 * T.int64(8) + v2, v1 * T.int64(2) + v3] * T.float32(0.5)),
                                        T.bfloat16(0.0))
            with T.sblock("pack_ax0_ax1_fused1_partition"):
                T.reads()
                T.writes()
                for ax0_ax1_fused1 in T.parallel(T.int64(4), T.int64(8)):
                    for ax3 in T.unroll(T.int64(2)):
                        for ax2_0 in range(T.int64(1)):
                            for ax2_1 in range(T.int64(8)):
                                with T.sblock("pack_ax0_ax1_fused1"):
                                    v0 = T.axis.spatial(T.int64(2), ax0_ax1_fused1 // T.int64(4))
                                    v1 = T.axis.spatial(T.int64(4), ax0_ax1_fused1 % T.int64(4))
                                    v2 = T.axis.spatial(T.int64(8), ax2_0 * T.int64(8) + ax2_1)
                                    v3 = T.axis.spatial(T.int64(2), ax3)
                                    out[v0, v1, v2, v3] = T.if_then_else(
                                        v0 * T.int64(8) + v2 < T.int64(13),
                                        T.Cast("bfloat16", x[v0 * T.int64(8) + v2, v1 * T.int64(2) + v3] * T.float32(0.5)),
                                        T.bfloat16(0.0))


def test_a_packing_transpose_vectorizes_across_its_narrow_axis_with_the_padded_tokens_apart():
    """Q·Kᵀ's run-time bf16 K packing (pairs of channels innermost, 8 tokens before them, 13 tokens padded to 16):
    each vector takes 8 tokens, loaded gathered, scaled and rounded at once (ViT-S/16's took 2.6x its fp32 time
    one value at a time); the column blocks whose tokens are all real run apart from the padded one, which stays
    serial (TVM's vectorizer would evaluate its condition lane by lane). The build matches numpy's bf16 rounding."""
    target = targets.get_target("cpu")
    scheduled = schedules.ElementwiseRule().apply(_pack_tokens, target, False)
    assert scheduled.mod["main"].script() == _pack_tokens_scheduled.script()  # the pieces share block variables
    x = np.random.default_rng(5).standard_normal((13, 8)).astype("float32")
    out = tvm.runtime.empty((2, 4, 8, 2), "bfloat16")
    built = tvm.compile(tvm.IRModule({"main": scheduled.mod["main"].with_attr("global_symbol", "main")}),
                        target=target)
    built["main"](tvm.runtime.tensor(x), out)
    tokens = np.pad(x * 0.5, [(0, 3), (0, 0)])  # 16 tokens by 8 channels
    expected = tokens.reshape(2, 8, 4, 2).transpose(0, 2, 1, 3).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out.numpy().view("uint16"), expected.view("uint16"))


def test_a_bf16_packing_with_a_column_block_of_padding_only_builds_and_matches_numpy():
    """16 tokens padded to 32 in blocks of 8: the last two blocks hold padding only. They stay serial loops: as
    vectors of bf16 zeros TVM's bf16 legalization failed to build them (DistilBERT's int8q K packing)."""
    mod = single_output_module(lambda x: relax.op.permute_dims(relax.op.reshape(relax.op.nn.pad(
        relax.op.astype(relax.op.multiply(x, relax.const(0.5, "float32")), "bfloat16"), [0, 16, 0, 0]),
        (4, 8, 4, 2)), [0, 2, 1, 3]), tensor("x", (16, 8)))
    x = np.random.default_rng(7).standard_normal((16, 8)).astype("float32")
    got = run_executable(build(mod, "cpu"), [x])[0]
    tokens = np.pad((x * 0.5).astype(ml_dtypes.bfloat16), [(0, 16), (0, 0)])
    np.testing.assert_array_equal(got.astype("float32"), tokens.reshape(4, 8, 4, 2).transpose(0, 2, 1, 3).astype("float32"))


@T.prim_func(private=True, s_tir=True)
def _rotated_pairs(x: T.Buffer((T.int64(16), T.int64(8)), "bfloat16"),
                   angle: T.Buffer((T.int64(16), T.int64(8)), "float32"),
                   out: T.Buffer((T.int64(4), T.int64(16), T.int64(2)), "bfloat16")):
    T.func_attr({"tirx.noalias": True})
    rotated = T.sblock_alloc_buffer((T.int64(16), T.int64(8)))
    for t, c in T.grid(T.int64(16), T.int64(8)):
        with T.sblock("rotated"):
            vt, vc = T.axis.remap("SS", [t, c])
            rotated[vt, vc] = (T.Cast("float32", x[vt, vc]) * angle[vt, vc]
                               - T.Cast("float32", x[vt, (vc + T.int64(4)) % T.int64(8)]) * angle[vt, vc])
    for p, t, k in T.grid(T.int64(4), T.int64(16), T.int64(2)):
        with T.sblock("packed"):
            vp, vt, vk = T.axis.remap("SSS", [p, t, k])
            out[vp, vt, vk] = T.Cast("bfloat16", rotated[vt, vp * T.int64(2) + vk])


def test_the_arithmetic_before_a_bf16_pair_packing_runs_in_its_own_layout():
    """A rotary on the keys before their bf16 run-time packing (LLaMA's) is computed in contiguous vectors into a
    buffer the packing copies from: inlined, it ran a value at a time in the packing's gathered order (LLaMA's
    4 K packings 0.263 -> 0.052 ms). The build matches numpy's bf16 rounding."""
    target = targets.get_target("cpu")
    sch = schedules.ElementwiseRule().apply(_rotated_pairs, target, False)
    assert [sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))] == ["rotated", "packed"]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16)
    angle = rng.standard_normal((16, 8)).astype("float32")
    out = tvm.runtime.empty((4, 16, 2), "bfloat16")
    tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)["main"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(angle), out)
    wide = x.astype("float32")
    rotated = (wide * angle - np.roll(wide, -4, axis=1) * angle).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out.numpy().view("uint16"),
                                  rotated.reshape(16, 4, 2).transpose(1, 0, 2).view("uint16"))


@T.prim_func(private=True, s_tir=True)
def _gated(x: T.Buffer((T.int64(64), T.int64(16)), "float32"), s: T.Buffer((T.int64(16),), "float32"),
           out: T.Buffer((T.int64(64), T.int64(16)), "float32")):
    T.func_attr({"tirx.noalias": True})
    gate = T.sblock_alloc_buffer((T.int64(16),))
    for j in range(T.int64(16)):
        with T.sblock("gate"):
            vj = T.axis.remap("S", [j])
            gate[vj] = T.exp(s[vj])
    for i, j in T.grid(T.int64(64), T.int64(16)):
        with T.sblock("gated"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = x[vi, vj] * gate[vj]


def test_elementwise_rule_computes_a_broadcast_operand_once():
    """A squeeze-and-excite gate (16 values for 64 x 16 outputs) stays its own loop nest: inlined, its exp would
    run again for each of the 64 rows. The build matches numpy."""
    target = targets.get_target("cpu")
    sch = schedules.ElementwiseRule().apply(_gated, target, False)
    blocks = [sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))]
    assert blocks == ["gate", "gated"]
    x, gate = np.random.default_rng(0).standard_normal((64, 16)).astype("float32"), np.linspace(-1, 1, 16, dtype="float32")
    out = tvm.runtime.empty((64, 16), "float32")
    tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)["main"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(gate), out)
    np.testing.assert_allclose(out.numpy(), x * np.exp(gate), rtol=1e-6)


@T.prim_func(private=True, s_tir=True)
def _grouped_scale(x: T.Buffer((T.int64(64), T.int64(16)), "float32"), s: T.Buffer((T.int64(4), T.int64(1)), "float32"),
                   out: T.Buffer((T.int64(64), T.int64(16)), "float32")):
    T.func_attr({"tirx.noalias": True})
    inverse = T.sblock_alloc_buffer((T.int64(4), T.int64(1)))
    per_channel = T.sblock_alloc_buffer((T.int64(16),))
    for g, k in T.grid(T.int64(4), T.int64(1)):
        with T.sblock("inverse"):
            vg, vk = T.axis.remap("SS", [g, k])
            inverse[vg, vk] = T.rsqrt(s[vg, vk])
    for j in range(T.int64(16)):
        with T.sblock("per_channel"):
            vj = T.axis.remap("S", [j])
            per_channel[vj] = inverse[vj // T.int64(4), T.int64(0)]
    for i, j in T.grid(T.int64(64), T.int64(16)):
        with T.sblock("scaled"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = x[vi, vj] * per_channel[vj]


def test_a_broadcast_operand_reached_through_a_copy_is_computed_once():
    """A group norm's scale: an rsqrt per group, copied out to its channels, then broadcast over the rows. The
    copy is inlined, the rsqrt is not (inlined, it would run again for each of the 64 rows)."""
    target = targets.get_target("cpu")
    sch = schedules.ElementwiseRule().apply(_grouped_scale, target, False)
    assert [sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))] == ["inverse", "scaled"]
    x, scale = np.random.default_rng(0).standard_normal((64, 16)).astype("float32"), np.arange(1, 5, dtype="float32")
    out = tvm.runtime.empty((64, 16), "float32")
    tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)["main"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(scale.reshape(4, 1)), out)
    np.testing.assert_allclose(out.numpy(), x * np.repeat(1 / np.sqrt(scale), 4), rtol=1e-6)


def test_a_broadcast_bool_mask_builds_and_matches_numpy():
    """An attention mask (DistilBERT's): a reshaped row of bools and-ed with a column, then a where. The small
    bool block is inlined: kept apart, TVM's LLVM codegen mixed i1 and i8 lanes loading it back."""
    mod = single_output_module(
        lambda row, column: relax.op.where(relax.op.logical_and(column, relax.op.reshape(row, (1, 1, 1, 128))),
                                           relax.const(1.0, "float32"), relax.const(-3.0, "float32")),
        tensor("row", (1, 1, 1, 128, 1), "bool"), tensor("column", (1, 1, 128, 1), "bool"))
    rng = np.random.default_rng(1)
    row, column = rng.random((1, 1, 1, 128, 1)) > 0.5, rng.random((1, 1, 128, 1)) > 0.5
    got = run_executable(build(mod, "cpu"), [row, column])[0]
    np.testing.assert_array_equal(got, np.where(column & row.reshape(1, 1, 1, 128), 1.0, -3.0))


@T.prim_func(private=True, s_tir=True)
def _row_share(x: T.Buffer((T.int64(4), T.int64(32)), "float32"), out: T.Buffer((T.int64(4), T.int64(32)), "float32")):
    T.func_attr({"tirx.noalias": True})
    total = T.sblock_alloc_buffer((T.int64(4),))
    for i, k in T.grid(T.int64(4), T.int64(32)):
        with T.sblock("total"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                total[vi] = T.float32(0)
            total[vi] = total[vi] + x[vi, vk]
    for i, j in T.grid(T.int64(4), T.int64(32)):
        with T.sblock("share"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = x[vi, vj] / total[vi]


@T.macro
def _halved_sum(acc, partial, lanes, row):
    """A row's partial sums `partial` (2 * `lanes` of them) added in halves into `acc`: RowReductionRule's nest."""
    for lane_init in T.vectorized(T.int64(lanes)):
        with T.sblock("total_rf_init"):
            v_lane, v_row = T.axis.remap("SS", [lane_init, row])
            T.reads()
            T.writes(acc[v_row, v_lane])
            acc[v_row, v_lane] = T.float32(0.0)
    for half in range(T.int64(2)):
        for lane in T.vectorized(T.int64(lanes)):
            with T.sblock("total_rf_update"):
                v_lane, v_half, v_row = T.axis.remap("SRS", [lane, half, row])
                T.reads(acc[v_row, v_lane], partial[v_row, v_half * T.int64(lanes) + v_lane])
                T.writes(acc[v_row, v_lane])
                acc[v_row, v_lane] = acc[v_row, v_lane] + partial[v_row, v_half * T.int64(lanes) + v_lane]


@T.prim_func(private=True, s_tir=True)
def _row_share_scheduled(x: T.Buffer((T.int64(4), T.int64(32)), "float32"),
                         out: T.Buffer((T.int64(4), T.int64(32)), "float32")):
    T.func_attr({"tirx.noalias": True})
    total = T.sblock_alloc_buffer((T.int64(4),))
    total_rf = T.sblock_alloc_buffer((T.int64(4), T.int64(16)))
    total_8 = T.sblock_alloc_buffer((T.int64(4), T.int64(8)))
    total_4 = T.sblock_alloc_buffer((T.int64(4), T.int64(4)))
    total_2 = T.sblock_alloc_buffer((T.int64(4), T.int64(2)))
    for row in T.parallel(T.int64(4)):
        for lane_init in T.vectorized(T.int64(16)):
            with T.sblock("total_rf_init"):
                v_lane, v_row = T.axis.remap("SS", [lane_init, row])
                T.reads()
                T.writes(total_rf[v_row, v_lane])
                total_rf[v_row, v_lane] = T.float32(0.0)
        for step in range(T.int64(2)):
            for lane in T.vectorized(T.int64(16)):
                with T.sblock("total_rf_update"):
                    v_lane, v_row, v_step = T.axis.remap("SSR", [lane, row, step])
                    T.reads(total_rf[v_row, v_lane], x[v_row, v_step * T.int64(16) + v_lane])
                    T.writes(total_rf[v_row, v_lane])
                    total_rf[v_row, v_lane] = total_rf[v_row, v_lane] + x[v_row, v_step * T.int64(16) + v_lane]
        _halved_sum(total_8, total_rf, 8, row)
        _halved_sum(total_4, total_8, 4, row)
        _halved_sum(total_2, total_4, 2, row)
        for lane in range(T.int64(2)):
            with T.sblock("total"):
                v_lane, v_row = T.axis.remap("RS", [lane, row])
                T.reads(total_2[v_row, v_lane])
                T.writes(total[v_row])
                with T.init():
                    total[v_row] = T.float32(0.0)
                total[v_row] = total[v_row] + total_2[v_row, v_lane]
        for column_block in range(T.int64(2)):
            for column in T.vectorized(T.int64(16)):
                with T.sblock("share"):
                    v_row = T.axis.spatial(T.int64(4), row)
                    v_column = T.axis.spatial(T.int64(32), column_block * T.int64(16) + column)
                    T.reads(x[v_row, v_column], total[v_row])
                    T.writes(out[v_row, v_column])
                    out[v_row, v_column] = x[v_row, v_column] / total[v_row]


def test_row_reduction_rule_runs_each_row_in_parallel_with_vector_partial_sums():
    """One parallel iteration per row; the sum keeps 16 partial sums in one vector over the row's two vectors
    (rfactor), adds them up in halves (16 -> 8 -> 4 -> 2, a vector add each, then the last two), and the division
    runs on whole vectors."""
    scheduled = schedules.RowReductionRule().apply(_row_share, targets.get_target("cpu"), False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _row_share_scheduled)


@T.prim_func(private=True, s_tir=True)
def _whole_share(x: T.Buffer((T.int64(1), T.int64(64)), "float32"),
                 out: T.Buffer((T.int64(1), T.int64(64)), "float32")):
    T.func_attr({"tirx.noalias": True})
    total = T.sblock_alloc_buffer((T.int64(1), T.int64(1)))
    for i, j, k in T.grid(T.int64(1), T.int64(1), T.int64(64)):
        with T.sblock("total"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                total[vi, vj] = T.float32(0)
            total[vi, vj] = total[vi, vj] + x[vi, vk]
    for i, j in T.grid(T.int64(1), T.int64(64)):
        with T.sblock("share"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = x[vi, vj] / total[vi, T.int64(0)]


@T.prim_func(private=True, s_tir=True)
def _whole_share_scheduled(x: T.Buffer((T.int64(1), T.int64(64)), "float32"),
                           out: T.Buffer((T.int64(1), T.int64(64)), "float32")):
    T.func_attr({"tirx.noalias": True})
    total = T.sblock_alloc_buffer((T.int64(1), T.int64(1)))
    total_rf = T.sblock_alloc_buffer((T.int64(1), T.int64(1), T.int64(32)))
    for unit in range(T.int64(1)):
        for lane_init in T.vectorized(T.int64(32)):
            with T.sblock("total_rf_init"):
                v_lane, v_unit = T.axis.remap("SS", [lane_init, unit])
                T.reads()
                T.writes(total_rf[T.int64(0), T.int64(0), v_lane])
                total_rf[T.int64(0), T.int64(0), v_lane] = T.float32(0.0)
        for step in range(T.int64(2)):
            for lane in T.vectorized(T.int64(32)):
                with T.sblock("total_rf_update"):
                    v_lane, v_unit, v_step = T.axis.remap("SSR", [lane, unit, step])
                    T.reads(total_rf[T.int64(0), T.int64(0), v_lane], x[T.int64(0), v_step * T.int64(32) + v_lane])
                    T.writes(total_rf[T.int64(0), T.int64(0), v_lane])
                    total_rf[T.int64(0), T.int64(0), v_lane] = (total_rf[T.int64(0), T.int64(0), v_lane]
                                                                + x[T.int64(0), v_step * T.int64(32) + v_lane])
    for unit, lane in T.grid(T.int64(1), T.int64(32)):
        with T.sblock("total"):
            v_lane, v_unit = T.axis.remap("RS", [lane, unit])
            T.reads(total_rf[T.int64(0), T.int64(0), v_lane])
            T.writes(total[T.int64(0), T.int64(0)])
            with T.init():
                total[T.int64(0), T.int64(0)] = T.float32(0.0)
            total[T.int64(0), T.int64(0)] = total[T.int64(0), T.int64(0)] + total_rf[T.int64(0), T.int64(0), v_lane]
    for column_block in T.parallel(T.int64(4)):
        for column in T.vectorized(T.int64(16)):
            with T.sblock("share"):
                v_column = T.axis.spatial(T.int64(64), column_block * T.int64(16) + column)
                T.reads(x[T.int64(0), v_column], total[T.int64(0), T.int64(0)])
                T.writes(out[T.int64(0), v_column])
                out[T.int64(0), v_column] = x[T.int64(0), v_column] / total[T.int64(0), T.int64(0)]


def test_a_reduction_broadcast_over_what_it_reduced_runs_once_before_the_elementwise_tail():
    """A sum over a whole row kept as [1, 1] and broadcast back over the row (a group norm of one group, as
    PoolFormer's): its unit axes are not rows to compute it in, or it would be redone for each of the row's
    elements (TVM's rule does so: seconds per PoolFormer inference). It runs once, in two vectors of partial sums
    (two chains of adds); the division runs over the row, parallel and vectorized."""
    scheduled = schedules.RowReductionRule().apply(_whole_share, targets.get_target("cpu"), False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _whole_share_scheduled)


def test_a_one_group_norm_builds_and_matches_numpy():
    def group_norm(x):
        flat = relax.op.reshape(x, (1, 1, 512))
        centered = relax.op.subtract(flat, relax.op.mean(flat, axis=[2], keepdims=True))
        spread = relax.op.sqrt(relax.op.add(relax.op.variance(flat, axis=[2], keepdims=True), relax.const(1e-5)))
        return relax.op.reshape(relax.op.divide(centered, spread), (1, 8, 8, 8))
    x = np.random.default_rng(7).standard_normal((1, 8, 8, 8)).astype("float32")
    got = run_executable(build(single_output_module(group_norm, tensor("x", (1, 8, 8, 8))), "cpu"), [x])[0]
    np.testing.assert_allclose(got, (x - x.mean()) / np.sqrt(x.var() + 1e-5), rtol=1e-4, atol=1e-5)


def test_row_reduction_rule_leaves_rows_off_whole_vectors_and_other_targets():
    """A layer norm over 33 columns (softmax rows are padded instead: relay_amp.backend.cpu.rows) would need the tail
    predicate that compute_at drops: TVM's rule takes it."""
    rows_off_vectors = tuning.prepare(_module(*CASES["softmax_layer_norm"]), targets.get_target("cpu"))
    layer_norm = next(f for gv, f in rows_off_vectors.functions_items() if "layer_norm" in gv.name_hint)
    assert schedules.RowReductionRule().apply(layer_norm, targets.get_target("cpu"), False) is None
    assert schedules.RowReductionRule().apply(_row_share, targets.get_target("cuda-tensorcore"), False) is None
    assert schedules.RowReductionRule().apply(_matmul_bias, targets.get_target("cpu"), False) is None


@T.prim_func(private=True, s_tir=True)
def _row_abs_max(x: T.Buffer((T.int64(4), T.int64(32)), "float32"),
                 out: T.Buffer((T.int64(4), T.int64(1)), "float32")):
    T.func_attr({"tirx.noalias": True})
    magnitude = T.sblock_alloc_buffer((T.int64(4), T.int64(32)))
    for i, j in T.grid(T.int64(4), T.int64(32)):
        with T.sblock("magnitude"):
            vi, vj = T.axis.remap("SS", [i, j])
            magnitude[vi, vj] = T.fabs(x[vi, vj])
    for i, one, k in T.grid(T.int64(4), T.int64(1), T.int64(32)):
        with T.sblock("largest"):
            vi, vone, vk = T.axis.remap("SSR", [i, one, k])
            with T.init():
                out[vi, vone] = T.float32(-3.4028234663852886e38)
            out[vi, vone] = T.max(out[vi, vone], magnitude[vi, vk])


@T.macro
def _halved_max(acc, partial, lanes, row):
    """A row's partial maxima `partial` (2 * `lanes` of them) reduced in halves into `acc`."""
    for lane_init in T.vectorized(T.int64(lanes)):
        with T.sblock("largest_rf_init"):
            v_lane, v_row = T.axis.remap("SS", [lane_init, row])
            T.reads()
            T.writes(acc[v_row, T.int64(0), v_lane])
            acc[v_row, T.int64(0), v_lane] = T.float32(-3.4028234663852886e38)
    for half in range(T.int64(2)):
        for lane in T.vectorized(T.int64(lanes)):
            with T.sblock("largest_rf_update"):
                v_lane, v_half, v_row = T.axis.remap("SRS", [lane, half, row])
                T.reads(acc[v_row, T.int64(0), v_lane], partial[v_row, T.int64(0), v_half * T.int64(lanes) + v_lane])
                T.writes(acc[v_row, T.int64(0), v_lane])
                acc[v_row, T.int64(0), v_lane] = T.max(acc[v_row, T.int64(0), v_lane],
                                                       partial[v_row, T.int64(0), v_half * T.int64(lanes) + v_lane])


@T.prim_func(private=True, s_tir=True)
def _row_abs_max_scheduled(x: T.Buffer((T.int64(4), T.int64(32)), "float32"),
                           out: T.Buffer((T.int64(4), T.int64(1)), "float32")):
    T.func_attr({"tirx.noalias": True})
    magnitude = T.sblock_alloc_buffer((T.int64(4), T.int64(32)))
    out_rf = T.sblock_alloc_buffer((T.int64(4), T.int64(1), T.int64(16)))
    out_8 = T.sblock_alloc_buffer((T.int64(4), T.int64(1), T.int64(8)))
    out_4 = T.sblock_alloc_buffer((T.int64(4), T.int64(1), T.int64(4)))
    out_2 = T.sblock_alloc_buffer((T.int64(4), T.int64(1), T.int64(2)))
    for row in T.parallel(T.int64(4)):
        for column_block in range(T.int64(2)):
            for column in T.vectorized(T.int64(16)):
                with T.sblock("magnitude"):
                    v_row = T.axis.spatial(T.int64(4), row)
                    v_column = T.axis.spatial(T.int64(32), column_block * T.int64(16) + column)
                    T.reads(x[v_row, v_column])
                    T.writes(magnitude[v_row, v_column])
                    magnitude[v_row, v_column] = T.fabs(x[v_row, v_column])
        for lane_init in T.vectorized(T.int64(16)):
            with T.sblock("largest_rf_init"):
                v_lane, v_row = T.axis.remap("SS", [lane_init, row])
                T.reads()
                T.writes(out_rf[v_row, T.int64(0), v_lane])
                out_rf[v_row, T.int64(0), v_lane] = T.float32(-3.4028234663852886e38)
        for step in range(T.int64(2)):
            for lane in T.vectorized(T.int64(16)):
                with T.sblock("largest_rf_update"):
                    v_lane, v_row, v_step = T.axis.remap("SSR", [lane, row, step])
                    T.reads(out_rf[v_row, T.int64(0), v_lane], magnitude[v_row, v_step * T.int64(16) + v_lane])
                    T.writes(out_rf[v_row, T.int64(0), v_lane])
                    out_rf[v_row, T.int64(0), v_lane] = T.max(out_rf[v_row, T.int64(0), v_lane],
                                                              magnitude[v_row, v_step * T.int64(16) + v_lane])
        _halved_max(out_8, out_rf, 8, row)
        _halved_max(out_4, out_8, 4, row)
        _halved_max(out_2, out_4, 2, row)
        for lane in range(T.int64(2)):
            with T.sblock("largest"):
                v_lane, v_row = T.axis.remap("RS", [lane, row])
                T.reads(out_2[v_row, T.int64(0), v_lane])
                T.writes(out[v_row, T.int64(0)])
                with T.init():
                    out[v_row, T.int64(0)] = T.float32(-3.4028234663852886e38)
                out[v_row, T.int64(0)] = T.max(out[v_row, T.int64(0)], out_2[v_row, T.int64(0), v_lane])


def test_row_reduction_rule_takes_a_function_that_ends_in_its_reduction():
    """A row's largest magnitude (a dynamic int8 matmul's scale) with nothing after the reduction: rows in
    parallel, vector partial results; before, no rule took it and it ran serial, one element at a time."""
    scheduled = schedules.RowReductionRule().apply(_row_abs_max, targets.get_target("cpu"), False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _row_abs_max_scheduled)


@T.prim_func(private=True, s_tir=True)
def _row_sum_off_vectors(x: T.Buffer((T.int64(4), T.int64(37)), "float32"),
                         out: T.Buffer((T.int64(4),), "float32")):
    T.func_attr({"tirx.noalias": True})
    for i, k in T.grid(T.int64(4), T.int64(37)):
        with T.sblock("total"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                out[vi] = T.float32(0)
            out[vi] = out[vi] + x[vi, vk]


@T.prim_func(private=True, s_tir=True)
def _row_sum_off_vectors_scheduled(x: T.Buffer((T.int64(4), T.int64(37)), "float32"),
                                   out: T.Buffer((T.int64(4),), "float32")):
    T.func_attr({"tirx.noalias": True})
    out_rf = T.sblock_alloc_buffer((T.int64(4), T.int64(16)))
    for row in T.parallel(T.int64(4)):
        for lane_init in T.vectorized(T.int64(16)):
            with T.sblock("total_rf_init"):
                v_lane, v_row = T.axis.remap("SS", [lane_init, row])
                T.reads()
                T.writes(out_rf[v_row, v_lane])
                out_rf[v_row, v_lane] = T.float32(0.0)
        with T.sblock("total_rf_update_ax1_0_common"):
            T.reads()
            T.writes()
            with T.sblock("total_rf_update_ax1_00_partition"):
                T.reads()
                T.writes()
                for step in range(T.int64(2)):
                    for lane in T.vectorized(T.int64(16)):
                        with T.sblock("total_rf_update_ax1_00"):
                            v_lane, v_row, v_step = T.axis.remap("SSR", [lane, row, step])
                            T.where(step * T.int64(16) + lane < T.int64(37))
                            T.reads(out_rf[T.int64(0):T.int64(4), T.int64(0):T.int64(16)],
                                    x[v_row, v_step * T.int64(16) + v_lane])
                            T.writes(out_rf[T.int64(0):T.int64(4), T.int64(0):T.int64(16)])
                            out_rf[v_row, v_lane] = out_rf[v_row, v_lane] + x[v_row, v_step * T.int64(16) + v_lane]
            with T.sblock("total_rf_update_ax1_01_partition"):
                T.reads()
                T.writes()
                for step in range(T.int64(2), T.int64(3)):
                    for lane in T.vectorized(T.int64(16)):
                        with T.sblock("total_rf_update_ax1_01"):
                            v_lane, v_row, v_step = T.axis.remap("SSR", [lane, row, step])
                            T.where(step * T.int64(16) + lane < T.int64(37))
                            T.reads(out_rf[T.int64(0):T.int64(4), T.int64(0):T.int64(16)],
                                    x[v_row, v_step * T.int64(16) + v_lane])
                            T.writes(out_rf[T.int64(0):T.int64(4), T.int64(0):T.int64(16)])
                            out_rf[v_row, v_lane] = out_rf[v_row, v_lane] + x[v_row, v_step * T.int64(16) + v_lane]
        for lane in range(T.int64(16)):
            with T.sblock("total"):
                v_lane, v_row = T.axis.remap("RS", [lane, row])
                T.reads(out_rf[v_row, v_lane])
                T.writes(out[v_row])
                with T.init():
                    out[v_row] = T.float32(0.0)
                out[v_row] = out[v_row] + out_rf[v_row, v_lane]


def test_a_reduction_over_rows_off_whole_vectors_adds_vectors_then_a_serial_tail():
    """A function of one sum over rows of 37 (ConViT's sums of 196 attention weights): rows in parallel, the two
    whole vectors of each added in vector partial sums, the last 5 values in a loop of their own (a partition of
    the steps, so the whole vectors' predicate folds away). Before, no rule took it: one thread, one value at a
    time (51 us for ConViT-Ti's 4 x 196 x 196, 10 us now)."""
    scheduled = schedules.RowReductionRule().apply(_row_sum_off_vectors, targets.get_target("cpu"), False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _row_sum_off_vectors_scheduled)


def test_a_reduction_of_several_values_over_rows_off_whole_vectors_is_left_to_tvms_rule():
    """An argmax reduces a value and its index together: the copies of its block that partitioning the steps
    makes fail to lower (a variable bound twice), so the tail path declines it."""
    x = te.placeholder((4, 100), "float32", name="x")
    argmax = te.create_prim_func([x, topi.argmax(x, axis=1)])
    assert schedules.RowReductionRule().apply(argmax, targets.get_target("cpu"), False) is None


@T.prim_func(private=True, s_tir=True)
def _column_mean(x: T.Buffer((T.int64(6), T.int64(32)), "float32"), out: T.Buffer((T.int64(32),), "float32")):
    T.func_attr({"tirx.noalias": True})
    total = T.sblock_alloc_buffer((T.int64(32),))
    for j, k in T.grid(T.int64(32), T.int64(6)):
        with T.sblock("total"):
            vj, vk = T.axis.remap("SR", [j, k])
            with T.init():
                total[vj] = T.float32(0)
            total[vj] = total[vj] + x[vk, vj]
    for j in range(T.int64(32)):
        with T.sblock("mean"):
            vj = T.axis.remap("S", [j])
            out[vj] = total[vj] / T.float32(6)


@T.prim_func(private=True, s_tir=True)
def _column_mean_scheduled(x: T.Buffer((T.int64(6), T.int64(32)), "float32"),
                           out: T.Buffer((T.int64(32),), "float32")):
    T.func_attr({"tirx.noalias": True})
    total = T.sblock_alloc_buffer((T.int64(32),))
    for column_block in T.parallel(T.int64(2)):
        for lane_init in T.vectorized(T.int64(16)):
            with T.sblock("total_init"):
                v_column = T.axis.spatial(T.int64(32), column_block * T.int64(16) + lane_init)
                T.reads()
                T.writes(total[v_column])
                total[v_column] = T.float32(0.0)
        for row in range(T.int64(6)):
            for lane in T.vectorized(T.int64(16)):
                with T.sblock("total_update"):
                    v_column = T.axis.spatial(T.int64(32), column_block * T.int64(16) + lane)
                    v_row = T.axis.reduce(T.int64(6), row)
                    T.reads(total[v_column], x[v_row, v_column])
                    T.writes(total[v_column])
                    total[v_column] = total[v_column] + x[v_row, v_column]
        for lane in T.vectorized(T.int64(16)):
            with T.sblock("mean"):
                v_column = T.axis.spatial(T.int64(32), column_block * T.int64(16) + lane)
                T.reads(total[v_column])
                T.writes(out[v_column])
                out[v_column] = total[v_column] / T.float32(6.0)


def test_column_reduction_rule_adds_whole_vectors_of_the_kept_axis_in_parallel():
    """A sum over the outer axis (a pool over NHWC's pixels): one parallel item per vector of 16 columns, each
    adding its vector across the rows, then the division on that vector; RowReductionRule would take one column
    at a time, its elements 32 apart."""
    scheduled = schedules.ColumnReductionRule().apply(_column_mean, targets.get_target("cpu"), False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _column_mean_scheduled)


def _column_mean_of(columns: int, rows: int = 6) -> tvm.tirx.PrimFunc:
    """_column_mean over `columns` columns (and `rows` rows)."""
    x = te.placeholder((rows, columns), "float32", "x")
    row = te.reduce_axis((0, rows), "row")
    total = te.compute((columns,), lambda j: te.sum(x[row, j], axis=row), name="total")
    return te.create_prim_func([x, te.compute((columns,), lambda j: total[j] / float(rows), name="mean")])


def test_column_reduction_rule_takes_vectors_of_8_where_16_do_not_divide_the_kept_axis():
    """RegNetY's squeeze-excite pools over 104 channels: 13 parallel vectors of 8 lanes, not one gathered channel
    at a time (0.025 -> 0.006 ms per pool on Zen 4); 20 columns, no whole vectors either way, stay with the next
    rule."""
    scheduled = schedules.ColumnReductionRule().apply(_column_mean_of(104), targets.get_target("cpu"), False)
    loops = [scheduled.get(loop) for loop in scheduled.get_loops(scheduled.get_sblock("total_update"))]
    assert [(loop.kind, int(loop.extent)) for loop in loops] == [
        (tvm.tirx.ForKind.PARALLEL, 13), (tvm.tirx.ForKind.SERIAL, 6), (tvm.tirx.ForKind.VECTORIZED, 8)]
    assert schedules.ColumnReductionRule().apply(_column_mean_of(20), targets.get_target("cpu"), False) is None


def test_column_reduction_rule_takes_a_kept_axis_shorter_than_a_vector_by_its_largest_power_of_two():
    """A sum over the rows of 12 columns: three parallel vectors of 4 lanes (12's largest power-of-two divisor). One
    column is no kept axis: the rule leaves it."""
    scheduled = schedules.ColumnReductionRule().apply(_column_mean_of(12), targets.get_target("cpu"), False)
    loops = [scheduled.get(loop) for loop in scheduled.get_loops(scheduled.get_sblock("total_update"))]
    assert [(loop.kind, int(loop.extent)) for loop in loops] == [
        (tvm.tirx.ForKind.PARALLEL, 3), (tvm.tirx.ForKind.SERIAL, 6), (tvm.tirx.ForKind.VECTORIZED, 4)]
    assert schedules.ColumnReductionRule().apply(_column_mean_of(1), targets.get_target("cpu"), False) is None


@pytest.mark.parametrize("case", ["softmax_middle_axis_of_4", "softmax_middle_axis_of_3"])
def test_a_softmax_over_a_middle_axis_keeping_fewer_lanes_than_a_vector_reduces_each_row_once(case):
    """A softmax over the keys with 4 or 3 heads kept last: ColumnReductionRule runs each row's max and sum once,
    over a vector of the heads, every block inside the parallel loop over the rows. TVM's rule, which took it,
    parallelized over rows and keys and recomputed the row's max and sum for each key (a [1, 196, 196, 4] softmax:
    40 ms against 0.09)."""
    mod = tuning.prepare(_module(*CASES[case]), targets.get_target("cpu"))
    softmax = next(f for gv, f in mod.functions_items() if "softmax" in gv.name_hint)
    scheduled = schedules.ColumnReductionRule().apply(softmax, targets.get_target("cpu"), False)
    shape = CASES[case][1][1]
    blocks = scheduled.get_child_blocks(scheduled.get_sblock("root"))
    for block in blocks:
        loops = [scheduled.get(loop) for loop in scheduled.get_loops(block)]
        assert (loops[0].kind, int(loops[0].extent)) == (tvm.tirx.ForKind.PARALLEL, shape[0] * shape[1])
    sums = [block for block in blocks if scheduled.get(block).name_hint.endswith("_red_update")]  # the max, the sum
    for block in sums:
        loops = [scheduled.get(loop) for loop in scheduled.get_loops(block)]
        assert [(loop.kind, int(loop.extent)) for loop in loops[1:]] == [
            (tvm.tirx.ForKind.SERIAL, shape[2]), (tvm.tirx.ForKind.VECTORIZED, shape[3])]
    assert len(sums) == 2


def _cores_target(cores: int) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": cores})


def _loop_kinds(scheduled: s_tir.Schedule, block: str) -> list:
    loops = scheduled.get_loops(scheduled.get_sblock(block))
    return [(loop.kind, int(loop.extent)) for loop in map(scheduled.get, loops)]


@pytest.mark.parametrize("cores, pixels, chains", [(2, 256, 4), (4, 96, 2)])
def test_a_column_reduction_over_pixels_that_split_evenly_adds_a_run_of_them_a_core_in_chains(cores, pixels, chains):
    """Pixels of 32 channels: a run of pixels for each of the target's cores, summed in chains of vectors (4, or 2
    where 4 would leave chains shorter than MIN_CHAIN: 96 pixels on 4 cores), in parallel over runs and vectors;
    the runs' partial sums added after, a vector at a time, then the division on that vector. EfficientNet-B0's
    squeeze-excite pools had summed each vector over every pixel in one chain (now bf16 0.96x, int8q 0.93x the whole
    model's time on a 2-core Sapphire Rapids)."""
    scheduled = schedules.ColumnReductionRule().apply(_column_mean_of(32, pixels), _cores_target(cores), False)
    parallel, serial, unrolled, vectorized = (tvm.tirx.ForKind.PARALLEL, tvm.tirx.ForKind.SERIAL,
                                              tvm.tirx.ForKind.UNROLLED, tvm.tirx.ForKind.VECTORIZED)
    assert _loop_kinds(scheduled, "total_rf_update") == [
        (parallel, cores * 2), (serial, pixels // cores // chains), (unrolled, chains), (vectorized, 16)]
    assert _loop_kinds(scheduled, "total_update") == [(serial, 2), (serial, cores * chains), (vectorized, 16)]
    assert _loop_kinds(scheduled, "mean") == [(serial, 2), (vectorized, 16)]


def test_a_column_reduction_over_pixels_that_do_not_split_takes_a_vector_an_item():
    """7 x 7 pixels do not split into even runs for two cores: one parallel item a vector, over every pixel."""
    scheduled = schedules.ColumnReductionRule().apply(_column_mean_of(32, 49), _cores_target(2), False)
    assert _loop_kinds(scheduled, "total_update") == [
        (tvm.tirx.ForKind.PARALLEL, 2), (tvm.tirx.ForKind.SERIAL, 49), (tvm.tirx.ForKind.VECTORIZED, 16)]


def test_a_column_reduction_whose_partial_sums_tir_refuses_takes_a_vector_an_item(monkeypatch):
    def refused(self, *args):
        raise s_tir.ScheduleError("refused")

    monkeypatch.setattr(s_tir.Schedule, "rfactor", refused)
    scheduled = schedules.ColumnReductionRule().apply(_column_mean_of(32, 256), _cores_target(2), False)
    assert _loop_kinds(scheduled, "total_update") == [
        (tvm.tirx.ForKind.PARALLEL, 2), (tvm.tirx.ForKind.SERIAL, 256), (tvm.tirx.ForKind.VECTORIZED, 16)]


def test_column_reduction_rule_leaves_row_reductions_and_other_targets():
    assert schedules.ColumnReductionRule().apply(_row_share, targets.get_target("cpu"), False) is None
    assert schedules.ColumnReductionRule().apply(_column_mean, targets.get_target("cuda-tensorcore"), False) is None
    assert schedules.ColumnReductionRule().apply(_matmul_bias, targets.get_target("cpu"), False) is None


def test_column_reduction_rule_runs_a_softmax_over_a_middle_axis_in_vectors_of_the_innermost():
    """A softmax over axis 2 of [1, 49, 49, 8] (EfficientFormerV2 in NHWC) fell to TVM's rule, one scalar at a time:
    257 us in fp32 and 1056 us with a bf16 cast, 20 us now (Zen 4). Each row's max and sum add vectors of the
    kept channels across the reduced positions; the elementwise blocks run in the same parallel row."""
    x = te.placeholder((1, 5, 7, 16), name="x")
    func = te.create_prim_func([x, topi.nn.softmax(x, axis=2)])
    scheduled = schedules.ColumnReductionRule().apply(func, targets.get_target("cpu"), False)
    for reduction in ("T_softmax_maxelem_update", "T_softmax_expsum_update"):
        loops = [scheduled.get(loop) for loop in scheduled.get_loops(scheduled.get_sblock(reduction))]
        assert [(loop.kind, int(loop.extent)) for loop in loops] == [
            (tvm.tirx.ForKind.PARALLEL, 5), (tvm.tirx.ForKind.SERIAL, 7), (tvm.tirx.ForKind.VECTORIZED, 16)]


def _row_reduction_blocks(case: str) -> list[str]:
    """The block names RowReductionRule leaves in CASES[case]'s one reducing function."""
    return _scheduled_blocks(case, schedules.RowReductionRule())


def test_row_reduction_rule_takes_vectors_of_8_where_16_do_not_divide_the_row():
    """A layer norm over 40 channels (ConvNeXt-atto's first stage) fell to TVM's rule: one scalar at a time, and its
    bf16 cast lane by lane behind a predicate (3.4x slower than now in fp32, 5x in bf16, on Zen 4)."""
    x = te.placeholder((6, 40), name="x")
    gamma, beta = te.placeholder((40,), name="gamma"), te.placeholder((40,), name="beta")
    norm = topi.nn.layer_norm(x, gamma, beta, axis=[1], epsilon=1e-5)
    scheduled = schedules.RowReductionRule().apply(te.create_prim_func([x, gamma, beta, norm]),
                                                   targets.get_target("cpu"), False)
    output = scheduled.get_loops(scheduled.get_sblock("T_layer_norm"))
    assert [(scheduled.get(loop).kind, int(scheduled.get(loop).extent)) for loop in output] == [
        (tvm.tirx.ForKind.PARALLEL, 6), (tvm.tirx.ForKind.SERIAL, 5), (tvm.tirx.ForKind.VECTORIZED, 8)]


def _layer_norm_rows(channels: int, dtype: str) -> tvm.tirx.PrimFunc:
    """A layer norm over rows of `channels`, stored as `dtype`."""
    x = te.placeholder((6, channels), name="x")
    gamma, beta = te.placeholder((channels,), name="gamma"), te.placeholder((channels,), name="beta")
    norm = topi.nn.layer_norm(x, gamma, beta, axis=[1], epsilon=1e-5)
    return te.create_prim_func([x, gamma, beta, norm if dtype == "float32" else topi.cast(norm, dtype)])


def _vector_lanes(sch: "tvm.s_tir.Schedule", block: str) -> int:
    """The lanes of the innermost (vectorized) loop of `block`."""
    innermost = sch.get(sch.get_loops(sch.get_sblock(block))[-1])
    assert innermost.kind == tvm.tirx.ForKind.VECTORIZED
    return int(innermost.extent)


@pytest.mark.parametrize("channels,partial_lanes", [(384, 64), (96, 32), (64, 32), (32, 16), (40, 8)])
def test_row_reduction_rule_adds_a_row_into_independent_vectors_of_partial_sums(channels, partial_lanes):
    """Each pass of a layer norm adds its row into up to four vectors of partial sums, as many as divide the row
    in two rounds or more: independent chains of adds. In one vector, the chain of a row's 24 dependent adds bounded
    a layer norm over 28x28x384 (Swin-T's; 25 -> 20 us in fp32, 34 -> 25 us rounded to bf16, Zen 5)."""
    scheduled = schedules.RowReductionRule().apply(_layer_norm_rows(channels, "float32"), targets.get_target("cpu"),
                                                   False)
    partial_sums = {}  # each factored sum's first buffer of partial sums (the halving steps' come after)
    for buffer in scheduled.mod["main"].body.block.alloc_buffers:
        partial_sums.setdefault(buffer.name, int(buffer.shape[-1]))
    assert partial_sums["x_sum.rf"] == partial_sums["x_var_sum.rf"] == partial_lanes
    script = scheduled.mod["main"].script()
    assert f"for ax0_1 in T.vectorized({partial_lanes}):" in script  # the additions into them, vectorized


@pytest.mark.parametrize("channels,dtype,lanes", [(96, "bfloat16", 32), (96, "float32", 16), (40, "bfloat16", 8),
                                                  (48, "bfloat16", 16)])
def test_row_reduction_rule_stores_bf16_rows_in_vectors_of_two_registers(channels, dtype, lanes):
    """A row stored as bf16 is written 32 lanes at a time where they divide it, which bf16_round rounds with one
    instruction (vcvtne2ps2bf16) into one 64-byte store; fp32 rows and rows off 32 lanes keep `_row_lanes`."""
    scheduled = schedules.RowReductionRule().apply(_layer_norm_rows(channels, dtype), targets.get_target("cpu"), False)
    last = scheduled.get(scheduled.get_child_blocks(scheduled.get_sblock("root"))[-1]).name_hint
    assert _vector_lanes(scheduled, last) == lanes


@pytest.mark.skipif(not targets.host_supports("avx512_bf16"), reason="host CPU lacks avx512_bf16")
def test_a_bf16_layer_norm_stored_two_registers_at_a_time_matches_numpy():
    """Built as a bf16 target builds it (the roundings on the instructions), the layer norm over 96 channels rounds
    its rows 32 lanes at a time and matches numpy's within a bf16 rounding."""
    target = targets.get_target("cpu-avx512-bf16")
    scheduled = schedules.RowReductionRule().apply(_layer_norm_rows(96, "bfloat16"), target, False)
    func = scheduled.mod["main"].with_attr("global_symbol", "main")
    lib = tvm.compile(candidate_passes(target)(tvm.IRModule({"main": func})), target=target)
    assert "vcvtne2ps2bf16" in lib.mod.inspect_source("asm")
    rng = np.random.default_rng(5)
    x, gamma, beta = (rng.standard_normal(shape).astype("float32") for shape in ((6, 96), (96,), (96,)))
    got = tvm.runtime.empty((6, 96), "bfloat16")
    lib["main"](*(tvm.runtime.tensor(value) for value in (x, gamma, beta)), got)
    expected = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5) * gamma + beta
    np.testing.assert_allclose(got.numpy().astype("float32"), expected, rtol=2 ** -8, atol=1e-6)


def test_row_reduction_rule_vectorizes_a_row_off_whole_vectors_with_a_serial_rest():
    """A softmax padded to 48 columns, sliced back to 37 and guarded against NaN (as an export's attention
    spells it): the blocks over the 37 columns ran serial (DINOv2 at 518x518: 1370 of 1376 columns, a quarter of
    its time). The division, the isnan and the where (which reads the slice in place) are now one block, two
    vectors of 16 and a serial rest of 5, and match numpy."""
    x = te.placeholder((6, 48), name="x")
    row = topi.strided_slice(topi.nn.softmax(x, axis=1), [0, 0], [6, 37])
    zero = te.placeholder((), name="zero")  # a constant the fused function takes as a parameter
    guarded = topi.where(topi.isnan(row), zero, row)
    scheduled = schedules.RowReductionRule().apply(te.create_prim_func([x, zero, guarded]), targets.get_target("cpu"),
                                                   False)
    script = scheduled.mod["main"].script()
    assert not re.search(r'sblock\("(T_softmax_norm|compute)', script)  # computed in the where's block
    whole = re.search(r'sblock\("(T_where_ax\d+0)"\)', script).group(1)  # the partition of whole vectors
    loops = [scheduled.get(loop) for loop in scheduled.get_loops(scheduled.get_sblock(whole))]  # in the row
    assert [(loop.kind, int(loop.extent)) for loop in loops] == [
        (tvm.tirx.ForKind.SERIAL, 2), (tvm.tirx.ForKind.VECTORIZED, 16)]
    values = np.random.default_rng(3).standard_normal((6, 48)).astype("float32")
    values[:, 37:] = np.finfo("float32").min
    got = tvm.runtime.empty((6, 37), "float32")
    tvm.compile(tvm.IRModule({"main": scheduled.mod["main"].with_attr("global_symbol", "main")}),
                target=targets.get_target("cpu"))["main"](tvm.runtime.tensor(values),
                                                          tvm.runtime.tensor(np.zeros((), "float32")), got)
    exps = np.exp(values[:, :37] - values.max(axis=1, keepdims=True))
    np.testing.assert_allclose(got.numpy(), exps / exps.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_row_reduction_rule_computes_elementwise_steps_in_their_readers():
    """The layer norm and the multiply after it are one block, which writes the output; the softmax's x - max is
    computed in its exp, and its exps, which the sum reads, keep their block (each reader would compute them); the
    reciprocal of the sum is computed in the product's block (where LLVM computes it once a row)."""
    layer_norm = _row_reduction_blocks("layer_norm_scaled_rows")
    assert "T_layer_norm" not in layer_norm and layer_norm[-1] == "T_multiply"
    softmax = _row_reduction_blocks("softmax_layer_norm_rows")
    assert "T_subtract" not in softmax and "fast_exp" in softmax and "T_divide" not in softmax
    assert softmax[-1] == "T_multiply"  # formula.fast_softmax: exps times 1 / sum


def test_row_reduction_rule_widens_a_bf16_input_as_each_pass_loads_it():
    """A layer norm of a bf16 row: the cast block is inlined into the reductions and the output, not stored."""
    x = te.placeholder((8, 64), "bfloat16", name="x")
    gamma, beta = te.placeholder((64,), name="gamma"), te.placeholder((64,), name="beta")
    norm = topi.nn.layer_norm(topi.cast(x, "float32"), gamma, beta, axis=[1], epsilon=1e-5)
    scheduled = schedules.RowReductionRule().apply(te.create_prim_func([x, gamma, beta, norm]),
                                                   targets.get_target("cpu"), False)
    names = [scheduled.get(block).name_hint for block in scheduled.get_child_blocks(scheduled.get_sblock("root"))]
    assert names[0] != "compute" and "compute" not in names  # the cast block
    assert scheduled.mod["main"].script().count('T.Cast("float32", x[') == 4  # sum, variance (x - mean twice), output


def test_row_reduction_rule_reads_a_slice_in_place():
    """The window a layer norm reads of a wider tensor (case built and checked against the reference above) is
    read in each pass's loads: no function (before: one storing the slice) or block copies the slice first."""
    prepared = tuning.prepare(_module(*CASES["layer_norm_of_a_slice"]), targets.get_target("cpu"))
    assert [gv.name_hint for gv, f in prepared.functions_items() if isinstance(f, tvm.tirx.PrimFunc)] == ["layer_norm"]
    names = _scheduled_blocks("layer_norm_of_a_slice", schedules.RowReductionRule())
    assert "T_strided_slice" not in names and "T_layer_norm" in names


def _scheduled_blocks(case: str, rule: "schedules._CpuRule") -> list[str]:
    """The block names `rule` leaves in CASES[case]'s first function."""
    prepared = tuning.prepare(_module(*CASES[case]), targets.get_target("cpu"))
    func = next(f for _, f in prepared.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    scheduled = rule.apply(func, targets.get_target("cpu"), False)
    return [scheduled.get(block).name_hint for block in scheduled.get_child_blocks(scheduled.get_sblock("root"))]


def test_a_window_reads_its_input_through_the_padding_condition_not_a_padded_copy():
    """max_pool and a depthwise conv (cases built and checked against the reference above) keep no pad block; a
    convolution, which reads its padded input once per output-channel tile, still pads it first."""
    assert not [name for name in _scheduled_blocks("max_pool", schedules.ContractionRule()) if "pad" in name]
    assert not [name for name in _scheduled_blocks("depthwise_conv_nhwc", schedules.ContractionRule())
                if "pad" in name]
    assert [name for name in _scheduled_blocks("conv_nchw_stride2", schedules.ContractionRule()) if "pad" in name]


def test_an_epilogue_operand_computed_apart_is_inlined_into_the_write_back():
    """A residual sliced from a wider tensor (case built and checked against the reference above) is read through
    the slice by the conv's write-back: no block computes the slice, or the add, apart (before: both ran as whole
    scalar passes after the conv, 0.095 of StarNet-S1's 3.2 ms in bf16 on Zen 4)."""
    names = _scheduled_blocks("depthwise_conv_sliced_residual", schedules.ContractionRule())
    assert not [name for name in names if "strided_slice" in name or "add" in name]


@T.prim_func(private=True, s_tir=True)
def _size_and_double(length: T.Buffer((), "int64"), x: T.Buffer((32,), "float32"), size: T.Buffer((), "int64"),
                     y: T.Buffer((32,), "float32")):
    with T.sblock("size"):
        size[()] = length[()] * T.int64(8)
    for i in range(32):
        with T.sblock("double"):
            vi = T.axis.spatial(32, i)
            y[vi] = x[vi] * T.float32(2)


@T.prim_func(private=True, s_tir=True)
def _size_and_double_scheduled(length: T.Buffer((), "int64"), x: T.Buffer((32,), "float32"),
                               size: T.Buffer((), "int64"), y: T.Buffer((32,), "float32")):
    with T.sblock("size"):
        T.reads(length[()])
        T.writes(size[()])
        size[()] = length[()] * T.int64(8)
    for ax0_fused_0 in T.parallel(2):
        for ax0_fused_1 in T.vectorized(16):
            with T.sblock("double"):
                v0 = T.axis.spatial(32, ax0_fused_0 * 16 + ax0_fused_1)
                T.reads(x[v0])
                T.writes(y[v0])
                y[v0] = x[v0] * T.float32(2.0)


def test_elementwise_rule_leaves_a_scalar_block_as_it_is():
    """A size computed from a symbolic shape (a dynamic model's) is a block with no loop: nothing to schedule."""
    scheduled = schedules.ElementwiseRule().apply(_size_and_double, targets.get_target("cpu"), False)
    tvm.ir.assert_structural_equal(scheduled.mod["main"], _size_and_double_scheduled)


@pytest.mark.parametrize("shape, loops", [
    ((1, 224, 224, 4), [(tvm.tirx.ForKind.PARALLEL, 12544), (tvm.tirx.ForKind.VECTORIZED, 16)]),  # rows of 896
    ((1, 230, 230, 4), [(tvm.tirx.ForKind.PARALLEL, 26450), (tvm.tirx.ForKind.VECTORIZED, 8)]),  # rows of 920
    ((3, 5, 7), [(tvm.tirx.ForKind.PARALLEL, 105)]),  # no vector fits the rows of 7
])
def test_a_narrow_innermost_axis_is_vectorized_without_crossing_rows(shape, loops):
    """The int8 stem kernel's shift of a 230x230x4 image to uint8: in vectors of 16, a vector crossed a row of
    920 values every other time and TVM computed every lane's address apart (0.17 ms; 0.008 in vectors of 8)."""
    data = te.placeholder(shape, "int8", "data")
    shifted = te.compute(shape, lambda *i: (data[i].astype("int32") + 128).astype("uint8"), name="shifted")
    sch = s_tir.Schedule(te.create_prim_func([data, shifted]))
    schedules.schedule_injective(sch, sch.get_sblock("shifted"))
    got = [(sch.get(loop).kind, int(sch.get(loop).extent)) for loop in sch.get_loops(sch.get_sblock("shifted"))]
    assert got == loops


@pytest.mark.parametrize("shape, parallel", [((1, 1024), False), ((3, 1024), False), ((4, 1024), True)])
def test_a_block_writing_few_values_runs_serially(shape, parallel, monkeypatch):
    """An LSTM step's gates (1 x 1024) split four ways ran in four pool launches, 14.7 us for 1024 values: a block
    writing fewer than MIN_PARALLEL_VALUES values runs on the calling thread, still vectorized."""
    monkeypatch.setattr(schedules, "MIN_PARALLEL_VALUES", 4096)
    data = te.placeholder(shape, "float32", "data")
    doubled = te.compute(shape, lambda *i: data[i] * 2.0, name="doubled")
    sch = s_tir.Schedule(te.create_prim_func([data, doubled]))
    schedules.schedule_injective(sch, sch.get_sblock("doubled"))
    kinds = [sch.get(loop).kind for loop in sch.get_loops(sch.get_sblock("doubled"))]
    assert (tvm.tirx.ForKind.PARALLEL in kinds) == parallel
    assert tvm.tirx.ForKind.VECTORIZED in kinds


def _reshape_chain(adds: int):
    """adds of a constant to a (1, 64, 8) tensor, reshaped to (1, 8, 64) and back by turns after every third add."""
    x = te.placeholder((1, 64, 8), "float32", name="x")
    value = x
    for i in range(adds):
        value = topi.add(value, tvm.tirx.const(0.001, "float32"))
        if i % 3 == 0:
            value = topi.reshape(value, (1, 8, 64) if i % 2 else (1, 64, 8))
    return te.create_prim_func([x, topi.reshape(value, (1, 64, 8))])


def test_a_chain_of_alternating_reshapes_is_inlined_in_bounded_pieces_and_matches_numpy():
    """Each reshape reads the index before it twice (a floordiv and a floormod), so inlining the whole chain
    grows its index expression exponentially (60 adds took 10 s and 2 GB to schedule, 120 ran out of memory).
    A block whose value passed MAX_INLINED_NODES stays a buffer: 60 adds schedule in a few pieces, each of
    bounded size, and match numpy."""
    target = targets.get_target("cpu")
    sch = schedules.ElementwiseRule().apply(_reshape_chain(60), target, False)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    assert 1 < len(blocks) < 40
    assert all(schedules._value_nodes(sch.get(block).body, 10**6) <= 4 * schedules.MAX_INLINED_NODES for block in blocks)
    x, out = np.random.default_rng(0).random((1, 64, 8), dtype="float32"), tvm.runtime.empty((1, 64, 8), "float32")
    tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)["main"](
        tvm.runtime.tensor(x), out)
    np.testing.assert_allclose(out.numpy(), x + np.float32(0.06), rtol=1e-5)


def test_inlining_within_bounds_inlines_whole_chains_below_the_bound(monkeypatch):
    """Below the bound every block of a chain is inlined, as dlight's try_inline does; with a bound of 8 nodes,
    blocks stay buffers where their values outgrow it, and a consumer is not inlined into a producer that has."""
    target = targets.get_target("cpu")
    assert len(_children(schedules.ElementwiseRule().apply(_reshape_chain(6), target, False))) == 1
    monkeypatch.setattr(schedules, "MAX_INLINED_NODES", 8)
    sch = schedules.ElementwiseRule().apply(_reshape_chain(6), target, False)
    assert 1 < len(_children(sch))
    assert all(schedules._value_nodes(sch.get(block).body, 10**6) <= 4 * 8 for block in _children(sch))


def _children(sch):
    return sch.get_child_blocks(sch.get_sblock("root"))


def test_a_function_with_a_block_of_undescribed_writes_builds():
    """TVM writes scatter_nd (MViTv2's ONNX export) as a block whose reads and writes it leaves empty, beside a
    transpose of the indices: the broadcast check read the first write of every block and failed (IndexError)."""
    rng = np.random.default_rng(0)
    indices = np.stack(np.meshgrid(np.arange(2), np.arange(3), indexing="ij"), axis=-1).astype("int64")  # (2, 3, 2)
    mod = single_output_module(lambda data, updates: relax.op.scatter_nd(data, relax.const(indices), updates),
                               tensor("data", (2, 3, 4)), tensor("updates", (2, 3, 4)))
    inputs = [rng.standard_normal((2, 3, 4)).astype("float32") for _ in range(2)]
    got = run_executable(build(mod, "cpu"), inputs)[0]
    np.testing.assert_array_equal(got, relay_amp.run(mod, inputs)[0])


def test_a_timm_tf_mixnet_l_vectorizes_its_residual_adds_a_group_at_a_time(tmp_path, monkeypatch):
    """timm's TF-MixNet-L (not the MixNet-S this was written on; groups of 28, 52 and 132 channels, each padded to
    whole vectors by its grouped kernel): in bf16, each residual add reading a compaction of padded groups is
    vectorized a group at a time, and the build matches PyTorch within bf16's rounding."""
    pytest.importorskip("timm")
    from builders import timm_through_onnx
    from pass_checks import prepared_module

    from relay_amp.backend.cpu.pipeline import untuned_schedule

    _, imported, x, expected = timm_through_onnx("tf_mixnet_l", tmp_path)
    bf16 = relay_amp.to_mixed_precision(imported, "bfloat16")
    groups = []
    monkeypatch.setattr(schedules, "_contiguous_group", _recording(schedules._contiguous_group, groups))
    target = targets.get_target("cpu-avx512-bf16")
    for gv, func in prepared_module(bf16).functions.items():
        if re.search(r"strided_slice\d*_reshape\d*_cast\d*_(strided_slice\d*_)?add", gv.name_hint):
            untuned_schedule(func.with_attr("global_symbol", "main"), target)
    assert sorted(set(groups)) == [(56, 28), (104, 52), (264, 132)], groups
    got = run_executable(build(bf16, targets.host_preset()), [x])[0]
    np.testing.assert_allclose(got, expected, atol=0.03 * np.abs(expected).max())  # bf16 reads 0.013


def _recording(find_group, found: list):
    """`find_group` (`_contiguous_group`), appending (row, group) to `found` for every group it finds."""
    def recorded(sch, block, row):
        group = find_group(sch, block, row)
        if group:
            found.append((row, group))
        return group
    return recorded


def test_a_timm_ghostnetv2_reads_runs_off_16_lanes_in_whole_vectors(tmp_path):
    """timm's GhostNetV2-1.0 (not the MixNet this was written on) concatenates runs of 24, 40, 56 and 120 channels,
    on 8-lane vectors but off 16: in bf16 each of its concatenations is a vector loop per run (by the run's whole
    length where a run is off 16 lanes, not by 8 lanes), none left serial, and the build matches PyTorch within bf16's rounding."""
    pytest.importorskip("timm")
    from builders import timm_through_onnx
    from pass_checks import prepared_module

    from relay_amp.backend.cpu.pipeline import untuned_schedule

    _, imported, x, expected = timm_through_onnx("ghostnetv2_100", tmp_path)
    bf16 = relay_amp.to_mixed_precision(imported, "bfloat16")
    target = targets.get_target("cpu-avx512-bf16")
    widths = set()
    for gv, func in prepared_module(bf16).functions.items():
        if "concatenate" in gv.name_hint and isinstance(func, tvm.tirx.PrimFunc):
            text = untuned_schedule(func.with_attr("global_symbol", "main"), target).mod.script()
            block_loops = r"for \w+ in ([\w.]+)\(.*\n\s*with T.sblock\(\"\w+(?<!_partition)(?<!_common)\""
            innermost = re.findall(block_loops, text)  # the loops directly around a computing block
            assert innermost and all(loop == "T.vectorized" for loop in innermost), text
            widths |= {int(width) for width in re.findall(r"T.vectorized\((?:T.int64\()?(\d+)\)", text)}
    assert {24, 40, 56, 120} <= widths, widths  # in 8-lane vectors before
    got = run_executable(build(bf16, targets.host_preset()), [x])[0]
    np.testing.assert_allclose(got, expected, atol=0.03 * np.abs(expected).max())


def test_a_timm_ghostnetv3_writes_its_sliced_attention_maps_back_in_vectors(tmp_path):
    """timm's GhostNetV3-1.0 (not the GhostNetV2 this was written on) gates its ghost modules by maps of depthwise
    convs over channels padded to 16-lane vectors, with a sigmoid, sliced back to their 72, 120, 200 or 184
    channels: in bf16 each such write-back runs in 8-lane vectors inside the slice (lane by lane before), and the
    build matches PyTorch within bf16's rounding."""
    pytest.importorskip("timm")
    from builders import timm_through_onnx
    from pass_checks import prepared_module

    from relay_amp.backend.cpu.pipeline import untuned_schedule

    _, imported, x, expected = timm_through_onnx("ghostnetv3_100", tmp_path)
    bf16 = relay_amp.to_mixed_precision(imported, "bfloat16")
    target = targets.get_target("cpu-avx512-bf16")
    sliced_maps = 0
    for gv, func in prepared_module(bf16).functions.items():
        if "sigmoid" in gv.name_hint and "strided_slice" in gv.name_hint and isinstance(func, tvm.tirx.PrimFunc):
            text = untuned_schedule(func.with_attr("global_symbol", "main"), target).mod.script()
            lines = text.splitlines()
            at = next(i for i, line in enumerate(lines) if "T.where" in line)
            loop = next(line for line in reversed(lines[:at]) if line.lstrip().startswith("for "))
            assert loop.endswith("in T.vectorized(T.int64(8)):"), text
            sliced_maps += 1
    assert sliced_maps == 4, sliced_maps
    got = run_executable(build(bf16, targets.host_preset()), [x])[0]
    np.testing.assert_allclose(got, expected, atol=0.03 * np.abs(expected).max())


def test_a_timm_fasternet_reads_each_concatenated_run_in_one_vector(tmp_path):
    """timm's FasterNet-T0 (not the GhostNet this was written on) convolves the first quarter of its channels and
    concatenates the rest after it (runs of 10 and 30, 20 and 60): in bf16 each of those concatenations is a vector
    loop per run, none left serial, and the build matches PyTorch within bf16's rounding."""
    pytest.importorskip("timm")
    from builders import timm_through_onnx
    from pass_checks import prepared_module

    from relay_amp.backend.cpu.pipeline import untuned_schedule

    _, imported, x, expected = timm_through_onnx("fasternet_t0", tmp_path)
    bf16 = relay_amp.to_mixed_precision(imported, "bfloat16")
    target = targets.get_target("cpu-avx512-bf16")
    widths = set()
    for gv, func in prepared_module(bf16).functions.items():
        if "concatenate" in gv.name_hint and isinstance(func, tvm.tirx.PrimFunc):
            text = untuned_schedule(func.with_attr("global_symbol", "main"), target).mod.script()
            block_loops = r"for \w+ in ([\w.]+)\(.*\n\s*with T.sblock\(\"\w+(?<!_partition)(?<!_common)\""
            innermost = re.findall(block_loops, text)  # the loops directly around a computing block
            assert innermost and all(loop == "T.vectorized" for loop in innermost), text
            widths |= {int(width) for width in re.findall(r"T.vectorized\((?:T.int64\()?(\d+)", text)}
    assert {10, 20} <= widths, widths
    got = run_executable(build(bf16, targets.host_preset()), [x])[0]
    np.testing.assert_allclose(got, expected, atol=0.03 * np.abs(expected).max())
