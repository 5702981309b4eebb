"""HoistOverMoves: narrowing casts and scalar ops move before reshapes and transposes; numerics unchanged."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.passes.moves import HoistOverMoves

from pass_checks import assert_transforms


@I.ir_module
class Heads:  # attention's query: a projection split into heads, scaled, then cast by AMP
    @R.function
    def main(x: R.Tensor((1, 8, 16), "float32")) -> R.Tensor((1, 2, 8, 8), "bfloat16"):
        with R.dataflow():
            split = R.reshape(x, R.shape([1, 8, 2, 8]))
            heads = R.permute_dims(split, axes=[0, 2, 1, 3])
            scaled = R.multiply(heads, R.const(0.125, "float32"))
            gv = R.astype(scaled, "bfloat16")
            R.output(gv)
        return gv


def test_a_scale_and_a_cast_move_before_the_heads_split():
    """Also reachable as relay_amp.transform.HoistOverMoves and relay_amp.hoist_over_moves."""
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8, 16), "float32")) -> R.Tensor((1, 2, 8, 8), "bfloat16"):
            with R.dataflow():
                scaled = R.multiply(x, R.const(0.125, "float32"))
                narrow = R.astype(scaled, "bfloat16")
                split = R.reshape(narrow, R.shape([1, 8, 2, 8]))
                gv = R.permute_dims(split, axes=[0, 2, 1, 3])
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Heads, Expected)
    assert_transforms(relay_amp.transform.HoistOverMoves(), Heads, Expected)
    assert_transforms(relay_amp.hoist_over_moves, Heads, Expected)


def test_the_values_do_not_change():
    x = np.random.default_rng(0).standard_normal((1, 8, 16)).astype("float32")
    before = relay_amp.run(Heads, [x])[0]
    after = relay_amp.run(HoistOverMoves()(Heads), [x])[0]
    assert before.dtype == after.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(before.astype("float32"), after.astype("float32"))  # exact: same ops, same values


@pytest.mark.parametrize("reason,op", [
    ("a widening cast would make the moves carry more bytes", lambda t: R.astype(t, "float64")),
    ("a tensor operand is not a scalar", lambda t: R.add(t, t)),
    ("a reduction is not elementwise", lambda t: R.sum(t, axis=[3])),
    ("a move something else reads too stays where it is", lambda t: (R.astype(t, "bfloat16"), t)),
])
def test_ops_that_cannot_move_stay(reason, op):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 8, 16), "float32")):
            with R.dataflow():
                heads = R.permute_dims(R.reshape(x, R.shape([1, 8, 2, 8])), axes=[0, 2, 1, 3])
                gv = op(heads)
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Before, Before)


def test_a_function_the_module_lacks_is_a_module_error():
    with pytest.raises(relay_amp.ModuleError, match="forward"):
        HoistOverMoves(func="forward")(Heads)


def test_the_cpu_pipeline_hoists_before_epilogue_fusion():
    names = [p.info.name for p in relay_amp.backend.cpu.pipeline.prepare_passes(
        relay_amp.targets.get_target("cpu-avx512-bf16")).passes]
    assert names.index("relay_amp.HoistOverMoves") < names.index("relay_amp.FuseKernelEpilogues")


def _groups(outputs):
    """A mixed conv's channel groups (MixNet), each cast by AMP for its own bf16 conv; `outputs(a, b, second)` makes
    the function's result from the two casts and the second group."""
    @I.ir_module
    class Groups:
        @R.function
        def main(x: R.Tensor((1, 4, 4, 24), "float32")):
            with R.dataflow():
                parts = R.split(x, indices_or_sections=[8], axis=3)
                first = parts[0]
                second = parts[1]
                a = R.astype(first, "bfloat16")
                b = R.astype(second, "bfloat16")
                gv = outputs(a, b, second)
                R.output(gv)
            return gv

    return Groups


Groups = _groups(lambda a, b, second: (a, b))


def test_casts_of_every_output_of_a_split_become_one_cast_before_it():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 4, 24), "float32")):
            with R.dataflow():
                narrow = R.astype(x, "bfloat16")
                parts = R.split(narrow, indices_or_sections=[8], axis=3)
                a = parts[0]
                b = parts[1]
                gv = (a, b)
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Groups, Expected)
    x = np.random.default_rng(1).standard_normal((1, 4, 4, 24)).astype("float32")
    for before, after in zip(relay_amp.run(Groups, [x]), relay_amp.run(HoistOverMoves()(Groups), [x])):
        np.testing.assert_array_equal(before.astype("float32"), after.astype("float32"))


@pytest.mark.parametrize("reason,second_use", [
    ("an output read by an fp32 op keeps the split as it was", lambda t: R.add(t, t)),
    ("an output cast to another dtype too", lambda t: R.astype(t, "float16")),
])
def test_splits_with_an_output_read_otherwise_stay(reason, second_use):
    Before = _groups(lambda a, b, second: (a, b, second_use(second)))
    assert_transforms(HoistOverMoves(), Before, Before)


@I.ir_module
class Joined:  # a mixed conv's groups meeting again: AMP's activation and cast come after the concat
    @R.function
    def main(a: R.Tensor((1, 4, 4, 8), "float32"), b: R.Tensor((1, 4, 4, 16), "float32")):
        with R.dataflow():
            sliced = R.strided_slice(b, axes=[3], begin=[0], end=[12])  # a kernel's output padded to 16 channels
            joined = R.concat((a, sliced), axis=3)
            act = R.nn.relu(joined)
            gv = R.astype(act, "bfloat16")
            R.output(gv)
        return gv


def test_an_activation_and_a_cast_after_a_concat_move_into_each_part_and_before_a_padding_slice():
    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((1, 4, 4, 8), "float32"), b: R.Tensor((1, 4, 4, 16), "float32")):
            with R.dataflow():
                act_a = R.nn.relu(a)
                act_b = R.nn.relu(b)
                narrow_a = R.astype(act_a, "bfloat16")
                narrow_b = R.astype(act_b, "bfloat16")
                sliced = R.strided_slice(narrow_b, axes=[3], begin=[0], end=[12])
                gv = R.concat((narrow_a, sliced), axis=3)
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Joined, Expected)
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal(shape).astype("float32") for shape in [(1, 4, 4, 8), (1, 4, 4, 16)]]
    before, after = relay_amp.run(Joined, inputs)[0], relay_amp.run(HoistOverMoves()(Joined), inputs)[0]
    np.testing.assert_array_equal(before.astype("float32"), after.astype("float32"))  # exact: same ops per value


@pytest.mark.parametrize("reason,outputs", [
    ("the concat is read elsewhere", lambda act, joined, first: (act, joined)),
    ("a part is read elsewhere (DenseNet's features: one cast per concat reading it)",
     lambda act, joined, first: (act, first)),
])
def test_a_concat_read_elsewhere_or_with_a_part_read_elsewhere_keeps_its_ops_after_it(reason, outputs):
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((1, 4, 4, 8), "float32")):
            with R.dataflow():
                first = R.add(a, a)
                second = R.multiply(a, a)
                joined = R.concat((first, second), axis=3)
                act = R.nn.relu(joined)
                gv = outputs(act, joined, first)
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Before, Before)


@I.ir_module
class Cache:  # a decode step with bf16 I/O: the past keys widened at the input, the present cast at the output
    @R.function
    def main(past: R.Tensor((1, 2, 3, 4), "bfloat16"), new: R.Tensor((1, 2, 1, 4), "float32")):
        with R.dataflow():
            wide = R.astype(past, "float32")
            present = R.concat((wide, new), axis=2)
            keys = R.permute_dims(present, axes=[0, 1, 3, 2])
            narrow_keys = R.astype(keys, "bfloat16")
            R.output(present, narrow_keys)
        out = R.astype(present, "bfloat16")
        gv = (narrow_keys, out)
        return gv


def test_a_concat_read_only_by_narrowing_casts_is_one_narrow_concat_of_the_narrow_past():
    """The cache is concatenated in bf16, read as it came in, and only the new token is cast: no copy of the whole
    cache is widened and narrowed again each step."""
    @I.ir_module
    class Expected:
        @R.function
        def main(past: R.Tensor((1, 2, 3, 4), "bfloat16"), new: R.Tensor((1, 2, 1, 4), "float32")):
            with R.dataflow():
                narrow_new = R.astype(new, "bfloat16")
                present = R.concat((past, narrow_new), axis=2)
                narrow_keys = R.permute_dims(present, axes=[0, 1, 3, 2])
                R.output(present, narrow_keys)
            gv = (narrow_keys, present)
            return gv

    assert_transforms(tvm.transform.Sequential([HoistOverMoves(), relax.transform.CanonicalizeBindings()]), Cache,
                      Expected)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1, 2, 3, 4)).astype(ml_dtypes.bfloat16),
              rng.standard_normal((1, 2, 1, 4)).astype("float32")]
    for before, after in zip(relay_amp.run(Cache, inputs), relay_amp.run(HoistOverMoves()(Cache), inputs)):
        np.testing.assert_array_equal(before.astype("float32"), after.astype("float32"))  # exact


def test_a_cast_moved_onto_a_widened_input_takes_the_input_itself():
    """Whisper's cross-attention keys with bf16 I/O: widened at the input, transposed, narrowed for the matmul."""
    @I.ir_module
    class Before:
        @R.function
        def main(keys: R.Tensor((1, 2, 6, 4), "bfloat16")):
            with R.dataflow():
                wide = R.astype(keys, "float32")
                moved = R.permute_dims(wide, axes=[0, 1, 3, 2])
                gv = R.astype(moved, "bfloat16")
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(keys: R.Tensor((1, 2, 6, 4), "bfloat16")):
            with R.dataflow():
                gv = R.permute_dims(keys, axes=[0, 1, 3, 2])
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Before, Expected)


def test_a_concat_also_read_at_its_own_dtype_keeps_its_casts():
    @I.ir_module
    class Before:
        @R.function
        def main(past: R.Tensor((1, 2, 3, 4), "bfloat16"), new: R.Tensor((1, 2, 1, 4), "float32")):
            with R.dataflow():
                wide = R.astype(past, "float32")
                present = R.concat((wide, new), axis=2)
                narrow = R.astype(present, "bfloat16")
                gv = (present, narrow)  # an fp32 present output (AMP's keep_io_types)
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Before, Before)


def test_a_cast_after_a_slice_of_a_tensor_something_else_reads_stays_after_it():
    @I.ir_module
    class Before:
        @R.function
        def main(b: R.Tensor((1, 4, 4, 16), "float32")):
            with R.dataflow():
                sliced = R.strided_slice(b, axes=[3], begin=[0], end=[12])
                narrow = R.astype(sliced, "bfloat16")  # b is read below too: casting all of it would cost more
                gv = (narrow, b)
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Before, Before)
