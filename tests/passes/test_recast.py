"""Recast: structural Before/Expected tests and numeric runs on the Relax VM."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import models

from builders import single_output_module, tensor
from pass_checks import assert_transforms


@I.ir_module
class TwoConvs:
    @R.function
    def main(x: R.Tensor((1, 3, 8, 8), "float32"), w1: R.Tensor((4, 3, 3, 3), "float32"),
             w2: R.Tensor((4, 4, 3, 3), "float32")) -> R.Tensor((1, 4, 4, 4), "float32"):
        with R.dataflow():
            lv = R.nn.conv2d(x, w1)
            lv1 = R.nn.relu(lv)
            gv = R.nn.conv2d(lv1, w2)
            R.output(gv)
        return gv


def check(before: tvm.IRModule, expected: tvm.IRModule, **options) -> None:
    """Recast `before` and compare with `expected`."""
    assert_transforms(lambda mod: relay_amp.recast(mod, **options), before, expected)


def test_recast_all_convs_to_int8():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 3, 8, 8), "float32"), w1: R.Tensor((4, 3, 3, 3), "float32"),
                 w2: R.Tensor((4, 4, 3, 3), "float32")) -> R.Tensor((1, 4, 4, 4), "float32"):
            with R.dataflow():
                x8 = R.astype(x, "int8")
                w18 = R.astype(w1, "int8")
                c1 = R.nn.conv2d(x8, w18, out_dtype="int32")
                lv = R.astype(c1, "float32")
                lv1 = R.nn.relu(lv)
                a8 = R.astype(lv1, "int8")
                w28 = R.astype(w2, "int8")
                c2 = R.nn.conv2d(a8, w28, out_dtype="int32")
                gv = R.astype(c2, "float32")
                R.output(gv)
            return gv

    check(TwoConvs, Expected, dtype="int8", out_dtype="int32")


def test_recast_skip_first_layer():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 3, 8, 8), "float32"), w1: R.Tensor((4, 3, 3, 3), "float32"),
                 w2: R.Tensor((4, 4, 3, 3), "float32")) -> R.Tensor((1, 4, 4, 4), "float32"):
            with R.dataflow():
                lv = R.nn.conv2d(x, w1)
                lv1 = R.nn.relu(lv)
                a16 = R.astype(lv1, "float16")
                w216 = R.astype(w2, "float16")
                gv = R.nn.conv2d(a16, w216, out_dtype="float32")
                R.output(gv)
            return gv

    check(TwoConvs, Expected, dtype="float16", out_dtype="float32", skip_layers=[0])


def test_recast_skip_last_layer_by_negative_index():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 3, 8, 8), "float32"), w1: R.Tensor((4, 3, 3, 3), "float32"),
                 w2: R.Tensor((4, 4, 3, 3), "float32")) -> R.Tensor((1, 4, 4, 4), "float32"):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w116 = R.astype(w1, "float16")
                c1 = R.nn.conv2d(x16, w116, out_dtype="float16")
                lv = R.astype(c1, "float32")
                lv1 = R.nn.relu(lv)
                gv = R.nn.conv2d(lv1, w2)
                R.output(gv)
            return gv

    check(TwoConvs, Expected, dtype="float16", out_dtype="float16", skip_layers=[-1])


def test_recast_matmul():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8), "float32"), w: R.Tensor((8, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            with R.dataflow():
                gv = R.matmul(x, w)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 8), "float32"), w: R.Tensor((8, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            with R.dataflow():
                x8 = R.astype(x, "int8")
                w8 = R.astype(w, "int8")
                mm = R.matmul(x8, w8, out_dtype="int32")
                gv = R.astype(mm, "float32")
                R.output(gv)
            return gv

    check(Before, Expected, dtype="int8", out_dtype="int32", ops=["matmul"])


def test_recast_concat_casts_each_tuple_field():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((1, 4), "float32"), b: R.Tensor((1, 4), "float32")) -> R.Tensor((1, 8), "float32"):
            with R.dataflow():
                gv = R.concat((a, b), axis=1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((1, 4), "float32"), b: R.Tensor((1, 4), "float32")) -> R.Tensor((1, 8), "float32"):
            with R.dataflow():
                a16 = R.astype(a, "float16")
                b16 = R.astype(b, "float16")
                cat = R.concat((a16, b16), axis=1)
                gv = R.astype(cat, "float32")
                R.output(gv)
            return gv

    check(Before, Expected, dtype="float16", out_dtype="float32", ops=["concat"])


def test_recast_casts_constant_weights_offline():
    weight = np.arange(24, dtype="float32").reshape(2, 3, 2, 2) / 7.0

    def conv_module(weight_dtype: str, recast_to: str | None) -> tvm.IRModule:
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((1, 3, 4, 4), "float32"))
        with bb.function("main", [x]):
            with bb.dataflow():
                data = bb.emit(relax.op.astype(x, recast_to)) if recast_to else x
                w = relax.const(weight.astype(weight_dtype), weight_dtype)
                y = bb.emit(relax.op.nn.conv2d(data, w, out_dtype="float32" if recast_to else None))
                out = bb.emit_output(y)
            bb.emit_func_output(out)
        return bb.get()

    check(conv_module("float32", None), conv_module("float16", "float16"), dtype="float16", out_dtype="float32")


def test_recast_runs_inside_sequential():
    seq = tvm.transform.Sequential([relay_amp.transform.Recast("float16", "float32", skip_layers=[0])])
    direct = relay_amp.recast(TwoConvs, "float16", "float32", skip_layers=[0])
    tvm.ir.assert_structural_equal(seq(TwoConvs), direct)


def test_recast_small_cnn_float16_matches_fp32():
    mod = models.small_cnn(batch=4)
    inputs = models.example_inputs(mod)
    expected = relay_amp.run(mod, inputs)[0]
    got = relay_amp.run(relay_amp.recast(mod, "float16", "float32", ops=["nn.conv2d", "matmul"]), inputs)[0]
    # fp16 inputs carry an 11-bit mantissa: relative error of a few 1e-3 over 3 layers with fp32 accumulation
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def test_recast_small_cnn_int8_runs_and_is_finite():
    mod = models.small_cnn(batch=2)
    recast_mod = relay_amp.recast(mod, "int8", "int32", skip_layers=[0])
    assert "int8" in recast_mod.script()
    out = relay_amp.run(recast_mod, models.example_inputs(mod))[0]
    assert out.shape == (2, 10) and np.isfinite(out).all()


@pytest.mark.parametrize(
    "options, error, fragment",
    [
        ({"dtype": "float16", "out_dtype": "float32", "ops": ["nn.dense"]}, relay_amp.UnknownOpError, "dense"),
        ({"dtype": "floaty", "out_dtype": "float32"}, relay_amp.DTypeError, "floaty"),
        ({"dtype": "int8", "out_dtype": 32}, relay_amp.DTypeError, "out_dtype"),
        ({"dtype": "int8", "out_dtype": "int32", "skip_layers": [2]}, relay_amp.LayerIndexError, "-2..1"),
        ({"dtype": "int8", "out_dtype": "int32", "skip_layers": [-3]}, relay_amp.LayerIndexError, "-3"),
        ({"dtype": "int8", "out_dtype": "int32", "func": "forward"}, relay_amp.ModuleError, "forward"),
    ],
)
def test_recast_rejects_bad_input(options, error, fragment):
    with pytest.raises(error, match=fragment):
        relay_amp.recast(TwoConvs, **options)


def _single_op_module(make_call, data_shape, weight_shape):
    weight = relax.const(np.random.default_rng(0).standard_normal(weight_shape).astype("float32"))
    return single_output_module(lambda x: make_call(x, weight), tensor("x", data_shape))


@pytest.mark.parametrize(
    "op, make_call, data_shape, weight_shape",
    [
        ("nn.conv1d", lambda x, w: relax.op.nn.conv1d(x, w, padding=1), (2, 4, 16), (8, 4, 3)),
        ("nn.conv2d_transpose", lambda x, w: relax.op.nn.conv2d_transpose(x, w, strides=2),
         (1, 4, 6, 6), (4, 8, 2, 2)),
    ],
)
def test_recast_conv1d_and_conv2d_transpose_to_float16(op, make_call, data_shape, weight_shape):
    mod = _single_op_module(make_call, data_shape, weight_shape)
    converted = relay_amp.recast(mod, "float16", "float32", ops=[op])
    relax.analysis.well_formed(converted)
    layer = relay_amp.list_layers(converted, [op])[0]
    assert layer.input_dtypes == ("float16", "float16") and layer.output_dtype == "float32"
    inputs = models.example_inputs(mod)
    expected = relay_amp.run(mod, inputs)[0]
    # fp16 inputs, fp32 accumulation over at most 16 products: relative error ~1e-3
    np.testing.assert_allclose(relay_amp.run(converted, inputs)[0], expected, rtol=1e-2,
                               atol=1e-2 * np.abs(expected).max())
