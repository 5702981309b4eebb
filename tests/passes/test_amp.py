"""ToMixedPrecision: structural Before/Expected tests for every category, override and option."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import relay_amp
from relay_amp.passes.amp import default_lists, precision_plan


def convert(before: tvm.IRModule, target_dtype: str = "float16", **options) -> tvm.IRModule:
    """Convert, check well-formedness and that the input was left alone; drop the plan attribute."""
    text = before.script()
    after = relay_amp.to_mixed_precision(before, target_dtype, **options)
    relax.analysis.well_formed(after)
    assert before.script() == text, "to_mixed_precision mutated its input"
    return after.without_attr("relay_amp.precision_plan")


@I.ir_module
class Mixed:
    """matmul (target) -> relu (follow) -> softmax (fp32) -> add (widest)."""

    @R.function
    def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 4), "float32")) -> R.Tensor((2, 4), "float32"):
        with R.dataflow():
            mm = R.matmul(x, w)
            r = R.nn.relu(mm)
            s = R.nn.softmax(r)
            gv = R.add(r, s)
            R.output(gv)
        return gv


def test_categories_target_follow_fp32_widest():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w16 = R.astype(w, "float16")
                mm32 = R.matmul(x16, w16, out_dtype="float32")
                mm16 = R.astype(mm32, "float16")
                r = R.nn.relu(mm16)
                r32 = R.astype(r, "float32")
                s = R.nn.softmax(r32)
                gv = R.add(r32, s)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(convert(Mixed), Expected)


def test_bfloat16_with_low_accumulation_and_overrides():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            with R.dataflow():
                x16 = R.astype(x, "bfloat16")
                w16 = R.astype(w, "bfloat16")
                mm = R.matmul(x16, w16, out_dtype="bfloat16")
                r = R.nn.relu(mm)
                s = R.nn.softmax(r)
                a = R.add(r, s)
                gv = R.astype(a, "float32")
                R.output(gv)
            return gv

    # softmax moved from the fp32 list to the target list for this call only
    after = convert(Mixed, "bfloat16", accumulation_dtype="bfloat16", target_dtype_ops=["matmul", "nn.softmax"])
    tvm.ir.assert_structural_equal(after, Expected)
    assert "relax.nn.softmax" in default_lists("bfloat16").fp32, "an override must not change the defaults"


def test_fp32_ops_override_keeps_matmul_in_fp32():
    after = convert(Mixed, fp32_ops=["matmul", "nn.softmax"])
    tvm.ir.assert_structural_equal(after, Mixed)


def test_excluded_layer_by_index_and_by_name_stays_fp32():
    by_index = convert(Mixed, excluded_layers=[0])
    by_name = convert(Mixed, excluded_layers=["mm"])
    tvm.ir.assert_structural_equal(by_index, Mixed)
    tvm.ir.assert_structural_equal(by_name, Mixed)


def test_conditional_fp32_op_matches_attribute_value():
    @I.ir_module
    class Pools:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "float16")) -> R.Tensor((1, 2, 2, 2), "float16"):
            with R.dataflow():
                a = R.nn.avg_pool2d(x, pool_size=2, strides=2, count_include_pad=True)
                gv = R.nn.avg_pool2d(a, pool_size=1, count_include_pad=False)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "float16")) -> R.Tensor((1, 2, 2, 2), "float16"):
            with R.dataflow():
                a = R.nn.avg_pool2d(x, pool_size=2, strides=2, count_include_pad=True)
                gv = R.nn.avg_pool2d(a, pool_size=1, count_include_pad=False)
                R.output(gv)
            return gv

    after = convert(Pools, conditional_fp32_ops=[("nn.avg_pool2d", "count_include_pad", [True])])
    tvm.ir.assert_structural_equal(after, Expected)
    reasons = [e.reason for e in precision_plan(relay_amp.to_mixed_precision(
        Pools, "float16", conditional_fp32_ops=[("nn.avg_pool2d", "count_include_pad", [True])])).entries]
    assert reasons == ["conditional: count_include_pad in [True]", "follow list"]


def test_keep_io_types_false_lowers_the_signature():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            with R.dataflow():
                mm = R.matmul(x, w)
                gv = R.nn.relu(mm)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 4), "float16"), w: R.Tensor((4, 4), "float16")) -> R.Tensor((2, 4), "float16"):
            with R.dataflow():
                mm32 = R.matmul(x, w, out_dtype="float32")
                mm = R.astype(mm32, "float16")
                gv = R.nn.relu(mm)
                R.output(gv)
            return gv

    @I.ir_module
    class KeptIO:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w16 = R.astype(w, "float16")
                mm32 = R.matmul(x16, w16, out_dtype="float32")
                mm = R.astype(mm32, "float16")
                r = R.nn.relu(mm)
                gv = R.astype(r, "float32")
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(convert(Before, keep_io_types=False), Expected)
    tvm.ir.assert_structural_equal(convert(Before, keep_io_types=True), KeptIO)


def test_keep_io_types_false_lowers_every_output_of_a_returned_tuple_var():
    """A decoder returns a var bound to a tuple (logits, present keys): each float field is lowered, so the present
    cache comes back in the dtype its past goes in (fed back step after step)."""
    @I.ir_module
    class Decoder:
        @R.function
        def main(x: R.Tensor((1, 4), "float32"), past: R.Tensor((3, 4), "float32"), w: R.Tensor((4, 4), "float32")):
            with R.dataflow():
                logits = R.matmul(x, w)
                present = R.concat((past, x), axis=0)
                gv = (logits, present)
                R.output(gv)
            return gv

    lowered = convert(Decoder, keep_io_types=False)
    relax.analysis.well_formed(lowered)
    assert [field.dtype for field in lowered["main"].body.body.ty.fields] == ["float16", "float16"]
    rng = np.random.default_rng(0)
    x, past, w = (rng.standard_normal(shape).astype("float16") for shape in [(1, 4), (3, 4), (4, 4)])
    logits, present = relay_amp.run(lowered, [x, past, w])
    assert present.dtype == np.float16
    np.testing.assert_array_equal(present, np.concatenate([past, x]))
    np.testing.assert_allclose(logits, x.astype("float32") @ w.astype("float32"), rtol=1e-2, atol=1e-2)


def _dense_module(weight_dtype: str, low: str | None) -> tvm.IRModule:
    """x @ W with W a constant; with `low` the expected AMP output (weights stored in `weight_dtype`)."""
    weight = (np.arange(12, dtype="float32").reshape(4, 3) - 6.0) / 8.0
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            data = bb.emit(relax.op.astype(x, low)) if low else x
            w = relax.const(weight.astype(relay_amp.dtypes.numpy_dtype(weight_dtype)), weight_dtype)
            out = bb.emit_output(relax.op.matmul(data, w, out_dtype="float32" if low else None))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
def test_constant_weights_are_cast_offline(low):
    after = convert(_dense_module("float32", None), low)
    tvm.ir.assert_structural_equal(after, _dense_module(low, low))


def test_cast_params_offline_false_keeps_a_runtime_cast():
    after = convert(_dense_module("float32", None), cast_params_offline=False)
    casts = [b.value for b in after["main"].body.blocks[0].bindings if b.value.op.name == "relax.astype"]
    assert len(casts) == 2 and isinstance(casts[1].args[0], tvm.ir.expr.Constant)


def test_no_tensor_is_cast_twice_to_one_dtype():
    mod = relay_amp.to_mixed_precision(relay_amp.models.bert_encoder(seq_len=8, layers=2), "float16")
    seen = set()
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and value.op.name == "relax.astype":
                key = (value.args[0], str(value.attrs.dtype))
                assert key not in seen, f"{binding.var.name} repeats a cast"
                seen.add(key)


@pytest.mark.parametrize(
    "options, error, fragment",
    [
        ({"target_dtype": "float8"}, relay_amp.DTypeError, "float8"),
        ({"target_dtype": "int8"}, relay_amp.DTypeError, "target_dtype"),
        ({"fp32_ops": ["nn.softmax"], "target_dtype_ops": ["nn.softmax"]}, relay_amp.OpListConflictError, "softmax"),
        ({"widest_dtype_ops": ["add", "nn.convolution"]}, relay_amp.UnknownOpError, "nn.convolution"),
        ({"excluded_layers": [5]}, relay_amp.LayerIndexError, "out of range"),
        ({"excluded_layers": ["nope"]}, relay_amp.LayerIndexError, "nope"),
        ({"missing_op_mode": "warn"}, relay_amp.OptionError, "missing_op_mode"),
        ({"accumulation_dtype": "float64"}, relay_amp.DTypeError, "accumulation_dtype"),
        ({"conditional_fp32_ops": [("nn.avg_pool2d", "count_include_pad")]}, relay_amp.OptionError, "triples"),
        ({"fp32_ops": [], "missing_op_mode": "error"}, relay_amp.UnknownOpError, "nn.softmax"),
    ],
)
def test_bad_options_raise_errors_naming_the_option(options, error, fragment):
    target = options.pop("target_dtype", "float16")
    with pytest.raises(error, match=fragment):
        relay_amp.to_mixed_precision(Mixed, target, **options)


def test_two_conversions_in_one_process_use_their_own_lists():
    first = convert(Mixed, fp32_ops=["matmul", "nn.softmax"])
    second = convert(Mixed)
    assert "float16" not in first.script() and "float16" in second.script()


def test_calls_into_primfuncs_keep_the_dtypes_their_signature_fixes():
    # the ONNX importer writes Clip as call_tir of a TE PrimFunc: its fp32 buffers must get fp32 tensors
    @I.ir_module
    class Before:
        @T.prim_func(private=True)
        def relu6(a: T.Buffer((2, 4), "float32"), out: T.Buffer((2, 4), "float32")):
            for i, j in T.grid(2, 4):
                out[i, j] = T.min(T.max(a[i, j], T.float32(0)), T.float32(6))

        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            cls = Before
            with R.dataflow():
                mm = R.matmul(x, w)
                gv = R.call_tir(cls.relu6, (mm,), out_ty=R.Tensor((2, 4), "float32"))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @T.prim_func(private=True)
        def relu6(a: T.Buffer((2, 4), "float32"), out: T.Buffer((2, 4), "float32")):
            for i, j in T.grid(2, 4):
                out[i, j] = T.min(T.max(a[i, j], T.float32(0)), T.float32(6))

        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            cls = Expected
            with R.dataflow():
                x16 = R.astype(x, "bfloat16")
                w16 = R.astype(w, "bfloat16")
                mm = R.matmul(x16, w16, out_dtype="float32")
                gv = R.call_tir(cls.relu6, (mm,), out_ty=R.Tensor((2, 4), "float32"))
                R.output(gv)
            return gv

    after = convert(Before, "bfloat16")
    tvm.ir.assert_structural_equal(after, Expected)
    reasons = {e.op: e.reason for e in precision_plan(relay_amp.to_mixed_precision(Before, "bfloat16")).entries}
    assert reasons["relax.call_tir"].startswith("calls a PrimFunc")


def _exported_bias_module(low: str | None) -> tvm.IRModule:
    """relu(x @ W + reshape(b)), the bias reshaped to broadcast as exporters write it; with `low` the expected AMP
    output: the add and relu in `low`, the reshaped bias cast to it."""
    weight = relax.const((np.arange(12, dtype="float32").reshape(4, 3) - 6.0) / 8.0)
    bias = relax.const(np.array([0.5, -1.0, 2.0], "float32"))
    x = relax.Var("x", relax.TensorType((2, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            if low is None:
                biased = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, weight)),
                                              bb.emit(relax.op.reshape(bias, (1, 3)))))
                out = bb.emit_output(relax.op.nn.relu(biased))
            else:
                product = bb.emit(relax.op.matmul(bb.emit(relax.op.astype(x, low)), relay_amp._ir.cast_constant(
                    weight, low), out_dtype="float32"))
                product = bb.emit(relax.op.astype(product, low))
                moved = bb.emit(relax.op.astype(bb.emit(relax.op.reshape(bias, (1, 3))), low))
                activated = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(product, moved))))
                out = bb.emit_output(relax.op.astype(activated, "float32"))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
def test_a_bias_reshaped_from_a_constant_is_a_constant_to_amp(low):
    """A data move of a constant does not hold the add it feeds in fp32 (the widest list ignores constants)."""
    before = _exported_bias_module(None)
    tvm.ir.assert_structural_equal(convert(before, low), _exported_bias_module(low))
    adds = [e for e in precision_plan(relay_amp.to_mixed_precision(before, low)).entries if e.op == "relax.add"]
    assert [(e.dtype, e.reason) for e in adds] == [(low, "widest list")]


def test_a_moved_constant_beyond_float16s_range_keeps_the_add_in_fp32():
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            moved = bb.emit(relax.op.reshape(relax.const(np.full(3, 1e5, "float32")), (1, 3)))
            product = bb.emit(relax.op.matmul(x, relax.const(np.eye(3, dtype="float32"))))
            out = bb.emit_output(relax.op.add(product, moved))
        bb.emit_func_output(out)
    plan = precision_plan(relay_amp.to_mixed_precision(bb.get(), "float16"))
    assert [e.dtype for e in plan.entries if e.op == "relax.add"] == ["float32"]


def test_a_resize_after_a_low_op_yields_the_low_dtype_and_builds():
    """resize2d has an out_dtype, which AMP had set to the fp32 accumulator as for a conv; TVM's legalization
    ignores it and computes in the input's dtype, so GhostNetV2 and EfficientFormerV2 failed to build in bf16."""
    @I.ir_module
    class Upsampled:
        @R.function
        def main(x: R.Tensor((1, 4, 2, 2), "float32"), w: R.Tensor((4, 4, 1, 1), "float32")):
            with R.dataflow():
                conv = R.nn.conv2d(x, w)
                up = R.image.resize2d(conv, R.shape([4, 4]), method="nearest_neighbor")
                gv = R.multiply(up, R.const(2.0, "float32"))
                R.output(gv)
            return gv

    after = convert(Upsampled, "bfloat16")
    resized = [b.value for b in after["main"].body.blocks[0].bindings if b.value.op.name == "relax.image.resize2d"]
    assert [relay_amp._ir.tensor_dtype(call) for call in resized] == ["bfloat16"]
    data = [np.random.default_rng(0).standard_normal(shape).astype("float32") for shape in ((1, 4, 2, 2), (4, 4, 1, 1))]
    executable = relay_amp.build(after, relay_amp.targets.host_preset())
    np.testing.assert_allclose(relay_amp.runtime.run_executable(executable, data)[0], relay_amp.run(Upsampled, data)[0],
                               rtol=2e-2, atol=2e-2)  # bf16's 8 bits of mantissa, twice


def test_an_op_tvm_types_only_in_float16_and_float32_stays_fp32_in_bfloat16():
    """TVM's prelu refuses bfloat16 operands ("Prelu requires the input tensor to have float dtype"), so a bf16
    conversion of ConvTasNet's ONNX export failed; such a call now runs in fp32 with the reason in the plan."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 6), "float32"), w: R.Tensor((4, 4, 1), "float32")):
            with R.dataflow():
                conv = R.nn.conv1d(x, w)
                gv = R.nn.prelu(conv, R.const(np.array([0.25], "float32")), axis=2)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 6), "float32"), w: R.Tensor((4, 4, 1), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "bfloat16")
                w16 = R.astype(w, "bfloat16")
                conv32 = R.nn.conv1d(x16, w16, out_dtype="float32")
                gv = R.nn.prelu(conv32, R.const(np.array([0.25], "float32")), axis=2)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(convert(Before, "bfloat16"), Expected)
    plan = precision_plan(relay_amp.to_mixed_precision(Before, "bfloat16"))
    assert [e.reason for e in plan.entries if e.op == "relax.nn.prelu"] == [
        "TVM's type inference refuses bfloat16 for it"]
    float16 = precision_plan(relay_amp.to_mixed_precision(Before, "float16"))
    assert [e.dtype for e in float16.entries if e.op == "relax.nn.prelu"] == ["float16"]
    data = [np.random.default_rng(0).standard_normal(shape).astype("float32") for shape in ((1, 4, 6), (4, 4, 1))]
    executable = relay_amp.build(relay_amp.to_mixed_precision(Before, "bfloat16"), relay_amp.targets.host_preset())
    np.testing.assert_allclose(relay_amp.runtime.run_executable(executable, data)[0], relay_amp.run(Before, data)[0],
                               rtol=2e-2, atol=2e-2)  # the conv's operands rounded to bf16


@I.ir_module
class Sampled:
    """Deformable attention's sampling: positions are reference points (fp32) plus offsets a matmul predicts, and
    grid_sample reads a conv's output at them (TVM's grid is [N, 2, H, W])."""

    @R.function
    def main(x: R.Tensor((1, 4, 200, 200), "float32"), w: R.Tensor((4, 4, 1, 1), "float32"),
             q: R.Tensor((1, 2, 50, 8), "float32"), p: R.Tensor((8, 1), "float32"),
             reference: R.Tensor((1, 2, 50, 1), "float32")):
        with R.dataflow():
            value = R.nn.conv2d(x, w)
            grid = R.add(reference, R.matmul(q, p))
            gv = R.image.grid_sample(value, grid, method="bilinear", layout="NCHW", padding_mode="zeros",
                                     align_corners=False)
            R.output(gv)
        return gv


def test_grid_sample_reads_fp32_positions_in_a_bfloat16_model():
    """A bf16 position in [-1, 1] is off by up to 1/256 of the map (0.4 px on 200): following its bf16 value
    input, grid_sample rounded its positions and sampled 18% off fp32 here; in the fp32 list (PyTorch autocast's
    grid_sampler) it is within 1%."""
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 200, 200), "float32"), w: R.Tensor((4, 4, 1, 1), "float32"),
                 q: R.Tensor((1, 2, 50, 8), "float32"), p: R.Tensor((8, 1), "float32"),
                 reference: R.Tensor((1, 2, 50, 1), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "bfloat16")
                w16 = R.astype(w, "bfloat16")
                value = R.nn.conv2d(x16, w16, out_dtype="float32")
                q16 = R.astype(q, "bfloat16")
                p16 = R.astype(p, "bfloat16")
                offsets = R.matmul(q16, p16, out_dtype="float32")
                grid = R.add(reference, offsets)
                gv = R.image.grid_sample(value, grid, method="bilinear", layout="NCHW", padding_mode="zeros",
                                         align_corners=False)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(convert(Sampled, "bfloat16"), Expected)
    rng = np.random.default_rng(0)
    data = [*_sampling_inputs(rng, offset_scale=0.002), rng.uniform(-0.9, 0.9, (1, 2, 50, 1)).astype("float32")]
    assert _bf16_error(Sampled, data) <= 0.02  # the conv's bf16 operands


def _sampling_inputs(rng: np.random.Generator, offset_scale: float) -> list[np.ndarray]:
    """The sampled map, its 1x1 conv's weight, the queries and the offsets' weight (scaled to small offsets)."""
    data = [rng.standard_normal(shape).astype("float32") for shape in ((1, 4, 200, 200), (4, 4, 1, 1), (1, 2, 50, 8))]
    return [*data, rng.standard_normal((8, 1)).astype("float32") * offset_scale]


def _bf16_error(module: tvm.IRModule, data: list[np.ndarray]) -> float:
    """The bf16 CPU build's largest error against TVM's fp32 build, over the largest output magnitude."""
    executable = relay_amp.build(relay_amp.to_mixed_precision(module, "bfloat16"), relay_amp.targets.host_preset())
    got, expected = relay_amp.runtime.run_executable(executable, data)[0], relay_amp.run(module, data)[0]
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def test_the_positions_a_sampler_reads_are_computed_in_fp32():
    """Deformable attention's positions are constant reference points plus predicted offsets: a constant never holds
    an add in fp32, so the positions were rounded to bf16 before grid_sample read them (the samples 22% off fp32
    here). The ops computing them are kept fp32, as PyTorch's type promotion keeps them; the offsets' matmul stays
    bf16."""
    reference = np.random.default_rng(1).uniform(-0.9, 0.9, (1, 2, 50, 1)).astype("float32")

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 200, 200), "float32"), w: R.Tensor((4, 4, 1, 1), "float32"),
                 q: R.Tensor((1, 2, 50, 8), "float32"), p: R.Tensor((8, 1), "float32")):
            with R.dataflow():
                value = R.nn.conv2d(x, w)
                scaled = R.multiply(R.matmul(q, p), R.const(0.5, "float32"))
                grid = R.add(R.const(reference), scaled)
                gv = R.image.grid_sample(value, grid, method="bilinear", layout="NCHW", padding_mode="zeros",
                                         align_corners=False)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 200, 200), "float32"), w: R.Tensor((4, 4, 1, 1), "float32"),
                 q: R.Tensor((1, 2, 50, 8), "float32"), p: R.Tensor((8, 1), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "bfloat16")
                w16 = R.astype(w, "bfloat16")
                value = R.nn.conv2d(x16, w16, out_dtype="float32")
                q16 = R.astype(q, "bfloat16")
                p16 = R.astype(p, "bfloat16")
                offsets = R.matmul(q16, p16, out_dtype="float32")
                scaled = R.multiply(offsets, R.const(0.5, "float32"))
                grid = R.add(R.const(reference), scaled)
                gv = R.image.grid_sample(value, grid, method="bilinear", layout="NCHW", padding_mode="zeros",
                                         align_corners=False)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(convert(Before, "bfloat16"), Expected)
    plan = precision_plan(relay_amp.to_mixed_precision(Before, "bfloat16"))
    assert {e.op: e.reason for e in plan.entries if e.op in ("relax.add", "relax.multiply")} == {
        "relax.add": "computes the positions grid_sample samples at: kept fp32",
        "relax.multiply": "computes the positions grid_sample samples at: kept fp32"}
    assert _bf16_error(Before, _sampling_inputs(np.random.default_rng(0), offset_scale=0.004)) <= 0.02


@I.ir_module
class Routed:
    """A mixture of experts' router beside an expert's matmul: sigmoid scores of a narrow GEMM (8 experts), the top 2
    chosen (DeepSeek-V3's and EXAONE-MoE's routers)."""

    @R.function
    def main(x: R.Tensor((6, 32), "float32"), router: R.Tensor((32, 8), "float32"),
             expert: R.Tensor((32, 64), "float32")):
        with R.dataflow():
            up = R.matmul(x, expert)
            scores = R.sigmoid(R.matmul(x, router))
            chosen = R.topk(scores, k=2, axis=-1, ret_type="indices", largest=True, dtype="int64")
            R.output(up, chosen)
        return (chosen, up)


def test_the_scores_a_router_chooses_from_are_computed_in_fp32():
    """The router's GEMM (8 outputs a row) and its sigmoid stay fp32 (the top-k with them); the expert's matmul runs
    in bf16. The plan says why."""
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((6, 32), "float32"), router: R.Tensor((32, 8), "float32"),
                 expert: R.Tensor((32, 64), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "bfloat16")
                expert16 = R.astype(expert, "bfloat16")
                up = R.matmul(x16, expert16, out_dtype="float32")
                scores = R.sigmoid(R.matmul(x, router))
                chosen = R.topk(scores, k=2, axis=-1, ret_type="indices", largest=True, dtype="int64")
                R.output(up, chosen)
            return (chosen, up)

    tvm.ir.assert_structural_equal(convert(Routed, "bfloat16"), Expected)
    plan = precision_plan(relay_amp.to_mixed_precision(Routed, "bfloat16"))
    reasons = {e.op: e.reason for e in plan.entries if e.dtype == "float32"}
    assert reasons["relax.sigmoid"] == reasons["relax.matmul"] == "computes the scores a top-k or an argmax chooses " \
        "from (a router's): kept fp32"


def test_a_wide_gemm_before_an_argmax_stays_in_bf16():
    """An argmax over 1000 logits (a classifier's label in the graph): the elementwise ops between are kept fp32,
    the GEMM, wider than a router's, is not."""
    @I.ir_module
    class Labelled:
        @R.function
        def main(x: R.Tensor((2, 32), "float32"), w: R.Tensor((32, 1000), "float32")):
            with R.dataflow():
                logits = R.add(R.matmul(x, w), R.const(1.0, "float32"))
                gv = R.argmax(logits, axis=-1)
                R.output(gv)
            return gv

    plan = precision_plan(relay_amp.to_mixed_precision(Labelled, "bfloat16"))
    assert {e.op: e.dtype for e in plan.entries} == {"relax.matmul": "bfloat16", "relax.add": "float32",
                                                     "relax.argmax": "float32"}


def test_near_tied_router_scores_choose_the_fp32_experts_in_a_bf16_build():
    """Router logits a few hundredths apart (sigmoid scores near 0.5, where bf16's step is 1/256), the scores read
    by the top-k and by the gather of the chosen experts' weights: rounded to bf16, they tied or swapped, and tokens
    went to other experts than in fp32; kept fp32, every token goes where fp32 sends it."""
    @I.ir_module
    class Weighted:
        @R.function
        def main(x: R.Tensor((16, 32), "float32"), router: R.Tensor((32, 8), "float32")):
            with R.dataflow():
                scores = R.sigmoid(R.matmul(x, router))
                chosen = R.topk(scores, k=2, axis=-1, ret_type="indices", largest=True, dtype="int64")
                weights = R.gather_elements(scores, chosen, axis=1)
                R.output(chosen, weights)
            return (chosen, weights)

    rng = np.random.default_rng(0)
    data = [rng.standard_normal((16, 32)).astype("float32"), (rng.standard_normal((32, 8)) * 0.003).astype("float32")]
    executable = relay_amp.build(relay_amp.to_mixed_precision(Weighted, "bfloat16"), relay_amp.targets.host_preset())
    got = relay_amp.runtime.run_executable(executable, data)[0]
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(relay_amp.run(Weighted, data)[0], axis=-1))
