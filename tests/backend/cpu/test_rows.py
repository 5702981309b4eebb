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
