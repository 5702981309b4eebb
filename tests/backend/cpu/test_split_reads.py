"""split_reads: a depthwise conv of one part of a channel split reads its part of the split tensor in place."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import targets
from relay_amp.backend.cpu import split_reads
from relay_amp.backend.cpu.split_reads import DepthwiseReadsSplitInPlace
from relay_amp.compile.build import build
from relay_amp._ir import tensor_shape
from relay_amp.ops import call_op_name
from relay_amp.runtime import run_executable
from relay_amp.tools.bench import variant

from builders import timm_through_onnx
from pass_checks import assert_transforms, prepared_module

RNG = np.random.default_rng(0)
W3 = RNG.standard_normal((3, 3, 1, 16)).astype("float32")  # HWIO: one input channel per group
W5 = RNG.standard_normal((5, 5, 1, 24)).astype("float32")


def _mixed_conv(strides: int = 1, dtype: str = "float32", other_reader: bool = False) -> tvm.IRModule:
    """MixNet's mixed depthwise conv: 40 channels split into 16 and 24, a 3x3 and a 5x5 depthwise conv, concatenated
    (with `other_reader`, the first part also added to the first conv's result)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 40), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, [16], axis=3))
            first, second = bb.emit(relax.TupleGetItem(parts, 0)), bb.emit(relax.TupleGetItem(parts, 1))
            narrow = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
            convs = [bb.emit(relax.op.nn.conv2d(part, relax.const(weight.astype(narrow)), strides=strides, padding=pad,
                                                groups=weight.shape[3], data_layout="NHWC", kernel_layout="HWIO",
                                                out_dtype="float32"))
                     for part, weight, pad in ((first, W3, 1), (second, W5, 2))]
            if other_reader:
                convs[0] = bb.emit(relax.op.add(convs[0], relax.op.astype(first, "float32")))
            out = bb.emit_output(bb.emit(relax.op.concat(convs, axis=3)))
        bb.emit_func_output(out)
    return bb.get()


def _expected(strides: int = 1) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 40), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            convs = [bb.emit(bb.call_te(split_reads._depthwise_nhwc_at, x, relax.const(weight),
                                        (offset, weight.shape[3], "float32"), [strides, strides], [pad] * 4, [1, 1],
                                        "float32", primfunc_name_hint="depthwise_conv2d_at"))
                     for weight, offset, pad in ((W3, 0, 1), (W5, 16, 2))]
            out = bb.emit_output(bb.emit(relax.op.concat(convs, axis=3)))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("strides", [1, 2])
def test_each_depthwise_conv_of_a_split_part_reads_the_split_tensor_at_its_offset(strides):
    """The split goes: nothing reads its parts once the convs read their channels of x in place."""
    assert_transforms(DepthwiseReadsSplitInPlace(), _mixed_conv(strides), _expected(strides))


def test_a_split_part_another_op_reads_keeps_the_split():
    after = DepthwiseReadsSplitInPlace()(_mixed_conv(other_reader=True))
    relax.analysis.well_formed(after)
    ops = [call_op_name(b.value) for b in after["main"].body.blocks[0].bindings]
    assert ops.count("relax.split") == 1 and ops.count("relax.call_tir") == 2 and "relax.nn.conv2d" not in ops


def _parts_cast_for_their_convs() -> tvm.IRModule:
    """A split of an fp32 tensor whose parts AMP rounds to bf16 for their depthwise convs (InceptionNeXt in int8q,
    whose identity part stays fp32): 40 channels split into 16 and 24."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 40), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, [16], axis=3))
            convs = []
            for index, weight, pad in ((0, W3, 1), (1, W5, 2)):
                narrow = bb.emit(relax.op.astype(bb.emit(relax.TupleGetItem(parts, index)), "bfloat16"))
                convs.append(bb.emit(relax.op.nn.conv2d(
                    narrow, relax.const(weight.astype(ml_dtypes.bfloat16)), padding=pad, groups=weight.shape[3],
                    data_layout="NHWC", kernel_layout="HWIO", out_dtype="float32")))
            out = bb.emit_output(bb.emit(relax.op.concat(convs, axis=3)))
        bb.emit_func_output(out)
    return bb.get()


def test_a_depthwise_conv_of_a_part_cast_for_it_reads_the_split_tensor_and_casts_as_it_reads():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 40), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            convs = [bb.emit(bb.call_te(split_reads._depthwise_nhwc_at, x,
                                        relax.const(weight.astype(ml_dtypes.bfloat16), "bfloat16"),
                                        (offset, weight.shape[3], "bfloat16"), [1, 1], [pad] * 4, [1, 1], "float32",
                                        primfunc_name_hint="depthwise_conv2d_at"))
                     for weight, offset, pad in ((W3, 0, 1), (W5, 16, 2))]
            out = bb.emit_output(bb.emit(relax.op.concat(convs, axis=3)))
        bb.emit_func_output(out)
    assert_transforms(DepthwiseReadsSplitInPlace(), _parts_cast_for_their_convs(), bb.get())


def test_built_parts_cast_for_their_convs_match_the_reference():
    """Within the bf16 rounding of the parts, which the build may leave out (it never reaches memory)."""
    mod = _parts_cast_for_their_convs()
    data = RNG.standard_normal((1, 8, 8, 40)).astype("float32")
    got = run_executable(build(mod, targets.host_preset()), [data])[0].astype("float64")
    expected = relay_amp.run(mod, [data])[0].astype("float64")
    assert np.abs(got - expected).max() <= 2 ** -7 * np.abs(expected).max()


@pytest.mark.parametrize("module, reason", [
    (lambda: relax.transform.Normalize()(_grouped_of_split()), "two input channels a group"),
    (lambda: _split_over_rows(), "a split of the rows, not the channels"),
])
def test_convs_that_are_not_depthwise_convs_of_channel_parts_are_left_alone(module, reason):
    before = module()
    after = DepthwiseReadsSplitInPlace()(before)
    assert "relax.nn.conv2d" in [call_op_name(b.value) for b in after["main"].body.blocks[0].bindings], reason


def _grouped_of_split() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 40), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            part = bb.emit(relax.TupleGetItem(bb.emit(relax.op.split(x, [16], axis=3)), 0))
            conv = bb.emit(relax.op.nn.conv2d(part, relax.const(np.ones((3, 3, 2, 16), "float32")), padding=1,
                                              groups=8, data_layout="NHWC", kernel_layout="HWIO"))
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    return bb.get()


def _split_over_rows() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            part = bb.emit(relax.TupleGetItem(bb.emit(relax.op.split(x, 2, axis=1)), 0))
            conv = bb.emit(relax.op.nn.conv2d(part, relax.const(W3), padding=1, groups=16, data_layout="NHWC",
                                              kernel_layout="HWIO"))
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("dtype, strides, tolerance", [
    ("float32", 1, 1e-6), ("float32", 2, 1e-6),
    ("bfloat16", 1, 1e-6),  # the same bf16 products summed in fp32: only the order may differ
])
def test_built_mixed_conv_matches_the_generic_build(dtype, strides, tolerance):
    mod = _mixed_conv(strides, dtype)
    data = RNG.standard_normal((1, 8, 8, 40)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    got = run_executable(build(mod, targets.host_preset()), [data])[0].astype("float64")
    expected = relay_amp.run(mod, [data])[0].astype("float64")
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def test_a_timm_mixnet_m_runs_no_split_of_its_mixed_convs(tmp_path):
    """timm's MixNet-M (mixed depthwise convs of up to four parts, widths other than MixNet-S's), a model this was
    not written on: no function of its build splits a tensor, every depthwise conv computes whole 16-lane vectors,
    and it matches PyTorch's fp32."""
    pytest.importorskip("timm")
    _, imported, x, expected = timm_through_onnx("mixnet_m", tmp_path)
    prepared = prepared_module(imported)
    names = [gv.name_hint for gv in prepared.get_global_vars()]
    assert not [name for name in names if "split" in name]
    assert len([name for name in names if "depthwise_conv2d_at" in name]) == 28
    widths = {int(func.params[-1].shape[-1]) for gv, func in prepared.functions_items()
              if "depthwise_conv2d_at" in gv.name_hint}
    assert all(width % 16 == 0 for width in widths), widths  # parts of 120 and 300 computed on 128 and 304
    built = run_executable(build(imported, targets.host_preset()), [x])[0]
    np.testing.assert_allclose(built, expected, atol=1e-5 * np.abs(expected).max())


def _split_of_compaction(parts_in_groups: bool = True) -> tvm.IRModule:
    """A grouped conv's kernel result of 2 groups of 12 channels padded to 16 (x), compacted to 24 channels and split
    into two parts of 12 (one a group each, or, without `parts_in_groups`, 8 and 16 across them), each part
    through a 3x3 depthwise conv, concatenated."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 32), "float32"))
    sections = [12] if parts_in_groups else [8]
    with bb.function("main", [x]):
        with bb.dataflow():
            kept = bb.emit(relax.op.strided_slice(bb.emit(relax.op.reshape(x, (1, 8, 8, 2, 16))), axes=[4], begin=[0],
                                                  end=[12]))
            parts = bb.emit(relax.op.split(bb.emit(relax.op.reshape(kept, (1, 8, 8, 24))), sections, axis=3))
            convs = []
            for index, width in enumerate((sections[0], 24 - sections[0])):
                part = bb.emit(relax.TupleGetItem(parts, index))
                convs.append(bb.emit(relax.op.nn.conv2d(part, relax.const(W3[..., :width]), padding=1, groups=width,
                                                        data_layout="NHWC", kernel_layout="HWIO")))
            out = bb.emit_output(bb.emit(relax.op.concat(convs, axis=3)))
        bb.emit_func_output(out)
    return bb.get()


def test_parts_of_a_compacted_split_read_their_group_of_the_padded_result():
    """The parts read x at offsets 0 and 16 (each group's first 12 of 16 channels), so the compaction goes too; each
    conv computes its group's 16 channels (zero weights on the last 4), and the concatenation reads its 12."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 32), "float32"))
    weight = np.pad(W3[..., :12], [(0, 0)] * 3 + [(0, 4)])
    with bb.function("main", [x]):
        with bb.dataflow():
            convs = [bb.emit(bb.call_te(split_reads._depthwise_nhwc_at, x, relax.const(weight), (offset, 16, "float32"),
                                        [1, 1], [1] * 4, [1, 1], "float32", primfunc_name_hint="depthwise_conv2d_at"))
                     for offset in (0, 16)]
            out = bb.emit_output(bb.emit(bb.call_te(split_reads._concat_of_parts, convs, [(0, 12), (0, 12)],
                                                    primfunc_name_hint="concatenate")))
        bb.emit_func_output(out)
    assert_transforms(DepthwiseReadsSplitInPlace(), _split_of_compaction(), bb.get())


def test_parts_across_the_groups_of_a_compacted_split_read_the_compaction():
    after = DepthwiseReadsSplitInPlace()(_split_of_compaction(parts_in_groups=False))
    ops = [call_op_name(b.value) for b in after["main"].body.blocks[0].bindings]
    assert "relax.strided_slice" in ops and "relax.split" not in ops  # the 16-channel part spans both groups


def test_built_split_of_compaction_matches_the_generic_build():
    for parts_in_groups in (True, False):
        mod = _split_of_compaction(parts_in_groups)
        data = RNG.standard_normal((1, 8, 8, 32)).astype("float32")
        got = run_executable(build(mod, targets.host_preset()), [data])[0]
        np.testing.assert_allclose(got, relay_amp.run(mod, [data])[0], rtol=1e-6, atol=1e-6)


BIAS = RNG.standard_normal(20).astype("float32")
W20 = RNG.standard_normal((3, 3, 1, 20)).astype("float32")


def _part_off_the_vectors(dtype: str = "float32", other_reader: bool = False) -> tvm.IRModule:
    """36 channels split into 16 and 20, each part through a 3x3 depthwise conv, the second's result through a bias
    add and a cast to `dtype` (with `other_reader`, also a graph output), concatenated."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 36), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, [16], axis=3))
            convs = [bb.emit(relax.op.nn.conv2d(bb.emit(relax.TupleGetItem(parts, index)), relax.const(weight),
                                                padding=1, groups=weight.shape[3], data_layout="NHWC",
                                                kernel_layout="HWIO"))
                     for index, weight in enumerate((W3, W20))]
            biased = bb.emit(relax.op.astype(bb.emit(relax.op.add(convs[1], relax.const(BIAS))), dtype))
            joined = bb.emit(relax.op.concat([bb.emit(relax.op.astype(convs[0], dtype)), biased], axis=3))
            out = bb.emit_output(relax.Tuple([joined, biased]) if other_reader else joined)
        bb.emit_func_output(out)
    return bb.get()


def test_a_part_off_the_vectors_is_convolved_with_channels_before_it_where_none_follow():
    """The 20 channels at offset 16, the last of 36, fill two 16-lane vectors with the 12 before them: the conv reads
    x from channel 4 with zero weights on its first 12 channels, its bias add takes zeros there, and the
    concatenation reads channels 12 to 32 of the cast."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 36), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            first = bb.emit(bb.call_te(split_reads._depthwise_nhwc_at, x, relax.const(W3), (0, 16, "float32"), [1, 1],
                                       [1] * 4, [1, 1], "float32", primfunc_name_hint="depthwise_conv2d_at"))
            weight = np.pad(W20, [(0, 0)] * 3 + [(12, 0)])
            second = bb.emit(bb.call_te(split_reads._depthwise_nhwc_at, x, relax.const(weight), (4, 32, "float32"),
                                        [1, 1], [1] * 4, [1, 1], "float32", primfunc_name_hint="depthwise_conv2d_at"))
            biased = bb.emit(relax.op.add(second, relax.const(np.pad(BIAS, [(12, 0)]))))
            cast = bb.emit(relax.op.astype(biased, "bfloat16"))
            out = bb.emit_output(bb.emit(bb.call_te(
                split_reads._concat_of_parts, [bb.emit(relax.op.astype(first, "bfloat16")), cast], [(0, 16), (12, 32)],
                primfunc_name_hint="concatenate")))
        bb.emit_func_output(out)
    assert_transforms(DepthwiseReadsSplitInPlace(), _part_off_the_vectors("bfloat16"), bb.get())


def test_a_part_another_op_reads_keeps_its_channels():
    after = DepthwiseReadsSplitInPlace()(_part_off_the_vectors(other_reader=True))
    relax.analysis.well_formed(after)
    bindings = after["main"].body.blocks[0].bindings
    assert [tensor_shape(b.var)[3] for b in bindings if call_op_name(b.value) == "relax.call_tir"] == [16, 20]
    assert "relax.concat" in [call_op_name(b.value) for b in bindings]


@pytest.mark.parametrize("channels, offset, available, margins", [
    (120, 128, 256, (0, 8)),  # MixNet-S: a part of 120 in a group padded to 128
    (300, 900, 1200, (4, 0)),  # the last part of 1200: the 4 channels before it
    (90, 0, 90, (0, 0)),  # nothing around it to read
    (24, 0, 64, (0, 0)),  # three 8-lane vectors: a third more lanes would cost a core that splits zmm operations
    (48, 16, 64, (0, 0)),  # whole 16-lane vectors already
])
def test_vector_margins(channels, offset, available, margins):
    assert split_reads._vector_margins(channels, offset, available) == margins


@pytest.mark.parametrize("dtype, other_reader", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_built_part_off_the_vectors_matches_the_generic_build(dtype, other_reader):
    """Tolerance: the same products in the same order, so fp32 matches exactly; bf16 rounds the same sums."""
    mod = _part_off_the_vectors(dtype, other_reader)
    data = RNG.standard_normal((1, 8, 8, 36)).astype("float32")
    got = run_executable(build(mod, targets.host_preset()), [data])
    expected = relay_amp.run(mod, [data])
    for built, reference in zip(got, expected):
        np.testing.assert_allclose(built.astype("float32"), reference.astype("float32"), rtol=1e-6, atol=1e-6)


def _concat_of_channel_slices(sliced_axis: int = 3) -> tvm.IRModule:
    """A ghost module's join: the first 24 of x's 32 channels (a kernel's result padded to whole vectors) and a
    relu of them, concatenated along the channels (with `sliced_axis` 1, x's first 8 of 16 rows instead)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 8, 32), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            end = 24 if sliced_axis == 3 else 8
            part = bb.emit(relax.op.strided_slice(x, axes=[sliced_axis], begin=[0], end=[end]))
            out = bb.emit_output(bb.emit(relax.op.concat([part, bb.emit(relax.op.nn.relu(part))], axis=3)))
        bb.emit_func_output(out)
    return bb.get()


def test_a_concatenation_of_channel_slices_reads_the_sliced_tensors_in_place():
    """A slice left to fusion would join the function producing the tensor (a depthwise conv's), which then stored
    24 of its 32 channels lane by lane: the concatenation reads x's channels 0-24 itself."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 8, 32), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            part = bb.emit(relax.op.strided_slice(x, axes=[3], begin=[0], end=[24]))
            relu = bb.emit(relax.op.nn.relu(part))
            out = bb.emit_output(bb.emit(bb.call_te(split_reads._concat_of_parts, [x, relu], [(0, 24), (0, 24)],
                                                    primfunc_name_hint="concatenate")))
        bb.emit_func_output(out)
    after = assert_transforms(DepthwiseReadsSplitInPlace(), _concat_of_channel_slices(), bb.get())
    data = RNG.standard_normal((1, 16, 8, 32)).astype("float32")
    expected = relay_amp.run(_concat_of_channel_slices(), [data])[0]
    np.testing.assert_array_equal(relay_amp.run(after, [data])[0], expected)


def test_a_concatenation_of_row_slices_is_left_to_fusion():
    before = _concat_of_channel_slices(sliced_axis=1)
    tvm.ir.assert_structural_equal(DepthwiseReadsSplitInPlace()(before), before)


def test_ghostnetv2s_convs_store_whole_vectors_for_its_concatenations(tmp_path):
    """timm's GhostNetV2 in bf16 (a model this was not written on: GhostNet's ghost modules were): the functions
    left that compute a conv and slice its channels are the DFC attention's gates, sliced for their resize (16
    were, 12 of them ghost modules' convs sliced for a concatenation)."""
    pytest.importorskip("timm")
    _, imported, _, _ = timm_through_onnx("ghostnetv2_100", tmp_path)
    prepared = prepared_module(relay_amp.to_mixed_precision(imported, "bfloat16"))
    names = [gv.name_hint for gv in prepared.get_global_vars()]
    sliced = [name for name in names if "conv2d" in name and "strided_slice" in name]
    assert len(sliced) == 4 and all("sigmoid" in name for name in sliced), sliced


def test_inception_next_int8q_convolves_its_split_parts_in_place(tmp_path):
    """timm's InceptionNeXt-Atto quantized: its token mixer splits the block's fp32 input (its identity part is
    quantized with the concatenation) and AMP rounds the other parts to bf16 for their depthwise convs; the convs
    read the split tensor in place, and no function only slices and rounds a part."""
    pytest.importorskip("timm")
    _, imported, image, _ = timm_through_onnx("inception_next_atto", tmp_path)
    names = [gv.name_hint for gv in prepared_module(variant(imported, "int8q", [image])).get_global_vars()]
    assert sum("depthwise_conv2d_at" in name for name in names) == 12, names
    ops = {name: [token.rstrip("0123456789") for token in name.split("_")] for name in names}
    assert not [name for name, tokens in ops.items() if set(tokens) == {"fused", "strided", "slice", "cast"}], names
