"""BooleanComparisons: equal and not_equal of bool tensors as logical ops, which LLVM compiles once vectorized."""

import numpy as np
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.passes.booleans import BooleanComparisons
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms


def test_compares_with_constants_become_the_tensor_or_its_negation_and_of_two_tensors_an_exclusive_or():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((4, 8), "bool"), b: R.Tensor((4, 8), "bool")) -> R.Tensor((4, 8), "bool"):
            with R.dataflow():
                same = R.equal(a, R.const(True, "bool"))
                flipped = R.equal(R.const(False, "bool"), b)
                kept = R.not_equal(a, R.const(False, "bool"))
                negated = R.not_equal(b, R.const(True, "bool"))
                alike = R.equal(same, flipped)
                unlike = R.not_equal(kept, negated)
                gv = R.logical_and(alike, unlike)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((4, 8), "bool"), b: R.Tensor((4, 8), "bool")) -> R.Tensor((4, 8), "bool"):
            with R.dataflow():
                same = a
                flipped = R.logical_not(b)
                kept = a
                negated = R.logical_not(b)
                alike = R.logical_not(R.logical_xor(same, flipped))
                unlike = R.logical_xor(kept, negated)
                gv = R.logical_and(alike, unlike)
                R.output(gv)
            return gv

    assert_transforms(BooleanComparisons(), Before, Expected)


def test_a_constant_that_broadcasts_keeps_the_result_shape_and_other_compares_are_left_alone():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((1, 8), "bool"), x: R.Tensor((4, 8), "float32")) -> R.Tensor((1, 4, 8), "bool"):
            with R.dataflow():
                deeper = R.equal(a, R.const(np.ones((1, 1, 1), "bool")))
                wide = R.equal(a, R.const(np.ones((4, 1), "bool")))
                floats = R.equal(x, R.const(1.0, "float32"))
                gv = R.logical_or(R.broadcast_to(R.equal(a, R.const(True, "bool")), R.shape([4, 8])), floats)
                gv2 = R.logical_and(deeper, R.logical_and(gv, wide))
                R.output(gv2)
            return gv2

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((1, 8), "bool"), x: R.Tensor((4, 8), "float32")) -> R.Tensor((1, 4, 8), "bool"):
            with R.dataflow():
                deeper = R.broadcast_to(a, R.shape([1, 1, 8]))
                wide = R.logical_not(R.logical_xor(a, R.const(np.ones((4, 1), "bool"))))
                floats = R.equal(x, R.const(1.0, "float32"))
                kept = a
                gv = R.logical_or(R.broadcast_to(kept, R.shape([4, 8])), floats)
                gv2 = R.logical_and(deeper, R.logical_and(gv, wide))
                R.output(gv2)
            return gv2

    assert_transforms(BooleanComparisons(), Before, Expected)


def _compares() -> "relax.Function":
    """where() chains over the four kinds of bool compares, of 64-element vectors (a vectorized loop)."""
    builder = relax.BlockBuilder()
    x, y = relax.Var("x", relax.TensorType((64,), "float32")), relax.Var("y", relax.TensorType((64,), "float32"))
    with builder.function("main", [x, y]):
        with builder.dataflow():
            a = builder.emit(relax.op.less(x, relax.const(0.0)))
            b = builder.emit(relax.op.less(y, relax.const(0.0)))
            chosen = relax.op.where(relax.op.not_equal(relax.const(True, "bool"), b), relax.op.negative(x), y)
            chosen = relax.op.where(relax.op.equal(a, b), y, chosen)
            chosen = relax.op.where(relax.op.not_equal(a, b), x, chosen)
            out = builder.emit_output(relax.op.where(relax.op.equal(a, relax.const(True, "bool")), x, chosen))
        builder.emit_func_output(out)
    return builder.get()


def test_bool_compares_build_for_every_cpu_target_and_compute_numpy_s_values():
    """Before, LLVM refused the vectorized compare ("Invalid operand types for FCmp instruction")."""
    x, y = np.random.default_rng(0).standard_normal((2, 64)).astype("float32")
    a, b = x < 0, y < 0
    chosen = np.where(np.not_equal(True, b), -x, y)
    chosen = np.where(a == b, y, chosen)
    chosen = np.where(a != b, x, chosen)
    expected = np.where(a == True, x, chosen)  # noqa: E712 (the compare under test)
    for target in ("cpu", relay_amp.targets.host_preset()):
        np.testing.assert_array_equal(run_executable(relay_amp.build(_compares(), target), [x, y])[0], expected)
