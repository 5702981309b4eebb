"""LayoutConfig + ConvertLayout: convert conv layouts except the layers the scope skips."""

import numpy as np
import pytest
import tvm
from tvm import relax, topi
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import models
from relay_amp.passes import blocks
from relay_amp.passes.layout import (ClampsAsMaxMin, ConstantsAtFullRank, ConvertLayout, LayoutConfig,
                                      conv_layout_passes, convert_layout)
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms


@I.ir_module
class ThreeConvs:
    @R.function
    def main(x: R.Tensor((16, 16, 8, 8), "float32"), w0: R.Tensor((16, 16, 3, 3), "float32"),
             w1: R.Tensor((16, 16, 3, 3), "float32"), w2: R.Tensor((16, 16, 3, 3), "float32")
             ) -> R.Tensor((16, 16, 8, 8), "float32"):
        with R.dataflow():
            c0 = R.nn.conv2d(x, w0, padding=1)
            r0 = R.nn.relu(c0)
            c1 = R.nn.conv2d(r0, w1, padding=1)
            r1 = R.nn.relu(c1)
            gv = R.nn.conv2d(r1, w2, padding=1)
            R.output(gv)
        return gv


def test_skip_first_layer_converts_the_rest_to_hwnc_with_transforms_at_the_boundaries():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((16, 16, 8, 8), "float32"), w0: R.Tensor((16, 16, 3, 3), "float32"),
                 w1: R.Tensor((16, 16, 3, 3), "float32"), w2: R.Tensor((16, 16, 3, 3), "float32")
                 ) -> R.Tensor((16, 16, 8, 8), "float32"):
            with R.dataflow():
                c0 = R.nn.conv2d(x, w0, padding=1)
                r0 = R.nn.relu(c0)
                r0_hwnc = R.permute_dims(r0, axes=[2, 3, 0, 1])
                w1_hwoi = R.permute_dims(w1, axes=[2, 3, 0, 1])
                c1 = R.nn.conv2d(r0_hwnc, w1_hwoi, padding=1, data_layout="HWNC", kernel_layout="HWOI",
                                 out_layout="HWNC")
                r1 = R.nn.relu(c1)
                w2_hwoi = R.permute_dims(w2, axes=[2, 3, 0, 1])
                c2 = R.nn.conv2d(r1, w2_hwoi, padding=1, data_layout="HWNC", kernel_layout="HWOI",
                                 out_layout="HWNC")
                gv = R.permute_dims(c2, axes=[2, 3, 0, 1])
                R.output(gv)
            return gv

    with LayoutConfig(skip_layers=[0]):
        assert_transforms(ConvertLayout({"nn.conv2d": ["HWNC", "default"]}), ThreeConvs, Expected)


def layouts_of(mod: tvm.IRModule) -> list[str]:
    return [call_layout(mod, layer.name) for layer in relay_amp.list_layers(mod, ["nn.conv2d"])]


def call_layout(mod: tvm.IRModule, name: str) -> str:
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            if binding.var.name == name:
                return f"{binding.value.attrs.data_layout}/{binding.value.attrs.kernel_layout}"
    raise AssertionError(name)


def test_nested_scopes_innermost_wins_and_outside_converts_everything():
    nhwc = ConvertLayout({"nn.conv2d": ["NHWC", "default"]})
    with LayoutConfig(skip_layers=[0]):
        with LayoutConfig(skip_layers=[-1]):
            inner = nhwc(ThreeConvs)
        outer = nhwc(ThreeConvs)
    everything = nhwc(ThreeConvs)
    assert layouts_of(inner) == ["NHWC/OHWI", "NHWC/OHWI", "NCHW/OIHW"]
    assert layouts_of(outer) == ["NCHW/OIHW", "NHWC/OHWI", "NHWC/OHWI"]
    assert layouts_of(everything) == ["NHWC/OHWI"] * 3
    assert LayoutConfig.current() is None


@pytest.mark.parametrize("layout", ["HWNC", "NHWC"])
def test_converted_resnet_matches_fp32(layout):
    mod = models.resnet18(batch=16, image_size=32, classes=10)
    with LayoutConfig(skip_layers=[0]):
        converted = ConvertLayout({"relax.nn.conv2d": [layout, "default"]})(mod)
    inputs = models.example_inputs(mod)
    expected = relay_amp.run(mod, inputs)[0]
    # a different loop order sums in another order: fp32 rounding only
    np.testing.assert_allclose(relay_amp.run(converted, inputs)[0], expected, rtol=1e-4,
                               atol=1e-4 * np.abs(expected).max())


def test_layout_errors_name_the_problem():
    with pytest.raises(relay_amp.OptionError, match="NCHW16c"):
        ConvertLayout({"nn.conv2d": ["NCHW16c", "default"]})
    with pytest.raises(relay_amp.UnknownOpError, match="conv9d"):
        ConvertLayout({"nn.conv9d": ["NHWC", "default"]})
    with LayoutConfig(skip_layers=[3]), pytest.raises(relay_amp.LayerIndexError, match="valid: -3..2"):
        ConvertLayout({"nn.conv2d": ["NHWC", "default"]})(ThreeConvs)


def test_functional_form_honours_the_scope():
    with LayoutConfig(skip_layers=[1]):
        via_function = convert_layout(ThreeConvs, {"nn.conv2d": ["NHWC", "default"]})
        via_pass = ConvertLayout({"nn.conv2d": ["NHWC", "default"]})(ThreeConvs)
    tvm.ir.assert_structural_equal(via_function, via_pass)
    assert layouts_of(via_function) == ["NHWC/OHWI", "NCHW/OIHW", "NHWC/OHWI"]


def test_clips_become_maximum_and_minimum_by_constants():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8), "float32"):
            with R.dataflow():
                r6 = R.clip(x, 0.0, 6.0)
                gv = R.clip(r6, float("-inf"), 1.0)  # no lower bound: minimum only
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8), "float32"):
            with R.dataflow():
                low = R.maximum(x, R.const(0.0, "float32"))
                r6 = R.minimum(low, R.const(6.0, "float32"))
                gv = R.minimum(r6, R.const(1.0, "float32"))
                R.output(gv)
            return gv

    assert_transforms(ClampsAsMaxMin(), Before, Expected)


def test_a_te_scalar_clamp_becomes_maximum_and_its_function_goes():
    """A call of a TE function max(x, bound[()]), as TVM's ONNX importer writes Clip."""
    x = relax.Var("x", relax.TensorType((2, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit_te(topi.maximum, x, relax.const(np.array(0.5, "float32"))))
        bb.emit_func_output(out)
    after = ClampsAsMaxMin()(bb.get())
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [call.op.name for call in calls] == ["relax.maximum"]
    assert [gv.name_hint for gv in after.get_global_vars()] == ["main"]
    data = np.linspace(-1, 1, 16, dtype="float32").reshape(2, 8)
    np.testing.assert_array_equal(relay_amp.run(after, [data])[0], np.maximum(data, 0.5))


def _scaled(scale: relax.Expr, full_rank: bool) -> tvm.IRModule:
    """main(x) = x * scale, with `scale` reshaped to x's rank first where `full_rank`."""
    x = relax.Var("x", relax.TensorType((1, 4, 2, 2), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            operand = bb.emit(relax.op.reshape(scale, (1, 4, 1, 1))) if full_rank else scale
            out = bb.emit_output(relax.op.multiply(x, operand))
        bb.emit_func_output(out)
    return bb.get()


def test_a_lower_rank_constant_operand_gets_the_other_operands_rank():
    scale = relax.const(np.arange(4, dtype="float32").reshape(4, 1, 1))
    assert_transforms(ConstantsAtFullRank(), _scaled(scale, False), _scaled(scale, True))
    scalar = _scaled(relax.const(2.0, "float32"), False)
    tvm.ir.assert_structural_equal(ConstantsAtFullRank()(scalar), scalar)


def test_an_exporters_per_channel_scale_between_convs_carries_the_layout():
    """conv, x * scale[C, 1, 1], conv in NHWC: transposes only at the graph's edges (the constants' fold)."""
    scale = relax.const(np.linspace(0.5, 2, 8, dtype="float32").reshape(8, 1, 1))
    weights = [relax.const(np.random.default_rng(i).standard_normal(shape).astype("float32"))
               for i, shape in enumerate([(8, 4, 3, 3), (8, 8, 1, 1)])]
    x = relax.Var("x", relax.TensorType((1, 4, 6, 6), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            first = bb.emit(relax.op.nn.conv2d(x, weights[0], padding=1))
            scaled = bb.emit(relax.op.multiply(first, scale))
            out = bb.emit_output(relax.op.nn.conv2d(scaled, weights[1]))
        bb.emit_func_output(out)
    mod = bb.get()
    converted = tvm.transform.Sequential([*conv_layout_passes("NHWC"), relax.transform.FoldConstant()])(mod)
    moves = [b.value for b in converted["main"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.permute_dims"]
    assert len(moves) == 2 and moves[0].args[0].same_as(converted["main"].params[0])
    data = np.random.default_rng(9).standard_normal((1, 4, 6, 6)).astype("float32")
    np.testing.assert_allclose(relay_amp.run(converted, [data])[0], relay_amp.run(mod, [data])[0], rtol=1e-5, atol=1e-4)


def test_conv1ds_take_the_conv2d_layout_without_its_height():
    """NHWC for conv2d is NWC for conv1d: a stack of conv1ds transposes only at the graph's edges."""
    rng = np.random.default_rng(0)
    weights = [relax.const(rng.standard_normal(shape).astype("float32")) for shape in [(8, 2, 3), (4, 8, 3)]]
    x = relax.Var("x", relax.TensorType((1, 2, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            first = bb.emit(relax.op.nn.relu(bb.emit(relax.op.nn.conv1d(x, weights[0], padding=1))))
            out = bb.emit_output(relax.op.nn.conv1d(first, weights[1]))
        bb.emit_func_output(out)
    mod = bb.get()
    converted = tvm.transform.Sequential([*conv_layout_passes(["NHWC", "HWIO"]), relax.transform.FoldConstant()])(mod)
    calls = [b.value for b in converted["main"].body.blocks[0].bindings]
    assert [(c.attrs.data_layout, c.attrs.kernel_layout) for c in calls if c.op.name == "relax.nn.conv1d"] == [
        ("NWC", "WIO"), ("NWC", "WIO")]
    assert sum(c.op.name == "relax.permute_dims" for c in calls) == 2
    data = rng.standard_normal((1, 2, 16)).astype("float32")
    np.testing.assert_allclose(relay_amp.run(converted, [data])[0], relay_amp.run(mod, [data])[0], rtol=1e-5, atol=1e-4)
    with LayoutConfig(skip_layers=[1]):
        kept = tvm.transform.Sequential(conv_layout_passes(["NHWC", "HWIO"]))(mod)
    assert [c.attrs.data_layout for b in kept["main"].body.blocks[0].bindings
            if (c := b.value).op.name == "relax.nn.conv1d"] == ["NWC", "NCW"]


def test_a_te_pad_from_tvms_own_importer_gets_no_transposes_in_an_nhwc_build():
    """A module imported without relay_amp's frontend keeps ONNX Pad as a TE call: the layout passes lift it to
    relax.nn.pad and sink the transposes around it, so conv, pad, ReLU, conv transposes only at the edges."""
    rng = np.random.default_rng(0)
    weights = [relax.const(rng.standard_normal(shape).astype("float32")) for shape in [(8, 4, 3, 3), (4, 8, 3, 3)]]
    x = relax.Var("x", relax.TensorType((1, 4, 6, 6), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            first = bb.emit(relax.op.nn.conv2d(x, weights[0]))
            padded = bb.emit_te(topi.nn.pad, first, [0, 0, 1, 1], [0, 0, 1, 1], 0.0)
            out = bb.emit_output(relax.op.nn.conv2d(bb.emit(relax.op.nn.relu(padded)), weights[1]))
        bb.emit_func_output(out)
    mod = bb.get()
    converted = tvm.transform.Sequential(conv_layout_passes(["NHWC", "HWIO"]))(mod)
    ops = [b.value.op.name for b in converted["main"].body.blocks[0].bindings]
    assert ops.count("relax.permute_dims") == 2 and "relax.nn.pad" in ops and "relax.call_tir" not in ops
    data = rng.standard_normal((1, 4, 6, 6)).astype("float32")
    np.testing.assert_allclose(relay_amp.run(converted, [data])[0], relay_amp.run(mod, [data])[0], rtol=1e-5, atol=1e-4)


def test_negative_squeeze_and_permutation_axes_are_counted_from_the_front_first():
    """TVM's ConvertLayout fails on a squeeze with a negative axis (std::bad_alloc) and a permute_dims with
    negative axes ("Invalid layout"): DeBERTa-v2 through torch.export did not build."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 1, 4), "float32")) -> R.Tensor((1, 4, 2), "float32"):
            with R.dataflow():
                squeezed = R.squeeze(x, axis=[-2])
                gv = R.permute_dims(squeezed, axes=[0, -1, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 1, 4), "float32")) -> R.Tensor((1, 4, 2), "float32"):
            with R.dataflow():
                squeezed = R.squeeze(x, axis=[2])
                gv = R.permute_dims(squeezed, axes=[0, 2, 1])
                R.output(gv)
            return gv

    assert_transforms(ConvertLayout({"nn.conv2d": ["NHWC", "default"]}), Before, Expected)


def test_a_module_without_convolutions_skips_tvms_pass(monkeypatch):
    """TVM's ConvertLayout copies its map of every binding's layout at each call it infers a layout for: 15-22 s for a
    2-layer LSTM unrolled over 300 steps (10812 bindings), which has no op to convert. Without one, the module
    comes back as it was (TVM's pass is not run); with one, it runs."""

    @I.ir_module
    class Recurrent:
        @R.function
        def main(x: R.Tensor((2, 8), "float32"), w: R.Tensor((8, 8), "float32")) -> R.Tensor((2, 8), "float32"):
            with R.dataflow():
                step = R.tanh(R.matmul(x, w))
                gv = R.nn.softmax(R.tanh(R.matmul(step, w)), axis=-1)
                R.output(gv)
            return gv

    ran = []
    tvms_pass = relax.transform.ConvertLayout
    monkeypatch.setattr(relax.transform, "ConvertLayout", lambda *args: ran.append(args) or tvms_pass(*args))
    assert_transforms(ConvertLayout({"nn.conv2d": ["NHWC", "default"]}), Recurrent, Recurrent)
    assert ran == []
    ConvertLayout({"nn.conv2d": ["NHWC", "default"]})(models.get_model("small_cnn"))
    assert len(ran) == 1


def test_a_stack_is_a_concatenation_of_tensors_given_the_new_axis():
    """relax.stack has no layout rule: ConvertLayout failed on it ("Invalid SLayout"), so a model with a
    torch.stack did not build on the CPU."""

    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((2, 3), "float32")) -> R.Tensor((2, 3, 2), "float32"):
            with R.dataflow():
                gv = R.stack((a, b), axis=-1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((2, 3), "float32")) -> R.Tensor((2, 3, 2), "float32"):
            with R.dataflow():
                first = R.expand_dims(a, axis=[2])
                second = R.expand_dims(b, axis=[2])
                gv = R.concat((first, second), axis=2)
                R.output(gv)
            return gv

    assert_transforms(ConvertLayout({"nn.conv2d": ["NHWC", "default"]}), Before, Expected)
    inputs = [np.arange(6, dtype="float32").reshape(2, 3), -np.arange(6, dtype="float32").reshape(2, 3)]
    executable = relay_amp.build(Before, "cpu")
    np.testing.assert_array_equal(run_executable(executable, inputs)[0], np.stack(inputs, axis=-1))


def test_a_negative_axis_squeeze_of_a_converted_conv_matches_the_unconverted_module():
    @I.ir_module
    class ConvSqueeze:
        @R.function
        def main(x: R.Tensor((2, 3, 4, 4), "float32"), w: R.Tensor((4, 3, 4, 1), "float32")
                 ) -> R.Tensor((2, 4, 4), "float32"):
            with R.dataflow():
                conv = R.nn.conv2d(x, w)  # (2, 4, 1, 4)
                squeezed = R.squeeze(conv, axis=[-2])
                gv = R.permute_dims(squeezed, axes=[0, -1, -2])
                R.output(gv)
            return gv

    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((2, 3, 4, 4)).astype("float32"), rng.standard_normal((4, 3, 4, 1)).astype("float32")]
    converted = convert_layout(ConvSqueeze, {"nn.conv2d": ["NHWC", "default"]})
    assert layouts_of(converted) == ["NHWC/OHWI"]
    np.testing.assert_allclose(relay_amp.run(converted, inputs)[0], relay_amp.run(ConvSqueeze, inputs)[0], rtol=1e-5)


@pytest.mark.parametrize("transposed", [
    lambda x: relax.op.nn.conv2d_transpose(x, relax.const(np.ones((8, 4, 3, 3), "float32")), strides=2, groups=2),
    lambda x: relax.op.nn.conv2d_transpose(x, relax.const(np.ones((8, 4, 3, 3), "float32")), dilation=2),
])
def test_a_transposed_conv_after_a_converted_conv_stays_in_the_layout_tvm_lowers(transposed):
    """ConvertLayout carried the conv's NHWC into the transposed conv after it, which TVM lowers only in NCHW: the
    default build failed (a grouped or dilated one, which TransposedConvsAsConvs leaves to TVM)."""
    rng = np.random.default_rng(0)
    weight = relax.const(rng.standard_normal((8, 4, 3, 3)).astype("float32"))
    x = relax.Var("x", relax.TensorType((1, 4, 6, 6), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(transposed(bb.emit(relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(x, weight))))))
        bb.emit_func_output(out)
    mod = bb.get()
    converted = tvm.transform.Sequential(conv_layout_passes(["NHWC", "HWIO"]))(mod)
    layouts = [(c.op.name, str(c.attrs.data_layout)) for b in converted["main"].body.blocks[0].bindings
               if (c := b.value).op.name.startswith("relax.nn.conv")]
    assert layouts == [("relax.nn.conv2d", "NHWC"), ("relax.nn.conv2d_transpose", "NCHW")]
    data = [rng.standard_normal((1, 4, 6, 6)).astype("float32")]
    got = run_executable(relay_amp.build(mod), data)[0]
    np.testing.assert_allclose(got, relay_amp.run(mod, data)[0], rtol=1e-5, atol=1e-4)


def test_long_blocks_go_to_tvms_pass_in_pieces_and_the_layout_passes_give_the_graph_of_the_whole(monkeypatch):
    """TVM's ConvertLayout takes time quadratic in a dataflow block's length (Sequencer2D-S's 27835 bindings: 103
    s), so blocks past BLOCK_LIMIT go to it in pieces; the values crossing a cut pass it in the model's layout, and
    the transposes that adds cancel in the layout passes after it."""
    whole = tvm.transform.Sequential(conv_layout_passes("NHWC"))(ThreeConvs)
    seen = []
    tvms_pass = relax.transform.ConvertLayout

    def recording(*args):
        return tvm.transform.Sequential([tvm.transform.module_pass(
            lambda mod, ctx: seen.extend(len(block.bindings) for block in mod["main"].body.blocks) or mod,
            opt_level=0, name="record"), tvms_pass(*args)])

    monkeypatch.setattr(relax.transform, "ConvertLayout", recording)
    monkeypatch.setattr(blocks, "BLOCK_LIMIT", 4)
    in_pieces = tvm.transform.Sequential(conv_layout_passes("NHWC"))(ThreeConvs)
    assert seen == [5, 1]  # c0 r0 c1 r1 and r1's hand-over; then the last conv
    relax.analysis.well_formed(in_pieces)
    tvm.ir.assert_structural_equal(in_pieces, whole)


@pytest.mark.parametrize("skipped", [[], [0, 7]])
def test_a_resnet_converted_in_pieces_matches_fp32_and_keeps_the_skipped_layers(monkeypatch, skipped):
    monkeypatch.setattr(blocks, "BLOCK_LIMIT", 8)
    mod = models.resnet18(batch=2, image_size=32, classes=10)
    with LayoutConfig(skip_layers=skipped):
        converted = ConvertLayout({"relax.nn.conv2d": ["NHWC", "default"]})(mod)
    relax.analysis.well_formed(converted)
    assert len(converted["main"].body.blocks) == len(mod["main"].body.blocks)  # the pieces joined again
    convs = [binding.value for block in converted["main"].body.blocks for binding in block.bindings
             if isinstance(binding.value, relax.Call) and binding.value.op.name == "relax.nn.conv2d"]
    assert [index for index, conv in enumerate(convs) if conv.attrs.data_layout == "NCHW"] == skipped
    inputs = models.example_inputs(mod)
    expected = relay_amp.run(mod, inputs)[0]
    np.testing.assert_allclose(relay_amp.run(converted, inputs)[0], expected, rtol=1e-4,
                               atol=1e-4 * np.abs(expected).max())  # fp32 sums in another order
