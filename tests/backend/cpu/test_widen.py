"""widen: bf16 elementwise chains are computed in fp32 and rounded once where a value leaves the chain."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax, topi
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import relay_amp
from relay_amp import models
from relay_amp.backend.cpu import formula, pipeline
from relay_amp.backend.cpu.widen import NormsReadNarrow, WidenArithmetic
from relay_amp.transform import WidenContractions
from relay_amp.compile.build import build
from relay_amp.ops import call_op_name
from relay_amp.runtime import run_executable

from builders import lraspp_logits, single_output_module, tensor, timm_through_onnx
from pass_checks import assert_transforms, prepared_module


def test_chain_from_a_kernel_output_to_a_matmul_rounds_once():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "bfloat16")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                narrow = R.astype(x, "bfloat16")  # the fp32 accumulator of a kernel, cast as AMP casts it
                shifted = R.add(narrow, R.const(1.5, "bfloat16"))
                gelu = R.nn.gelu(shifted)
                flat = R.reshape(gelu, (8, 4))  # joins: its input is widened
                back = R.reshape(flat, (4, 8))
                product = R.matmul(back, w, out_dtype="float32")  # leaves the chain: takes bf16
                R.output(product)
            return product

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "bfloat16")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                shifted = R.add(x, R.const(1.5, "float32"))
                gelu = R.nn.gelu(shifted)
                flat = R.reshape(gelu, (8, 4))
                back = R.reshape(flat, (4, 8))
                narrow = R.astype(back, "bfloat16")
                product = R.matmul(narrow, w, out_dtype="float32")
                R.output(product)
            return product

    assert_transforms(WidenArithmetic(), Before, Expected)


def test_a_quantize_in_the_bf16_fallback_floors_in_fp32_and_casts_its_codes_from_fp32():
    """AMP leaves a quantize's codes, floor(x * 42.5 + 0.5) clamped, in bf16 after a depthwise conv's fp32 sums:
    the floor joins the chain, and the cast to uint8 reads the fp32 value (no bf16 rounding in between)."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "uint8"):
            with R.dataflow():
                narrow = R.astype(x, "bfloat16")
                scaled = R.multiply(narrow, R.const(42.5, "bfloat16"))
                shifted = R.add(scaled, R.const(0.5, "bfloat16"))
                rounded = R.floor(shifted)
                clamped = R.minimum(R.maximum(rounded, R.const(0.0, "bfloat16")), R.const(255.0, "bfloat16"))
                codes = R.astype(clamped, "uint8")
                R.output(codes)
            return codes

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "uint8"):
            with R.dataflow():
                scaled = R.multiply(x, R.const(42.5, "float32"))
                shifted = R.add(scaled, R.const(0.5, "float32"))
                rounded = R.floor(shifted)
                low = R.maximum(rounded, R.const(0.0, "float32"))
                clamped = R.minimum(low, R.const(255.0, "float32"))
                codes = R.astype(clamped, "uint8")
                R.output(codes)
            return codes

    assert_transforms(WidenArithmetic(), Before, Expected)


def test_layout_ops_of_bf16_inputs_stay_views_and_other_dtypes_are_left_alone():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "bfloat16"), y: R.Tensor((4, 8), "float16")
                 ) -> R.Tuple(R.Tensor((32,), "bfloat16"), R.Tensor((4, 8), "float16")):
            with R.dataflow():
                flat = R.reshape(x, (32,))
                doubled = R.add(y, y)
                out = (flat, doubled)
                R.output(out)
            return out

    assert_transforms(WidenArithmetic(), Before, Before)


def test_a_stack_of_stored_steps_and_a_widened_one_moves_them_in_bf16():
    """An LSTM's outputs stacked over its steps: the earlier steps are stored bf16 tensors, the last one a widened
    chain. Widening the concatenation cast every stored step to fp32 only to move it and round it back
    (Sequencer2D-S: 64 fp32 buffers in one bf16 function, 3x its fp32 time); the last step is rounded where it
    leaves its chain instead, which gives the same values."""
    @I.ir_module
    class Before:
        @R.function
        def main(first: R.Tensor((1, 4), "bfloat16"), second: R.Tensor((1, 4), "bfloat16"),
                 cell: R.Tensor((1, 4), "float32")) -> R.Tensor((3, 4), "bfloat16"):
            with R.dataflow():
                narrow = R.astype(cell, "bfloat16")
                last = R.tanh(narrow)
                gv = R.concat((first, second, last), axis=0)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(first: R.Tensor((1, 4), "bfloat16"), second: R.Tensor((1, 4), "bfloat16"),
                 cell: R.Tensor((1, 4), "float32")) -> R.Tensor((3, 4), "bfloat16"):
            with R.dataflow():
                wide_last = R.tanh(cell)
                last = R.astype(wide_last, "bfloat16")
                gv = R.concat((first, second, last), axis=0)
                R.output(gv)
            return gv

    assert_transforms(WidenArithmetic(), Before, Expected)


def test_a_concatenation_of_widened_values_and_constants_joins_the_chain():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4), "float32")) -> R.Tensor((1, 8), "float32"):
            with R.dataflow():
                narrow = R.astype(x, "bfloat16")
                activated = R.tanh(narrow)
                joined = R.concat((activated, R.const(np.ones((1, 4)), "bfloat16")), axis=1)
                gv = R.astype(R.multiply(joined, R.const(2.0, "bfloat16")), "float32")
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4), "float32")) -> R.Tensor((1, 8), "float32"):
            with R.dataflow():
                activated = R.tanh(x)
                joined = R.concat((activated, R.const(np.ones((1, 4)), "float32")), axis=1)
                gv = R.multiply(joined, R.const(2.0, "float32"))  # widened back: takes the fp32 value
                R.output(gv)
            return gv

    assert_transforms(WidenArithmetic(), Before, Expected)


def test_a_pad_of_a_widened_value_pads_it_in_fp32_for_the_norm_after_it():
    """BiT's stem: a kernel's accumulator, its bias in bf16, a pad, then a group norm AMP keeps in fp32. The pad
    joins the chain as the layout ops do, and the cast back to fp32 takes the chain's fp32 value, so the norm reads
    unrounded values (bf16 deviations from a large mean lose their digits)."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 2, 4), "float32"), gamma: R.Tensor((4,), "float32"),
                 beta: R.Tensor((4,), "float32")) -> R.Tensor((1, 4, 4, 4), "float32"):
            with R.dataflow():
                narrow = R.astype(x, "bfloat16")
                biased = R.add(narrow, R.const(1.5, "bfloat16"))
                padded = R.nn.pad(biased, pad_width=[0, 0, 1, 1, 1, 1, 0, 0], pad_value=0.0)
                wide = R.astype(padded, "float32")
                gv = R.nn.group_norm(wide, gamma, beta, num_groups=2, channel_axis=3, axes=[1, 2])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 2, 4), "float32"), gamma: R.Tensor((4,), "float32"),
                 beta: R.Tensor((4,), "float32")) -> R.Tensor((1, 4, 4, 4), "float32"):
            with R.dataflow():
                biased = R.add(x, R.const(1.5, "float32"))
                padded = R.nn.pad(biased, pad_width=[0, 0, 1, 1, 1, 1, 0, 0], pad_value=0.0)
                gv = R.nn.group_norm(padded, gamma, beta, num_groups=2, channel_axis=3, axes=[1, 2])
                R.output(gv)
            return gv

    assert_transforms(WidenArithmetic(), Before, Expected)


def test_a_value_read_twice_reaches_its_readers_rounded_as_before_through_one_cast():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "bfloat16")) -> R.Tensor((4, 8), "bfloat16"):
            with R.dataflow():
                act = R.nn.silu(x)
                pooled = R.mean(act, axis=[1], keepdims=True)  # squeeze-excite: act is stored between the two
                out = R.multiply(act, pooled)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "bfloat16")) -> R.Tensor((4, 8), "bfloat16"):
            with R.dataflow():
                wide = R.astype(x, "float32")
                act_wide = R.nn.silu(wide)
                act = R.astype(act_wide, "bfloat16")
                act_again = R.astype(act, "float32")  # one cast for both readers
                pooled = R.mean(act_again, axis=[1], keepdims=True)
                product = R.multiply(act_again, pooled)
                out = R.astype(product, "bfloat16")
                R.output(out)
            return out

    assert_transforms(WidenArithmetic(), Before, Expected)


def test_a_kernel_output_read_twice_as_bf16_is_stored_in_bf16_and_widened_for_its_residual_add():
    """A conv's fp32 result that only its cast to bf16 reads, the cast read by the next kernel and by a residual
    add: the add widens the stored bf16 value (EfficientViT's projections), so the first kernel stores bf16 and no
    pass of its own rounds an fp32 copy."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "bfloat16")) -> R.Tensor((4, 8), "bfloat16"):
            with R.dataflow():
                narrow = R.astype(x, "bfloat16")  # a kernel's fp32 result, cast as AMP casts it
                product = R.matmul(narrow, w, out_dtype="float32")  # the next kernel reads bf16
                back = R.astype(product, "bfloat16")
                out = R.add(back, narrow)  # the residual
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "bfloat16")) -> R.Tensor((4, 8), "bfloat16"):
            with R.dataflow():
                narrow = R.astype(x, "bfloat16")
                product = R.matmul(narrow, w, out_dtype="float32")
                widened = R.astype(narrow, "float32")
                total = R.add(product, widened)
                out = R.astype(total, "bfloat16")
                R.output(out)
            return out

    assert_transforms(WidenArithmetic(), Before, Expected)


def test_a_kernel_output_stored_in_fp32_anyway_is_read_as_it_is_by_its_casts_readers():
    """The same, where an fp32 op reads the conv's result too: it is stored in fp32 whatever the add reads, so the
    add takes it unrounded."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "bfloat16")):
            with R.dataflow():
                narrow = R.astype(x, "bfloat16")
                product = R.matmul(narrow, w, out_dtype="float32")
                back = R.astype(product, "bfloat16")
                out = R.add(back, narrow)
                total = R.sum(x, axis=[1])  # an fp32 reader of the kernel's result
                R.output(out, total)
            return (out, total)

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "bfloat16")):
            with R.dataflow():
                narrow = R.astype(x, "bfloat16")
                product = R.matmul(narrow, w, out_dtype="float32")
                added = R.add(product, x)
                out = R.astype(added, "bfloat16")
                total = R.sum(x, axis=[1])
                R.output(out, total)
            return (out, total)

    assert_transforms(WidenArithmetic(), Before, Expected)


def _kernel_outputs_cast_apart(prepared: tvm.IRModule) -> int:
    """How many calls in `prepared`'s main are a cast function of its own reading a dot-product kernel's result."""
    produced_by = {}
    casts = 0
    for block in prepared["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if call_op_name(value) != "relax.call_tir":
                continue
            name, args = value.args[0].name_hint, value.args[1].fields
            produced_by[binding.var] = name
            casts += name.startswith("cast") and produced_by.get(args[0], "").startswith("relay_amp_dot_kernel")
    return casts


def test_ghostnetv2s_bf16_kernels_store_bf16_and_it_matches_torch(tmp_path):
    """A model the rule was not written on (timm's GhostNetV2, through ONNX; EfficientViT-B0's projections were): no
    kernel result is stored in fp32 for a cast of its own (5 were), and the bf16 build stays within bf16's error
    of PyTorch's fp32."""
    pytest.importorskip("timm")
    _, imported, x, expected = timm_through_onnx("ghostnetv2_100", tmp_path)
    mixed = relay_amp.to_mixed_precision(imported, "bfloat16")
    target = relay_amp.targets.get_target("cpu-avx512-bf16")
    with target, tvm.transform.PassContext(opt_level=3):
        prepared = pipeline.prepare_passes(target)(mixed)
    assert _kernel_outputs_cast_apart(prepared) == 0
    built = run_executable(relay_amp.build(mixed, relay_amp.targets.host_preset()), [x])[0]
    np.testing.assert_allclose(built.astype("float32"), expected, atol=0.03 * np.abs(expected).max())


def test_a_segmentation_models_last_resize_writes_its_fp32_output_in_bf16(tmp_path):
    """A model the change was not written on (torchvision's LR-ASPP through ONNX; YOLOv8's box and class decoding
    was): AMP's cast of the bf16 output back to fp32 sits in the dataflow block, so it fuses into the function
    computing the output (the logits' resize) instead of a function of its own, and the build matches PyTorch."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    torch.manual_seed(0)
    module, x = lraspp_logits(), torch.randn(1, 3, 64, 64)
    torch.onnx.export(module, (x,), str(tmp_path / "lraspp.onnx"), opset_version=17, dynamo=False)
    mixed = relay_amp.to_mixed_precision(relay_amp.frontend.from_onnx(tmp_path / "lraspp.onnx"), "bfloat16")
    last = prepared_module(mixed)["main"].body.blocks[-1].bindings[-1].value
    assert "resize_h" in last.args[0].name_hint and relay_amp._ir.tensor_dtype(last) == "float32"  # its H pass
    with torch.no_grad():
        expected = module(x).numpy()
    built = run_executable(relay_amp.build(mixed, relay_amp.targets.host_preset()), [x.numpy()])[0]
    np.testing.assert_allclose(built, expected, atol=0.03 * np.abs(expected).max())


def test_graph_output_is_rounded_once_and_matches_fp32():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 64), "bfloat16")) -> R.Tensor((4, 64), "bfloat16"):
            with R.dataflow():
                scaled = R.multiply(x, R.const(3.0, "bfloat16"))
                soft = R.nn.softmax(scaled, axis=-1)
                out = R.subtract(soft, R.const(0.01, "bfloat16"))
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 64), "bfloat16")) -> R.Tensor((4, 64), "bfloat16"):
            with R.dataflow():
                wide = R.astype(x, "float32")
                scaled = R.multiply(wide, R.const(3.0, "float32"))
                soft = R.nn.softmax(scaled, axis=-1)
                diff = R.subtract(soft, R.const(np.float32(ml_dtypes.bfloat16(0.01)), "float32"))
                out = R.astype(diff, "bfloat16")
                R.output(out)
            return out

    assert_transforms(WidenArithmetic(), Before, Expected)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype("float32")
    got = run_executable(build(Before, "cpu"), [x.astype(ml_dtypes.bfloat16)])[0].astype("float32")
    scaled = 3 * x.astype(ml_dtypes.bfloat16).astype("float32")
    soft = np.exp(scaled - scaled.max(-1, keepdims=True))
    expected = soft / soft.sum(-1, keepdims=True) - np.float32(ml_dtypes.bfloat16(0.01))
    assert np.abs(got - expected).max() <= 2 ** -8 * np.abs(expected).max()  # one bf16 rounding of the result


def _depthwise_conv(data_dtype: str, weight: np.ndarray) -> tvm.IRModule:
    """A 3x3 depthwise conv over a 6x6x16 NHWC input of `data_dtype`, summing in fp32."""
    return single_output_module(lambda x: relax.op.nn.conv2d(
        x, relax.const(weight), padding=1, groups=16, data_layout="NHWC", kernel_layout="HWIO",
        out_dtype="float32"), tensor("x", (1, 6, 6, 16), data_dtype))


@pytest.mark.parametrize("data_dtype", ["bfloat16", "uint8"])
def test_a_grouped_conv_reads_a_widened_weight_and_its_data_as_stored(data_dtype):
    """bf16 data, or a quantized depthwise conv's uint8 codes (its weight codes made bf16 by AMP's fallback)."""
    weight = np.random.default_rng(1).integers(-127, 128, (3, 3, 1, 16)).astype(ml_dtypes.bfloat16)
    before = _depthwise_conv(data_dtype, weight)
    assert_transforms(WidenArithmetic(), before, _depthwise_conv(data_dtype, weight.astype("float32")))
    x = np.random.default_rng(0).integers(0, 256, (1, 6, 6, 16)).astype(ml_dtypes.bfloat16).astype(data_dtype)
    got = run_executable(build(before, "cpu"), [x])[0]
    padded = np.pad(x.astype("float32"), ((0, 0), (1, 1), (1, 1), (0, 0)))
    wide = weight.astype("float32")
    expected = sum(padded[:, i:i + 6, j:j + 6, :] * wide[i, j, 0] for i in range(3) for j in range(3))
    np.testing.assert_array_equal(got, expected)  # whole codes: every partial sum is exact in fp32


def test_a_dense_conv_keeps_its_bf16_weight():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 6, 6, 16), "bfloat16"), w: R.Tensor((3, 3, 16, 16), "bfloat16")
                 ) -> R.Tensor((1, 6, 6, 16), "float32"):
            with R.dataflow():
                out = R.nn.conv2d(x, w, padding=1, data_layout="NHWC", kernel_layout="HWIO", out_dtype="float32")
                R.output(out)
            return out

    assert_transforms(WidenArithmetic(), Before, Before)


def test_bf16_bert_with_widened_chains_stays_within_bf16_error_of_fp32():
    mod = models.get_model("bert", seq_len=16, layers=1)
    inputs = models.example_inputs(mod)
    expected = run_executable(build(mod, "cpu"), inputs)[0]
    got = run_executable(build(relay_amp.to_mixed_precision(mod, "bfloat16"), "cpu"), inputs)[0]
    assert np.abs(got.astype("float32") - expected).max() <= 3e-2 * np.abs(expected).max()


def test_a_missing_function_is_a_module_error():
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((4,), "bfloat16")) -> R.Tensor((4,), "bfloat16"):
            return x

    with pytest.raises(relay_amp.ModuleError, match="encoder"):
        WidenArithmetic(func="encoder")(Module)


def _norm_reading(x: relax.Var, params: list[relax.Var], compute) -> tvm.IRModule:
    """main(x, *params) = one TE function `compute` of `x` (bf16 or fp32) and fp32 `params`."""
    builder = relax.BlockBuilder()
    with builder.function("main", [x, *params]):
        with builder.dataflow():
            out = builder.emit_output(builder.call_te(compute, x, *params, primfunc_name_hint=compute.__name__))
        builder.emit_func_output(out)
    return builder.get()


def test_a_layer_norm_of_a_widened_parameter_reads_it_in_bf16():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 32), "bfloat16"), gamma: R.Tensor((32,), "float32"),
                 beta: R.Tensor((32,), "float32")) -> R.Tensor((4, 32), "float32"):
            with R.dataflow():
                wide = R.astype(x, "float32")
                out = R.nn.layer_norm(wide, gamma, beta, axes=[1], epsilon=1e-5)
                R.output(out)
            return out

    def layer_norm(x, gamma, beta):
        return topi.nn.layer_norm(topi.cast(x, "float32"), gamma, beta, axis=[1], epsilon=1e-5)

    x, gamma, beta = Before["main"].params
    after = assert_transforms(NormsReadNarrow(), Before, _norm_reading(x, [gamma, beta], layer_norm))
    inputs = [np.random.default_rng(1).standard_normal(shape).astype(dtype) for shape, dtype in
              [((4, 32), ml_dtypes.bfloat16), ((32,), "float32"), ((32,), "float32")]]
    np.testing.assert_allclose(run_executable(build(after, "cpu"), inputs)[0], relay_amp.run(Before, inputs)[0],
                               rtol=1e-5, atol=1e-5)


def test_an_rms_norm_of_a_widened_kernel_output_reads_it_in_bf16():
    @I.ir_module
    class Before:
        @T.prim_func(private=True, s_tir=True)
        def kernel(a: T.Buffer((4, 32), "bfloat16"), b: T.Buffer((128,), "bfloat16")):
            for i, j in T.grid(4, 32):
                with T.sblock("copy"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    b[vi * 32 + vj] = a[vi, vj]

        @R.function
        def main(x: R.Tensor((4, 32), "bfloat16"), weight: R.Tensor((32,), "float32")) -> R.Tensor((4, 32), "float32"):
            cls = Before
            with R.dataflow():
                flat = R.call_tir(cls.kernel, (x,), out_ty=R.Tensor((128,), "bfloat16"))
                y = R.reshape(flat, (4, 32))  # seen through: the cast still has no function to join
                wide = R.astype(y, "float32")
                out = R.nn.rms_norm(wide, weight, axes=[1], epsilon=1e-5)
                R.output(out)
            return out

    after = NormsReadNarrow()(Before)
    calls = [binding.value for binding in after["main"].body.blocks[0].bindings]
    assert [call.op.name for call in calls] == ["relax.call_tir", "relax.reshape", "relax.call_tir"]
    assert calls[2].args[0].name_hint == "rms_norm"
    assert calls[2].args[1][0].same_as(after["main"].body.blocks[0].bindings[1].var)  # the bf16 tensor itself


def test_a_layer_norm_of_a_widened_slice_reads_the_whole_bf16_tensor_through_the_window():
    """gMLP's gate normalizes half a kernel's channels: the slice and the cast would be a function of their own,
    storing an fp32 copy of the half; the norm reads the slice's window of the bf16 tensor instead."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 64), "bfloat16"), gamma: R.Tensor((32,), "float32"),
                 beta: R.Tensor((32,), "float32")) -> R.Tensor((4, 32), "float32"):
            with R.dataflow():
                half = R.strided_slice(x, axes=[1], begin=[32], end=[64])
                wide = R.astype(half, "float32")
                out = R.nn.layer_norm(wide, gamma, beta, axes=[1], epsilon=1e-5)
                R.output(out)
            return out

    def layer_norm(x, gamma, beta):
        half = topi.strided_slice(x, [0, 32], [4, 64])
        return topi.nn.layer_norm(topi.cast(half, "float32"), gamma, beta, axis=[1], epsilon=1e-5)

    x, gamma, beta = Before["main"].params
    after = assert_transforms(NormsReadNarrow(), Before, _norm_reading(x, [gamma, beta], layer_norm))
    inputs = [np.random.default_rng(2).standard_normal(shape).astype(dtype) for shape, dtype in
              [((4, 64), ml_dtypes.bfloat16), ((32,), "float32"), ((32,), "float32")]]
    np.testing.assert_allclose(run_executable(build(after, "cpu"), inputs)[0], relay_amp.run(Before, inputs)[0],
                               rtol=1e-5, atol=1e-5)


@I.ir_module
class SoftmaxOfScores:
    """Attention scores computed over 224 columns (whole pairs of 16-lane columns), sliced to the 208 a softmax
    padded to whole vectors reads."""
    @R.function
    def main(scores: R.Tensor((2, 5, 224), "float32")) -> R.Tensor((2, 5, 208), "float32"):
        with R.dataflow():
            kept = R.strided_slice(scores, axes=[2], begin=[0], end=[208])
            out = R.nn.softmax(kept, axis=2)
            R.output(out)
        return out


@pytest.mark.parametrize("fast", [True, False])
def test_a_softmax_of_a_slice_reads_the_window_of_the_scores(fast):
    """The slice was a function of its own copying the scores (0.15 of ViT-S/16's 11.7 ms in bf16): the softmax
    reads its window of them, by formula.fast_softmax where fast math is on and TVM's exact one where it is off."""
    def softmax(scores):
        kept = topi.strided_slice(scores, [0, 0, 0], [2, 5, 208])
        return (formula.fast_softmax if fast else topi.nn.softmax)(kept, 2)

    softmax.__name__ = "fast_softmax" if fast else "softmax"  # TVM's names: profiles match fp32 builds' calls
    expected = _norm_reading(SoftmaxOfScores["main"].params[0], [], softmax)
    after = assert_transforms(NormsReadNarrow(fast_softmax=fast), SoftmaxOfScores, expected)
    scores = np.random.default_rng(3).standard_normal((2, 5, 224)).astype("float32") * 4
    np.testing.assert_allclose(run_executable(build(after, "cpu"), [scores])[0],
                               relay_amp.run(SoftmaxOfScores, [scores])[0], rtol=1e-5, atol=1e-6)


@I.ir_module
class RoundedSoftmaxOfScores:
    """SoftmaxOfScores with its weights rounded to bf16, as a bf16 model's attention rounds them for the product
    with the values."""
    @R.function
    def main(scores: R.Tensor((2, 5, 224), "float32")) -> R.Tensor((2, 5, 208), "bfloat16"):
        with R.dataflow():
            kept = R.strided_slice(scores, axes=[2], begin=[0], end=[208])
            weights = R.nn.softmax(kept, axis=2)
            out = R.astype(weights, "bfloat16")
            R.output(out)
        return out


def test_a_softmax_of_a_slice_rounded_to_bf16_reads_the_window_with_narrow_exps():
    """The softmax reading its window takes fastmath's narrow exps where its result is rounded to bf16."""
    def fast_softmax(scores):
        return formula.fast_softmax(topi.strided_slice(scores, [0, 0, 0], [2, 5, 208]), 2, narrow=True)

    builder = relax.BlockBuilder()
    scores_var = RoundedSoftmaxOfScores["main"].params[0]
    with builder.function("main", [scores_var]):
        with builder.dataflow():
            weights = builder.emit(builder.call_te(fast_softmax, scores_var, primfunc_name_hint="fast_softmax"))
            out = builder.emit_output(relax.op.astype(weights, "bfloat16"))
        builder.emit_func_output(out)
    after = assert_transforms(NormsReadNarrow(), RoundedSoftmaxOfScores, builder.get())
    scores = np.random.default_rng(3).standard_normal((2, 5, 224)).astype("float32") * 4
    got = run_executable(build(after, "cpu"), [scores])[0].astype("float32")
    np.testing.assert_allclose(got, relay_amp.run(SoftmaxOfScores, [scores])[0], rtol=8e-3, atol=1e-7)


def test_an_fp32_norm_of_a_slice_reads_the_window_and_a_strided_slice_stays():
    """In fp32 too, a norm of a slice of a stored tensor reads the window (no sliced copy); a slice taking every
    other channel is left to fusion, as is a slice of an elementwise op's result (it joins that op's function)."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 64), "float32"), weight: R.Tensor((32,), "float32")) -> R.Tensor((4, 32), "float32"):
            with R.dataflow():
                half = R.strided_slice(x, axes=[1], begin=[0], end=[32])
                out = R.nn.rms_norm(half, weight, axes=[1], epsilon=1e-5)
                R.output(out)
            return out

    def rms_norm(x, weight):
        return topi.nn.rms_norm(topi.strided_slice(x, [0, 0], [4, 32]), weight, axis=[1], epsilon=1e-5)

    x, weight = Before["main"].params
    assert_transforms(NormsReadNarrow(), Before, _norm_reading(x, [weight], rms_norm))

    @I.ir_module
    class Kept:
        @R.function
        def main(x: R.Tensor((4, 64), "float32"), weight: R.Tensor((32,), "float32")) -> R.Tensor((4, 32), "float32"):
            with R.dataflow():
                odd = R.strided_slice(x, axes=[1], begin=[1], end=[64], strides=[2])
                doubled = R.add(x, x)
                half = R.strided_slice(doubled, axes=[1], begin=[0], end=[32])
                first = R.nn.rms_norm(odd, weight, axes=[1], epsilon=1e-5)
                second = R.nn.rms_norm(half, weight, axes=[1], epsilon=1e-5)
                out = R.add(first, second)
                R.output(out)
            return out

    assert_transforms(NormsReadNarrow(), Kept, Kept)


def test_a_cast_that_fuses_into_its_producer_stays_there():
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((4, 32), "bfloat16"), gamma: R.Tensor((32,), "float32"),
                 beta: R.Tensor((32,), "float32")) -> R.Tensor((4, 32), "float32"):
            with R.dataflow():
                doubled = R.add(x, x)  # the cast joins this function
                wide = R.astype(doubled, "float32")
                out = R.nn.layer_norm(wide, gamma, beta, axes=[1], epsilon=1e-5)
                R.output(out)
            return out

    assert_transforms(NormsReadNarrow(), Module, Module)


def _layer_norm_of_a_shared_sum(narrow_read: bool) -> tvm.IRModule:
    """A layer norm of x + x (bf16) widened, x + x also a graph output (a residual stream the next block adds to):
    with `narrow_read`, one TE function reads the bf16 sum and widens it as it loads it."""
    x = relax.Var("x", relax.TensorType((4, 32), "bfloat16"))
    gamma, beta = (relax.Var(name, relax.TensorType((32,), "float32")) for name in ("gamma", "beta"))

    def layer_norm(x, gamma, beta):
        return topi.nn.layer_norm(topi.cast(x, "float32"), gamma, beta, axis=[1], epsilon=1e-5)

    builder = relax.BlockBuilder()
    with builder.function("main", [x, gamma, beta]):
        with builder.dataflow():
            doubled = builder.emit(relax.op.add(x, x))
            if narrow_read:
                norm = builder.emit(builder.call_te(layer_norm, doubled, gamma, beta, primfunc_name_hint="layer_norm"))
            else:
                norm = builder.emit(relax.op.nn.layer_norm(builder.emit(relax.op.astype(doubled, "float32")), gamma,
                                                           beta, axes=[1], epsilon=1e-5))
            out = builder.emit_output(relax.Tuple([norm, doubled]))
        builder.emit_func_output(out)
    return builder.get()


def test_a_norm_of_a_widened_tensor_other_ops_read_reads_it_in_bf16():
    """The sum is stored in bf16 for its other reader anyway, so its cast cannot join the add's function: the norm
    reads the bf16 sum itself rather than an fp32 copy a cast function of its own would store."""
    after = assert_transforms(NormsReadNarrow(), _layer_norm_of_a_shared_sum(False), _layer_norm_of_a_shared_sum(True))
    inputs = [np.random.default_rng(2).standard_normal(shape).astype(dtype) for shape, dtype in
              [((4, 32), ml_dtypes.bfloat16), ((32,), "float32"), ((32,), "float32")]]
    expected = relay_amp.run(_layer_norm_of_a_shared_sum(False), inputs)
    np.testing.assert_allclose(run_executable(build(after, "cpu"), inputs)[0], expected[0], rtol=1e-5, atol=1e-5)


def test_twins_layer_norms_read_its_bf16_residual_streams(tmp_path):
    """timm's Twins-SVT-S in bf16 (a model this was not written on: its stages' position-encoding adds feed a norm
    and the next residual add): no function of its build only casts a tensor for a norm to read."""
    pytest.importorskip("timm")
    _, imported, _, _ = timm_through_onnx("twins_svt_small", tmp_path)
    main = prepared_module(relay_amp.to_mixed_precision(imported, "bfloat16"))["main"]
    called = [binding.value.args[0].name_hint for block in main.body.blocks for binding in block.bindings
              if isinstance(binding.value, relax.Call) and isinstance(binding.value.op, tvm.ir.Op)
              and binding.value.op.name == "relax.call_tir"]
    assert not [name for name in called if name.startswith("cast")]


def test_a_mean_of_a_widened_bf16_tensor_reads_it_in_bf16():
    """An SE block's squeeze: FuseOps joins no cast to a mean, so the cast would store an fp32 copy of the
    activation (or make the function producing it store fp32)."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 6, 6, 32), "bfloat16"), y: R.Tensor((1, 6, 6, 32), "float32")):
            with R.dataflow():
                wide = R.astype(x, "float32")
                pooled = R.mean(wide, axis=[1, 2], keepdims=True)
                kept = R.mean(y, axis=[1, 2], keepdims=True)  # an fp32 tensor's mean stays
                out = (pooled, kept)
                R.output(out)
            return out

    def mean(x):
        return topi.divide(topi.sum(topi.cast(x, "float32"), axis=[1, 2], keepdims=True), 36.0)

    x, y = Before["main"].params
    builder = relax.BlockBuilder()
    with builder.function("main", [x, y]):
        with builder.dataflow():
            pooled = builder.emit(builder.call_te(mean, x, primfunc_name_hint="mean"))
            kept = builder.emit(relax.op.mean(y, axis=[1, 2], keepdims=True))
            out = builder.emit_output(relax.Tuple([pooled, kept]))
        builder.emit_func_output(out)
    after = assert_transforms(NormsReadNarrow(), Before, builder.get())
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1, 6, 6, 32)).astype(dtype) for dtype in (ml_dtypes.bfloat16, "float32")]
    for got, expected in zip(run_executable(build(after, "cpu"), inputs), relay_amp.run(Before, inputs)):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_mean_over_a_symbolic_axis_keeps_tvms():
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor(("n", 32), "bfloat16")) -> R.Tensor((1, 32), "float32"):
            with R.dataflow():
                wide = R.astype(x, "float32")
                pooled = R.mean(wide, axis=[0], keepdims=True)  # mean pooling over a dynamic token axis
                R.output(pooled)
            return pooled

    assert_transforms(NormsReadNarrow(), Module, Module)


def test_norms_read_narrow_names_a_missing_function():
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((4,), "bfloat16")) -> R.Tensor((4,), "bfloat16"):
            return x

    with pytest.raises(relay_amp.ModuleError, match="encoder"):
        NormsReadNarrow(func="encoder")(Module)


def _bf16_matmul_module(weight: np.ndarray) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType((4, 16), "bfloat16"))
    y = relax.Var("y", relax.TensorType((4, 16), "bfloat16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            product = bb.emit(relax.op.matmul(x, relax.const(weight), out_dtype="float32"))
            scores = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(y))))
            out = bb.emit_output(relax.Tuple([product, scores]))
        bb.emit_func_output(out)
    return bb.get()


def test_contractions_of_a_dtype_without_kernels_are_computed_in_fp32_on_the_fp32_kernels():
    """On an AVX2 host (no vdpbf16ps, fp32 FMA kernels) a bf16 matmul, by a constant weight or a runtime operand,
    widens its operands (the constant at compile time) and casts its result back to its own dtype."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    before = _bf16_matmul_module(weight)

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 16), "bfloat16"), y: R.Tensor((4, 16), "bfloat16")):
            with R.dataflow():
                wide_x = R.astype(x, "float32")
                wide_product = R.matmul(wide_x, R.const(weight.astype("float32")), out_dtype="float32")
                product = R.astype(wide_product, "float32")
                transposed = R.permute_dims(y)
                wide_x2 = R.astype(x, "float32")
                wide_y = R.astype(transposed, "float32")
                wide_scores = R.matmul(wide_x2, wide_y, out_dtype="float32")
                scores = R.astype(wide_scores, "bfloat16")
                out = (product, scores)
                R.output(out)
            return out

    assert_transforms(WidenContractions(frozenset({"float32"})), before, Expected)
    assert_transforms(WidenContractions(frozenset({"float32", "bfloat16"})), before, before)  # AVX-512 BF16
    inputs = [rng.standard_normal((4, 16)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    got = relay_amp.run(WidenContractions(frozenset({"float32"}))(before), inputs)
    x, y = (value.astype("float32") for value in inputs)
    for wide, exact in zip(got, (x @ weight.astype("float32"), x @ y.T)):  # fp32 sums, one bf16 rounding at most
        np.testing.assert_allclose(wide.astype("float32"), exact, rtol=2 ** -8, atol=1e-6)
