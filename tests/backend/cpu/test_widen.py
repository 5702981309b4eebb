"""widen: bf16 elementwise chains are computed in fp32 and rounded once where a value leaves the chain."""

import ml_dtypes
import numpy as np
import pytest
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import models
from relay_amp.backend.cpu.widen import WidenArithmetic
from relay_amp.compile.build import build
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms


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
