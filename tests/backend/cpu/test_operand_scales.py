"""operand_scales: attention's query and key scales (the dynamo exporter's d^-1/4 on each) move to the product."""

import ml_dtypes
import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.backend.cpu.formula import scalar
from relay_amp.backend.cpu.operand_scales import ScalesAfterMatmuls
from relay_amp.compile.build import build
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms, prepared_function_names

TOLERANCE = 1e-2  # relative to the largest magnitude: bf16 operands, fp32 products, against fp32 throughout


@I.ir_module
class ScaledAttention:
    @R.function
    def main(q: R.Tensor((1, 16, 2, 8), "float32"), k: R.Tensor((1, 16, 2, 8), "float32")):
        with R.dataflow():
            scaled_q = R.multiply(q, R.const(0.5, "float32"))
            scaled_k = R.multiply(R.const(0.25, "float32"), k)  # the constant first
            heads_q = R.permute_dims(scaled_q, axes=[0, 2, 1, 3])
            keys = R.permute_dims(scaled_k, axes=[0, 2, 3, 1])
            narrow_keys = R.astype(keys, "bfloat16")
            gv = R.matmul(R.astype(heads_q, "bfloat16"), narrow_keys, out_dtype="float32")
            R.output(gv)
        return gv


def test_both_scales_move_past_the_casts_and_transposes_to_the_product():
    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((1, 16, 2, 8), "float32"), k: R.Tensor((1, 16, 2, 8), "float32")):
            with R.dataflow():
                heads_q = R.permute_dims(q, axes=[0, 2, 1, 3])
                narrow_q = R.astype(heads_q, "bfloat16")
                keys = R.permute_dims(k, axes=[0, 2, 3, 1])
                narrow_keys = R.astype(keys, "bfloat16")
                product = R.matmul(narrow_q, narrow_keys, out_dtype="float32")
                gv = R.multiply(product, R.const(0.125, "float32"))
                R.output(gv)
            return gv

    assert_transforms(ScalesAfterMatmuls(), ScaledAttention, Expected)


@I.ir_module
class DividedKeys:
    """DeBERTa's attention as AMP leaves it: bf16 keys widened, divided by a scale in fp32, rounded back."""
    @R.function
    def main(q: R.Tensor((1, 2, 16, 8), "bfloat16"), k: R.Tensor((1, 16, 2, 8), "bfloat16")):
        with R.dataflow():
            wide = R.astype(k, "float32")
            divided = R.divide(wide, R.const(13.875, "float32"))
            narrow = R.astype(divided, "bfloat16")
            keys = R.permute_dims(narrow, axes=[0, 2, 3, 1])
            gv = R.matmul(q, keys, out_dtype="float32")
            R.output(gv)
        return gv


def test_a_division_by_a_constant_moves_to_the_product_as_its_reciprocal():
    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((1, 2, 16, 8), "bfloat16"), k: R.Tensor((1, 16, 2, 8), "bfloat16")):
            with R.dataflow():
                wide = R.astype(k, "float32")
                narrow = R.astype(wide, "bfloat16")
                keys = R.permute_dims(narrow, axes=[0, 2, 3, 1])
                product = R.matmul(q, keys, out_dtype="float32")
                gv = R.multiply(product, R.const(1 / 13.875, "float32"))
                R.output(gv)
            return gv

    assert_transforms(ScalesAfterMatmuls(), DividedKeys, Expected)


def test_the_built_divided_keys_scores_match_numpy():
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for shape in ((1, 2, 16, 8), (1, 16, 2, 8)))
    got = run_executable(build(DividedKeys, relay_amp.targets.host_preset()), [q, k])[0]
    expected = q.astype("float32") @ (k.astype("float32").transpose(0, 2, 3, 1) / 13.875)
    assert np.abs(got - expected).max() <= TOLERANCE * np.abs(expected).max()


def test_a_scale_before_a_move_other_ops_read_stays_where_it_is():
    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((2, 8), "float32"), k: R.Tensor((8, 2), "float32")):
            with R.dataflow():
                scaled = R.multiply(q, R.const(0.5, "float32"))
                moved = R.reshape(scaled, R.shape([2, 8]))
                product = R.matmul(moved, k)
                gv = (product, moved)
                R.output(gv)
            return gv

    assert_transforms(ScalesAfterMatmuls(), Before, Before)


def test_a_scale_by_a_tensor_or_of_integer_codes_or_a_constant_divided_by_the_operand_is_left():
    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((2, 8), "float32"), s: R.Tensor((2, 8), "float32"), a: R.Tensor((2, 8), "int8"),
                 b: R.Tensor((8, 2), "int8")):
            with R.dataflow():
                by_tensor = R.matmul(R.multiply(q, s), R.permute_dims(q, axes=[1, 0]))
                codes = R.matmul(R.multiply(a, R.const(2, "int8")), b, out_dtype="int32")
                reciprocal = R.matmul(R.divide(R.const(2.0, "float32"), q), R.permute_dims(q, axes=[1, 0]))
                gv = (by_tensor, codes, reciprocal)
                R.output(gv)
            return gv

    assert_transforms(ScalesAfterMatmuls(), Before, Before)


def test_a_scale_is_a_float_constant_of_one_value_of_any_rank():
    assert scalar(tvm.relax.const(np.full((1, 1), 0.5, "float32"))) == 0.5
    assert scalar(tvm.relax.const(np.ones(2, "float32"))) is None
    assert scalar(tvm.relax.Var("x", tvm.relax.TensorType((), "float32"))) is None


def test_the_built_bf16_attention_scores_match_fp32():
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 16, 2, 8)).astype("float32") for _ in range(2))
    got = run_executable(build(ScaledAttention, relay_amp.targets.host_preset()), [q, k])[0]
    expected = (q.transpose(0, 2, 1, 3) * 0.5) @ (k.transpose(0, 2, 3, 1) * 0.25)
    assert np.abs(got - expected).max() <= TOLERANCE * np.abs(expected).max()


def test_the_cpu_pipeline_gives_the_scale_to_the_kernel():
    names = prepared_function_names(ScaledAttention)
    assert any(name.startswith("relay_amp_dot_kernel") for name in names)
    assert not [name for name in names if "multiply" in name], names
