"""EliminateRedundantCasts: one Before/Expected pair per rule."""

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp

from pass_checks import assert_transforms


def check(before: tvm.IRModule, expected: tvm.IRModule) -> None:
    assert_transforms(relay_amp.transform.EliminateRedundantCasts(), before, expected)


def test_same_dtype_cast_is_removed():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            with R.dataflow():
                a = R.astype(x, "float32")
                gv = R.nn.relu(a)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            with R.dataflow():
                gv = R.nn.relu(x)
                R.output(gv)
            return gv

    check(Before, Expected)


def test_duplicate_casts_of_one_tensor_are_merged():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float16"):
            with R.dataflow():
                a = R.astype(x, "float16")
                b = R.astype(x, "float16")
                gv = R.add(a, b)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float16"):
            with R.dataflow():
                a = R.astype(x, "float16")
                gv = R.add(a, a)
                R.output(gv)
            return gv

    check(Before, Expected)


def test_float_round_trip_folds_back_to_the_source():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4,), "float16")) -> R.Tensor((4,), "float16"):
            with R.dataflow():
                up = R.astype(x, "float32")
                down = R.astype(up, "bfloat16")
                back = R.astype(down, "float16")
                gv = R.nn.relu(back)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4,), "float16")) -> R.Tensor((4,), "float16"):
            with R.dataflow():
                up = R.astype(x, "float32")
                down = R.astype(up, "bfloat16")
                back = R.astype(down, "float16")
                gv = R.nn.relu(back)
                R.output(gv)
            return gv

    # bf16 -> f16 is not a round trip back to x's dtype through one cast: nothing to fold
    check(Before, Expected)

    @I.ir_module
    class RoundTrip:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            with R.dataflow():
                low = R.astype(x, "float16")
                back = R.astype(low, "float32")
                gv = R.nn.relu(back)
                R.output(gv)
            return gv

    @I.ir_module
    class Folded:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            with R.dataflow():
                gv = R.nn.relu(x)
                R.output(gv)
            return gv

    check(RoundTrip, Folded)


def test_an_exact_round_trip_across_reshapes_and_transposes_folds_to_the_moves_of_the_source():
    """A bf16 input AMP widened, moved in fp32, then narrowed for a bf16 matmul (a decoder's cross-attention keys
    with bf16 I/O): the moves apply to the input itself. A narrowing first (fp32 -> bf16 -> fp32) is not exact
    across moves and stays."""
    @I.ir_module
    class Before:
        @R.function
        def main(keys: R.Tensor((1, 2, 6, 4), "bfloat16"), x: R.Tensor((2, 6), "float32")):
            with R.dataflow():
                wide = R.astype(keys, "float32")
                flat = R.reshape(wide, R.shape([2, 6, 4]))
                moved = R.permute_dims(flat, axes=[0, 2, 1])
                narrow = R.astype(moved, "bfloat16")
                low = R.astype(x, "bfloat16")
                flat_x = R.reshape(low, R.shape([12]))
                kept = R.astype(flat_x, "float32")
                gv = (narrow, kept)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(keys: R.Tensor((1, 2, 6, 4), "bfloat16"), x: R.Tensor((2, 6), "float32")):
            with R.dataflow():
                flat = R.reshape(keys, R.shape([2, 6, 4]))
                narrow = R.permute_dims(flat, axes=[0, 2, 1])
                low = R.astype(x, "bfloat16")
                flat_x = R.reshape(low, R.shape([12]))
                kept = R.astype(flat_x, "float32")
                gv = (narrow, kept)
                R.output(gv)
            return gv

    check(Before, Expected)


def test_integer_round_trip_is_kept():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            with R.dataflow():
                q = R.astype(x, "int8")
                gv = R.astype(q, "float32")
                R.output(gv)
            return gv

    check(Before, Before)


def test_cast_of_a_constant_is_folded():
    def module(cast: bool) -> tvm.IRModule:
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((3,), "float16"))
        values = np.array([0.5, -1.25, 3.0], "float32")
        with bb.function("main", [x]):
            with bb.dataflow():
                if cast:
                    c = bb.emit(relax.op.astype(relax.const(values), "float16"))
                else:
                    c = relax.const(values.astype("float16"))
                out = bb.emit_output(relax.op.add(x, c))
            bb.emit_func_output(out)
        return bb.get()

    check(module(cast=True), module(cast=False))


TABLE = np.random.default_rng(0).standard_normal((4, 3, 5)).astype("float32")


def _gathered_then_cast(gather, twice: bool = False) -> tvm.IRModule:
    """main(index) = bf16(gather(TABLE, index)) (and the fp32 rows too where `twice`)."""
    bb = relax.BlockBuilder()
    index = relax.Var("index", relax.TensorType((2, 1), "int64"))
    with bb.function("main", [index]):
        with bb.dataflow():
            rows = bb.emit(gather(relax.const(TABLE), index))
            out = bb.emit(relax.op.astype(rows, "bfloat16"))
            out = bb.emit_output(relax.Tuple([out, rows]) if twice else out)
        bb.emit_func_output(out)
    return bb.get()


def _gathered_cast_table(gather) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    index = relax.Var("index", relax.TensorType((2, 1), "int64"))
    with bb.function("main", [index]):
        with bb.dataflow():
            out = bb.emit_output(gather(relay_amp._ir.cast_constant(relax.const(TABLE), "bfloat16"), index))
        bb.emit_func_output(out)
    return bb.get()


def test_a_cast_of_gathered_constant_rows_gathers_from_the_cast_constant():
    """GatherND (a mixture of experts' weights gathered per routed row) and take (an embedding's rows) copy values,
    so their cast is the gather of the constant cast offline: the gather moves half the bytes in bf16."""
    for gather in (lambda table, index: relax.op.gather_nd(table, index),
                   lambda table, index: relax.op.take(table, relax.op.reshape(index, [2]), axis=0)):
        check(_gathered_then_cast(gather), _gathered_cast_table(gather))


def test_gathered_rows_read_in_fp32_too_keep_their_cast():
    """Another reader of the fp32 rows: the table would be gathered twice and held in both dtypes."""
    before = _gathered_then_cast(lambda table, index: relax.op.gather_nd(table, index), twice=True)
    after = relay_amp.transform.EliminateRedundantCasts()(before)
    assert after["main"].script().count("R.gather_nd(") == 1 and "R.astype(" in after["main"].script()


def test_rows_gathered_from_the_cast_constant_equal_the_cast_rows():
    """Built and run: the folded module's bf16 rows are exactly the original's."""
    before = _gathered_then_cast(lambda table, index: relax.op.gather_nd(table, index))
    index = np.array([[3], [1]], "int64")
    folded = relay_amp.transform.EliminateRedundantCasts()(before)
    np.testing.assert_array_equal(relay_amp.run(folded, [index])[0], relay_amp.run(before, [index])[0])
