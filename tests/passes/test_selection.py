"""WidenedSelections: sorts, top-k and arg-reductions of 16-bit floats computed on their fp32 widening."""

import ml_dtypes
import numpy as np
import pytest
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.passes.selection import WidenedSelections
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms


def test_a_bf16_top_k_runs_on_fp32_and_casts_its_values_back():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8), "bfloat16")) -> R.Tuple(R.Tensor((2, 3), "bfloat16"), R.Tensor((2, 3), "int64")):
            with R.dataflow():
                gv = R.topk(x, k=3, axis=-1, ret_type="both", largest=True, dtype="int64")
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 8), "bfloat16")) -> R.Tuple(R.Tensor((2, 3), "bfloat16"), R.Tensor((2, 3), "int64")):
            with R.dataflow():
                wide = R.astype(x, "float32")
                both = R.topk(wide, k=3, axis=-1, ret_type="both", largest=True, dtype="int64")
                values = both[0]
                narrow = R.astype(values, "bfloat16")
                indices = both[1]
                gv = (narrow, indices)
                R.output(gv)
            return gv

    assert_transforms(WidenedSelections(), Before, Expected)


def test_fp32_selections_are_left_alone():
    @I.ir_module
    class Kept:
        @R.function
        def main(x: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8), "float32"):
            with R.dataflow():
                gv = R.sort(x, axis=-1)
                R.output(gv)
            return gv

    assert_transforms(WidenedSelections(), Kept, Kept)


SELECTIONS = {  # name: (relax op over a bf16 tensor, numpy reference over its fp32 values)
    "topk values": (lambda x: relax.TupleGetItem(relax.op.topk(x, k=20, axis=-1), 0),
                    lambda x: -np.sort(-x, axis=-1)[:, :20]),
    "topk indices": (lambda x: relax.TupleGetItem(relax.op.topk(x, k=20, axis=-1), 1),
                     lambda x: np.argsort(-x, axis=-1, kind="stable")[:, :20]),
    "sort": (lambda x: relax.op.sort(x, axis=-1), lambda x: np.sort(x, axis=-1)),
    "argsort": (lambda x: relax.op.argsort(x, axis=-1), lambda x: np.argsort(x, axis=-1, kind="stable")),
    "argmax": (lambda x: relax.op.argmax(x, axis=-1), lambda x: np.argmax(x, axis=-1)),
    "argmin": (lambda x: relax.op.argmin(x, axis=-1), lambda x: np.argmin(x, axis=-1)),
}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_bf16_selections_build_for_the_cpu_and_match_numpy(name):
    """TVM's topk and argsort of bf16 returned wrong values and indices, its sort wrote past its buffer (the process
    aborted), its argmax and argmin did not compile."""
    op, reference = SELECTIONS[name]
    x = relax.Var("x", relax.TensorType((4, 300), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            selected = builder.emit(op(builder.emit(relax.op.astype(x, "bfloat16"))))
            if str(selected.ty.dtype) == "bfloat16":
                selected = builder.emit(relax.op.astype(selected, "float32"))
            output = builder.emit_output(selected)
        builder.emit_func_output(output)
    bits = np.random.default_rng(0).permutation(1200).astype("uint16") + np.uint16(0x3F80)  # bf16 from 1.0 up
    values = bits.view(ml_dtypes.bfloat16).astype("float32").reshape(4, 300)  # distinct, and exact in bf16
    got = run_executable(relay_amp.build(builder.get(), "cpu"), [values])[0]
    np.testing.assert_array_equal(got, reference(values))
