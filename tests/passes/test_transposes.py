"""SinkTransposes, and ONNX's constant Pad as relax.nn.pad: transposes move past the ops without a layout rule
until they cancel."""

import numpy as np
import tvm
from tvm import relax, topi
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp._pads import constant_pad, pads_as_ops
from relay_amp.ops import call_op_name
from relay_amp.passes.transposes import SinkTransposes

from pass_checks import assert_transforms


def test_a_transpose_moves_past_pad_norm_activation_and_pool_and_cancels_the_next_one():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 4, 8), "float32"), gamma: R.Tensor((8,), "float32"),
                 beta: R.Tensor((8,), "float32")) -> R.Tensor((1, 2, 2, 8), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                padded = R.nn.pad(nchw, pad_width=[0, 0, 0, 0, 1, 1, 1, 1], pad_value=0.0)
                norm = R.nn.group_norm(padded, gamma, beta, num_groups=2, channel_axis=1, axes=[2, 3])
                shifted = R.add(norm, R.const(0.5, "float32"))
                active = R.nn.relu(shifted)
                pooled = R.nn.max_pool2d(active, pool_size=[3, 3], strides=[2, 2], layout="NCHW")
                gv = R.permute_dims(pooled, axes=[0, 2, 3, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 4, 8), "float32"), gamma: R.Tensor((8,), "float32"),
                 beta: R.Tensor((8,), "float32")) -> R.Tensor((1, 2, 2, 8), "float32"):
            with R.dataflow():
                padded = R.nn.pad(x, pad_width=[0, 0, 1, 1, 1, 1, 0, 0], pad_value=0.0)
                norm = R.nn.group_norm(padded, gamma, beta, num_groups=2, channel_axis=3, axes=[1, 2])
                shifted = R.add(norm, R.const(0.5, "float32"))
                active = R.nn.relu(shifted)
                pooled = R.nn.max_pool2d(active, pool_size=[3, 3], strides=[2, 2], layout="NHWC", out_layout="NHWC")
                gv = pooled
                R.output(gv)
            return gv

    after = assert_transforms(SinkTransposes(), Before, Expected)
    data = np.random.default_rng(0).standard_normal((1, 4, 4, 8)).astype("float32")
    gamma, beta = np.linspace(0.5, 1.5, 8, dtype="float32"), np.linspace(-1, 1, 8, dtype="float32")
    np.testing.assert_allclose(relay_amp.run(after, [data, gamma, beta])[0],
                               relay_amp.run(Before, [data, gamma, beta])[0], rtol=1e-5, atol=1e-5)


def test_transposes_move_past_the_activations_convertlayout_has_no_rule_for():
    """leakyrelu and softplus have no layout rule in Relax: ConvertLayout transposes back to NCHW around each (all
    of CSPNet's and DarkNet's activations); the transposes move past them and cancel."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 4, 8), "float32")) -> R.Tensor((1, 4, 4, 8), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                leaky = R.nn.leakyrelu(nchw, alpha=0.1)
                smooth = R.nn.softplus(leaky, beta=1.0, threshold=20.0)
                logged = R.log(smooth)
                gv = R.permute_dims(logged, axes=[0, 2, 3, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 4, 8), "float32")) -> R.Tensor((1, 4, 4, 8), "float32"):
            with R.dataflow():
                leaky = R.nn.leakyrelu(x, alpha=0.1)
                smooth = R.nn.softplus(leaky, beta=1.0, threshold=20.0)
                logged = R.log(smooth)
                gv = logged
                R.output(gv)
            return gv

    after = assert_transforms(SinkTransposes(), Before, Expected)
    data = np.random.default_rng(0).standard_normal((1, 4, 4, 8)).astype("float32")
    np.testing.assert_allclose(relay_amp.run(after, [data])[0], relay_amp.run(Before, [data])[0], rtol=1e-6)


def test_transposes_move_past_comparisons_and_where_as_torch_export_spells_prelu():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 6, 4), "float32")) -> R.Tensor((1, 6, 4), "float32"):
            with R.dataflow():
                ncw = R.permute_dims(x, axes=[0, 2, 1])
                positive = R.greater(ncw, R.const(0.0, "float32"))
                ncw_scaled = R.permute_dims(R.multiply(x, R.const(0.25, "float32")), axes=[0, 2, 1])
                ncw_again = R.permute_dims(x, axes=[0, 2, 1])
                prelu = R.where(positive, ncw_again, ncw_scaled)
                gv = R.permute_dims(prelu, axes=[0, 2, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 6, 4), "float32")) -> R.Tensor((1, 6, 4), "float32"):
            with R.dataflow():
                positive = R.greater(x, R.const(0.0, "float32"))
                scaled = R.multiply(x, R.const(0.25, "float32"))
                prelu = R.where(positive, x, scaled)
                gv = prelu
                R.output(gv)
            return gv

    after = assert_transforms(SinkTransposes(), Before, Expected)
    data = np.random.default_rng(0).standard_normal((1, 6, 4)).astype("float32")
    np.testing.assert_array_equal(relay_amp.run(after, [data])[0], relay_amp.run(Before, [data])[0])


def test_a_constant_operand_is_transposed_back_and_a_tensor_operand_stops_the_transpose():
    scale = np.arange(8, dtype="float32").reshape(1, 8, 1, 1)

    def module(sunk: bool) -> tvm.IRModule:
        x = relax.Var("x", relax.TensorType((1, 2, 2, 8), "float32"))
        y = relax.Var("y", relax.TensorType((1, 8, 2, 2), "float32"))
        bb = relax.BlockBuilder()
        with bb.function("main", [x, y]):
            with bb.dataflow():
                if sunk:
                    back = bb.emit(relax.op.permute_dims(relax.const(scale), [0, 2, 3, 1]))
                    scaled = bb.emit(relax.op.permute_dims(bb.emit(relax.op.multiply(x, back)), [0, 3, 1, 2]))
                else:
                    scaled = bb.emit(relax.op.multiply(bb.emit(relax.op.permute_dims(x, [0, 3, 1, 2])),
                                                       relax.const(scale)))
                out = bb.emit_output(relax.op.add(scaled, y))  # y is in the transposed layout: stays
            bb.emit_func_output(out)
        return bb.get()

    after = SinkTransposes()(module(False))
    relax.analysis.well_formed(after)
    calls = [b.value.op.name for b in after["main"].body.blocks[0].bindings]
    assert calls == ["relax.permute_dims", "relax.multiply", "relax.permute_dims", "relax.add"]
    tvm.ir.assert_structural_equal(after, module(True))


def test_a_graph_outputs_transpose_stays_inside_its_dataflow_block():
    """A transpose the block hands out, then cast outside it (AMP's output cast): nothing moves out of the block."""
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((1, 2, 2, 8), "bfloat16")) -> R.Tensor((1, 8, 2, 2), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                R.output(nchw)
            gv = R.astype(nchw, "float32")
            return gv

    tvm.ir.assert_structural_equal(SinkTransposes()(Module), Module)


def _te_pad_module(value: float = -1.0) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType((1, 3, 4, 5), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit_te(topi.nn.pad, x, [0, 0, 1, 2], [0, 0, 3, 0], value))
        bb.emit_func_output(out)
    return bb.get()


def test_an_imported_te_pad_becomes_relax_pad_and_its_function_goes():
    """TVM's ONNX importer writes Pad as a call of topi.nn.pad's TE function."""
    mod = _te_pad_module()
    after = pads_as_ops(mod)
    relax.analysis.well_formed(after)
    pad = after["main"].body.blocks[0].bindings[0].value
    assert pad.op.name == "relax.nn.pad" and float(pad.attrs.pad_value) == -1.0
    assert [int(w) for w in pad.attrs.pad_width] == [0, 0, 0, 0, 1, 3, 2, 0]
    assert [gv.name_hint for gv in after.get_global_vars()] == ["main"]
    data = np.random.default_rng(1).standard_normal((1, 3, 4, 5)).astype("float32")
    np.testing.assert_array_equal(relay_amp.run(after, [data])[0], relay_amp.run(mod, [data])[0])


def test_other_te_functions_are_no_pads():
    x = relax.Var("x", relax.TensorType((2, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit_te(topi.nn.mirror_pad, x, [0, 1], [0, 1], "REFLECT"))
        bb.emit_func_output(out)
    mod = bb.get()
    functions = [f for gv, f in mod.functions_items() if gv.name_hint != "main"]
    assert [constant_pad(f) for f in functions] == [None]
    tvm.ir.assert_structural_equal(pads_as_ops(mod), mod)


def test_a_transpose_read_twice_stays_so_the_tensor_is_not_transposed_twice():
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((1, 2, 2, 8), "float32")) -> R.Tuple(R.Tensor((1, 8, 2, 2), "float32"),
                                                                   R.Tensor((1, 8, 4), "float32")):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                active = R.nn.relu(nchw)
                flat = R.reshape(nchw, (1, 8, 4))  # no rule moves a transpose past a reshape
                gv = (active, flat)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(SinkTransposes()(Module), Module)


def test_transposes_that_permute_nothing_or_only_axes_of_one_become_views():
    """ConvertLayout leaves permute_dims(x, [0, 1, 2, 3]) where an exporter's transpose to NCHW meets its own back to
    NHWC (tf2onnx's Keras exports); a squeeze-excite's [1, C, 1, 1] to [1, 1, 1, C] moves only axes of one. Both
    copied their tensor; now the first is its input and the second a reshape. A transpose of a real axis stays."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 4, 8), "float32"), s: R.Tensor((1, 8, 1, 1), "float32"),
                 t: R.Tensor((1, 8, 4), "float32")) -> R.Tuple(R.Tensor((1, 4, 4, 8), "float32"),
                                                              R.Tensor((1, 4, 8), "float32")):
            with R.dataflow():
                same = R.permute_dims(x, axes=[0, 1, 2, 3])
                squeezed = R.permute_dims(s, axes=[0, 2, 3, 1])
                scaled = R.multiply(same, squeezed)
                moved = R.permute_dims(t, axes=[0, 2, 1])
                gv = (scaled, moved)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 4, 8), "float32"), s: R.Tensor((1, 8, 1, 1), "float32"),
                 t: R.Tensor((1, 8, 4), "float32")) -> R.Tuple(R.Tensor((1, 4, 4, 8), "float32"),
                                                              R.Tensor((1, 4, 8), "float32")):
            with R.dataflow():
                same = x
                squeezed = R.reshape(s, R.shape([1, 1, 1, 8]))
                scaled = R.multiply(same, squeezed)
                moved = R.permute_dims(t, axes=[0, 2, 1])
                gv = (scaled, moved)
                R.output(gv)
            return gv

    _assert_computes_the_same(assert_transforms(SinkTransposes(), Before, Expected), Before,
                              (1, 4, 4, 8), (1, 8, 1, 1), (1, 8, 4))


def test_transposes_move_past_a_strided_slice_and_a_concat_of_transposed_tensors():
    """As tf2onnx writes NASNet's cropping and its cells' joins: NCHW slices and concats between NHWC convs. A
    concat with an operand that is not transposed the same way stays."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 5, 5, 8), "float32"), y: R.Tensor((1, 4, 4, 8), "float32"),
                 z: R.Tensor((1, 8, 4, 4), "float32")) -> R.Tuple(R.Tensor((1, 4, 4, 16), "float32"),
                                                                 R.Tensor((1, 16, 4, 4), "float32")):
            with R.dataflow():
                x_nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                cropped = R.strided_slice(x_nchw, axes=[2, 3], begin=[1, 1], end=[5, 5])
                y_nchw = R.permute_dims(y, axes=[0, 3, 1, 2])
                joined = R.concat((cropped, y_nchw), axis=1)
                nhwc = R.permute_dims(joined, axes=[0, 2, 3, 1])
                y_again = R.permute_dims(y, axes=[0, 3, 1, 2])
                mixed = R.concat((y_again, z), axis=1)
                gv = (nhwc, mixed)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 5, 5, 8), "float32"), y: R.Tensor((1, 4, 4, 8), "float32"),
                 z: R.Tensor((1, 8, 4, 4), "float32")) -> R.Tuple(R.Tensor((1, 4, 4, 16), "float32"),
                                                                 R.Tensor((1, 16, 4, 4), "float32")):
            with R.dataflow():
                cropped = R.strided_slice(x, axes=[1, 2], begin=[1, 1], end=[5, 5])
                joined = R.concat((cropped, y), axis=3)
                nhwc = joined
                y_again = R.permute_dims(y, axes=[0, 3, 1, 2])
                mixed = R.concat((y_again, z), axis=1)
                gv = (nhwc, mixed)
                R.output(gv)
            return gv

    _assert_computes_the_same(assert_transforms(SinkTransposes(), Before, Expected), Before,
                              (1, 5, 5, 8), (1, 4, 4, 8), (1, 8, 4, 4))


def _assert_computes_the_same(after: tvm.IRModule, before: tvm.IRModule, *shapes: tuple) -> None:
    """`after` gives exactly `before`'s outputs on random fp32 inputs of `shapes` (the moves only rename axes)."""
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(shape).astype("float32") for shape in shapes]
    for got, expected in zip(relay_amp.run(after, inputs), relay_amp.run(before, inputs)):
        np.testing.assert_array_equal(got, expected)


def test_tokens_made_an_image_and_back_through_two_transposes_become_reshapes():
    """A hierarchical ViT turns its tokens into an image for a conv (PVT: [1, N, C] transposed, split to
    [1, C, H, W]) and ConvertLayout transposes that to NHWC; back to tokens, the NHWC result goes to NCHW, is
    flattened and transposed. Each transpose, reshape, transpose keeps the elements in their order: a reshape now,
    where it was two copies. A chain that moves elements (H and W swapped) stays."""
    @I.ir_module
    class Before:
        @R.function
        def main(t: R.Tensor((1, 16, 8), "float32"), y: R.Tensor((1, 4, 4, 8), "float32")
                 ) -> R.Tuple(R.Tensor((1, 4, 4, 8), "float32"), R.Tensor((1, 16, 8), "float32"),
                              R.Tensor((1, 4, 4, 8), "float32")):
            with R.dataflow():
                channels_first = R.permute_dims(t, axes=[0, 2, 1])
                image = R.reshape(channels_first, R.shape([1, 8, 4, 4]))
                nhwc = R.permute_dims(image, axes=[0, 2, 3, 1])
                nchw = R.permute_dims(y, axes=[0, 3, 1, 2])
                flat = R.reshape(nchw, R.shape([1, 8, 16]))
                tokens = R.permute_dims(flat, axes=[0, 2, 1])
                swapped = R.permute_dims(image, axes=[0, 3, 2, 1])
                gv = (nhwc, tokens, swapped)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(t: R.Tensor((1, 16, 8), "float32"), y: R.Tensor((1, 4, 4, 8), "float32")
                 ) -> R.Tuple(R.Tensor((1, 4, 4, 8), "float32"), R.Tensor((1, 16, 8), "float32"),
                              R.Tensor((1, 4, 4, 8), "float32")):
            with R.dataflow():
                channels_first = R.permute_dims(t, axes=[0, 2, 1])
                image = R.reshape(channels_first, R.shape([1, 8, 4, 4]))
                nhwc = R.reshape(t, R.shape([1, 4, 4, 8]))
                tokens = R.reshape(y, R.shape([1, 16, 8]))
                swapped = R.permute_dims(image, axes=[0, 3, 2, 1])
                gv = (nhwc, tokens, swapped)
                R.output(gv)
            return gv

    _assert_computes_the_same(assert_transforms(SinkTransposes(), Before, Expected), Before, (1, 16, 8), (1, 4, 4, 8))


def _transposes_around_reshapes(mod: tvm.IRModule) -> int:
    """How many transposes of a reshape of a transpose `mod`'s main holds."""
    values = {b.var: b.value for block in mod["main"].body.blocks for b in block.bindings}
    transposes = [v for v in values.values() if call_op_name(v) == "relax.permute_dims"]
    reshapes = [values.get(v.args[0]) for v in transposes if call_op_name(values.get(v.args[0])) == "relax.reshape"]
    return sum(call_op_name(values.get(r.args[0])) == "relax.permute_dims" for r in reshapes)


def test_a_pvt_through_onnx_converts_tokens_and_images_without_copies(tmp_path):
    """timm's PVT-v2-B0 (a model the rule was not written on) turns tokens into images for its spatial-reduction and
    MLP depthwise convs, and back: after the CPU layout passes no transpose of a reshape of a transpose is left
    (ConvertLayout had completed 28 such chains), fewer transposes remain than the import had (30 of 68, where 86
    were), and the build matches PyTorch."""
    from relay_amp.passes.layout import conv_layout_passes
    from relay_amp.runtime import run_executable
    from builders import timm_through_onnx

    _, imported, x, expected = timm_through_onnx("pvt_v2_b0", tmp_path)
    with tvm.transform.PassContext(opt_level=3):
        converted = tvm.transform.Sequential(conv_layout_passes("NHWC"))(imported)
    assert _transposes_around_reshapes(converted) == 0
    assert _count(converted, "relax.permute_dims") < _count(imported, "relax.permute_dims")
    got = run_executable(relay_amp.build(imported, relay_amp.targets.host_preset()), [x])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def _count(mod: tvm.IRModule, op_name: str) -> int:
    """How many calls of `op_name` `mod`'s main binds."""
    return sum(call_op_name(b.value) == op_name for block in mod["main"].body.blocks for b in block.bindings)
