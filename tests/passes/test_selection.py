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
                indices = both[1]
                narrow = R.astype(values, "bfloat16")
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


def test_a_bf16_non_max_suppression_keeps_the_boxes_fp32_does():
    """TVM's non-max suppression read bf16 boxes and scores as fp32 and kept the wrong boxes."""
    rng = np.random.default_rng(0)
    corners = rng.integers(0, 50, (1, 30, 2)).astype("float32")
    boxes = np.concatenate([corners, corners + rng.integers(10, 30, (1, 30, 2))], -1).astype("float32")
    scores = (rng.permutation(60).reshape(1, 2, 30).astype("float32") + 1) / 64  # distinct, exact in bf16
    kept = {}
    for dtype in ("float32", "bfloat16"):
        box_var, score_var = (relax.Var(name, relax.TensorType(value.shape, "float32"))
                              for name, value in (("boxes", boxes), ("scores", scores)))
        builder = relax.BlockBuilder()
        with builder.function("main", [box_var, score_var]):
            with builder.dataflow():
                selected = builder.emit(relax.op.vision.all_class_non_max_suppression(
                    relax.op.astype(box_var, dtype), relax.op.astype(score_var, dtype),
                    relax.const(np.array(10, "int64")), relax.const(np.array(0.3, "float32")),
                    relax.const(np.array(0.05, "float32")), "onnx"))
                output = builder.emit_output(relax.TupleGetItem(selected, 0))
            builder.emit_func_output(output)
        kept[dtype] = run_executable(relay_amp.build(builder.get(), "cpu"), [boxes, scores])[0]
    np.testing.assert_array_equal(kept["bfloat16"], kept["float32"])


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
