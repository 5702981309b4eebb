"""rows: softmax rows off whole vectors are padded with the lowest value and sliced back, to the same result."""

import ml_dtypes
import numpy as np
import pytest
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_amp.backend.cpu import rows
from relay_amp.compile.build import build
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor
from pass_checks import assert_transforms

TOLERANCE = 1e-6  # relative to the output's largest magnitude: fp32 exp and sums over the same values


def test_a_softmax_over_33_columns_is_padded_to_48_and_sliced():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 5, 33), "float32")) -> R.Tensor((2, 5, 33), "float32"):
            with R.dataflow():
                gv = R.nn.softmax(x, axis=-1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 5, 33), "float32")) -> R.Tensor((2, 5, 33), "float32"):
            with R.dataflow():
                padded = R.nn.pad(x, [0, 0, 0, 0, 0, 15], pad_value=float(np.finfo("float32").min))
                row = R.nn.softmax(padded, axis=-1)
                gv = R.strided_slice(row, axes=[2], begin=[0], end=[33])
                R.output(gv)
            return gv

    assert_transforms(rows.PadSoftmaxRows(), Before, Expected)


@pytest.mark.parametrize("module", [
    single_output_module(relax.op.nn.softmax, tensor("x", (4, 32))),  # whole vectors already
    single_output_module(relax.op.nn.softmax, tensor("x", (4, 9))),  # shorter than one vector
    single_output_module(lambda x: relax.op.nn.softmax(x, axis=0), tensor("x", (33, 4))),  # not the last axis
], ids=["whole_vectors", "short_rows", "first_axis"])
def test_rows_that_need_no_padding_are_left_alone(module):
    assert_transforms(rows.PadSoftmaxRows(), module, module)


def test_the_lowest_value_is_the_dtypes_most_negative_finite_one():
    assert rows.lowest("float16") == -65504.0
    assert rows.lowest("bfloat16") == float(ml_dtypes.finfo(ml_dtypes.bfloat16).min)


@pytest.mark.parametrize("op", [relax.op.nn.softmax, relax.op.nn.log_softmax], ids=["softmax", "log_softmax"])
def test_built_padded_rows_match_numpy(op):
    x = np.random.default_rng(0).standard_normal((3, 6, 197)).astype("float32") * 4
    got = run_executable(build(single_output_module(op, tensor("x", x.shape)), "cpu"), [x])[0]
    shifted = x - x.max(axis=-1, keepdims=True)
    log_share = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    expected = log_share if op is relax.op.nn.log_softmax else np.exp(log_share)
    assert np.abs(got - expected).max() <= TOLERANCE * np.abs(expected).max()


def test_a_matmul_of_the_sliced_softmax_reads_the_padded_rows():
    """Attention's P.V after AMP: the matmul takes the 48 padded columns (zeros past 33) and V gets 15 zero rows."""
    @I.ir_module
    class Before:
        @R.function
        def main(s: R.Tensor((2, 5, 33), "float32"), v: R.Tensor((2, 33, 8), "bfloat16")):
            with R.dataflow():
                p = R.nn.softmax(s, axis=-1)
                gv = R.matmul(R.astype(p, "bfloat16"), v, out_dtype="float32")
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(s: R.Tensor((2, 5, 33), "float32"), v: R.Tensor((2, 33, 8), "bfloat16")):
            with R.dataflow():
                padded = R.nn.pad(s, [0, 0, 0, 0, 0, 15], pad_value=float(np.finfo("float32").min))
                row = R.nn.softmax(padded, axis=-1)
                p = R.strided_slice(row, axes=[2], begin=[0], end=[33])
                _dead_cast = R.astype(p, "bfloat16")  # left for DCE, as the pass leaves it
                wide = R.astype(row, "bfloat16")
                zero_rows = R.nn.pad(v, [0, 0, 0, 15, 0, 0])
                gv = R.matmul(wide, zero_rows, out_dtype="float32")
                R.output(gv)
            return gv

    assert_transforms(rows.PadSoftmaxRows(), Before, Expected)


def test_a_log_softmax_slice_keeps_its_matmul():
    """log-softmax's padded columns are not zeros: its matmul reads the slice."""
    x, v = tensor("x", (2, 5, 33)), tensor("v", (2, 33, 8))
    before = single_output_module(lambda a, b: relax.op.matmul(relax.op.nn.log_softmax(a), b), x, v)
    after = rows.PadSoftmaxRows()(before)
    (matmul,) = [b.value for b in after["main"].body.blocks[0].bindings if b.value.op.name == "relax.matmul"]
    assert tuple(matmul.args[0].ty.shape) == (2, 5, 33)


def test_built_attention_over_padded_rows_matches_numpy():
    rng = np.random.default_rng(1)
    scores, values = rng.standard_normal((6, 197, 197)).astype("float32") * 4, rng.standard_normal((6, 197, 64))
    mod = single_output_module(lambda s, v: relax.op.matmul(relax.op.nn.softmax(s), v),
                               tensor("s", scores.shape), tensor("v", values.shape))
    got = run_executable(build(mod, "cpu"), [scores, values.astype("float32")])[0]
    shares = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = (shares / shares.sum(axis=-1, keepdims=True)) @ values
    assert np.abs(got - expected).max() <= TOLERANCE * 10 * np.abs(expected).max()  # also the 197-term sums


def test_a_nan_guard_of_the_sliced_softmax_runs_on_the_padded_rows_and_its_matmul_reads_them():
    """torch's scaled_dot_product_attention as exporters spell it: where(isnan(p), 0, p) between the softmax and
    P.V. The guard now runs on the 48 padded columns (a padded 0 stays 0), and the matmul reads them."""
    @I.ir_module
    class Before:
        @R.function
        def main(s: R.Tensor((2, 5, 33), "float32"), v: R.Tensor((2, 33, 8), "bfloat16")):
            with R.dataflow():
                p = R.nn.softmax(s, axis=-1)
                guarded = R.where(R.isnan(p), R.const(0.0, "float32"), p)
                gv = R.matmul(R.astype(guarded, "bfloat16"), v, out_dtype="float32")
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(s: R.Tensor((2, 5, 33), "float32"), v: R.Tensor((2, 33, 8), "bfloat16")):
            with R.dataflow():
                padded = R.nn.pad(s, [0, 0, 0, 0, 0, 15], pad_value=float(np.finfo("float32").min))
                row = R.nn.softmax(padded, axis=-1)
                p = R.strided_slice(row, axes=[2], begin=[0], end=[33])
                _dead_test = R.isnan(p)  # left for DCE, as the pass leaves it
                guarded_rows = R.where(R.isnan(row), R.const(0.0, "float32"), row)
                guarded = R.strided_slice(guarded_rows, axes=[2], begin=[0], end=[33])
                _dead_cast = R.astype(guarded, "bfloat16")
                wide = R.astype(guarded_rows, "bfloat16")
                zero_rows = R.nn.pad(v, [0, 0, 0, 15, 0, 0])
                gv = R.matmul(wide, zero_rows, out_dtype="float32")
                R.output(gv)
            return gv

    assert_transforms(rows.PadSoftmaxRows(), Before, Expected)


@pytest.mark.parametrize("other", [tensor("other", (2, 5, 33)), relax.const(1.0, "float32")],
                         ids=["a_tensor_of_the_rows_shape", "a_nonzero_constant"])
def test_a_guard_by_anything_but_zero_keeps_its_slice(other):
    """A where whose other value has the sliced shape cannot run on the padded rows, and one by 1 would give a fully
    masked row 0 padded (the padded columns take the row) where it gives 1 unpadded: both read the slice."""
    def guarded(x, *others):
        p = relax.op.nn.softmax(x)
        return relax.op.where(relax.op.isnan(p), others[0] if others else other, p)
    params = [tensor("x", (2, 5, 33))] + ([other] if isinstance(other, relax.Var) else [])
    after = rows.PadSoftmaxRows()(single_output_module(guarded, *params))
    (where,) = [b.value for b in after["main"].body.blocks[0].bindings if b.value.op.name == "relax.where"]
    assert tuple(where.ty.shape) == (2, 5, 33)


def test_built_nan_guarded_attention_over_padded_rows_matches_numpy():
    """A fully masked row (all -inf) is NaN in the softmax, which the guard makes 0; other rows are attention's."""
    rng = np.random.default_rng(2)
    scores, values = rng.standard_normal((2, 37, 37)).astype("float32") * 4, rng.standard_normal((2, 37, 16))
    scores[0, 3] = -np.inf

    def attention(s, v):
        p = relax.op.nn.softmax(s)
        return relax.op.matmul(relax.op.where(relax.op.isnan(p), relax.const(0.0, "float32"), p), v)
    mod = single_output_module(attention, tensor("s", scores.shape), tensor("v", values.shape))
    got = run_executable(build(mod, "cpu"), [scores, values.astype("float32")])[0]
    with np.errstate(invalid="ignore"):
        shares = np.exp(scores - scores.max(axis=-1, keepdims=True))
        expected = np.nan_to_num(shares / shares.sum(axis=-1, keepdims=True)) @ values
    assert np.abs(got - expected).max() <= TOLERANCE * 10 * np.abs(expected).max()
    np.testing.assert_array_equal(got[0, 3], 0.0)
