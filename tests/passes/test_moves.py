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
from relay_amp.runtime import run_executable

from builders import timm_through_onnx
from pass_checks import assert_transforms, prepared_calls


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


@I.ir_module
class Inception:  # two branches' ReLU outputs concatenated; the next block quantizes the concat and its max pool
    @R.function
    def main(a: R.Tensor((1, 6, 6, 8), "float32"), b: R.Tensor((1, 6, 6, 16), "float32")):
        with R.dataflow():
            joined = R.concat((R.nn.relu(a), R.nn.relu(b)), axis=3)
            scaled = R.multiply(joined, R.const(20.0, "float32"))
            codes = R.astype(R.minimum(R.maximum(R.add(scaled, R.const(0.5, "float32")), R.const(0.0, "float32")),
                                       R.const(255.0, "float32")), "uint8")
            pooled = R.nn.max_pool2d(joined, pool_size=[3, 3], padding=[1, 1, 1, 1], layout="NHWC")
            pool_scaled = R.multiply(pooled, R.const(20.0, "float32"))
            pool_codes = R.astype(R.minimum(R.maximum(R.add(pool_scaled, R.const(0.5, "float32")),
                                                      R.const(0.0, "float32")), R.const(255.0, "float32")), "uint8")
            gv = (codes, pool_codes)
            R.output(gv)
        return gv


def test_quantized_codes_move_before_a_max_pool_and_into_the_parts_of_a_concat():
    """Each branch computes its codes (in its kernel's epilogue, once the pipeline fuses it), and the concat and the
    pool move bytes; the pool's copy of the codes and the concat's readers' are one."""
    scale, half, zero, top = (relax.const(value, "float32") for value in (20.0, 0.5, 0.0, 255.0))

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((1, 6, 6, 8), "float32"), b: R.Tensor((1, 6, 6, 16), "float32")):
            with R.dataflow():
                act_a, act_b = R.nn.relu(a), R.nn.relu(b)
                scaled_a, scaled_b = R.multiply(act_a, scale), R.multiply(act_b, scale)  # one op a round, each part
                shifted_a, shifted_b = R.add(scaled_a, half), R.add(scaled_b, half)
                low_a, low_b = R.maximum(shifted_a, zero), R.maximum(shifted_b, zero)
                high_a, high_b = R.minimum(low_a, top), R.minimum(low_b, top)
                codes = R.concat((R.astype(high_a, "uint8"), R.astype(high_b, "uint8")), axis=3)
                pool_codes = R.nn.max_pool2d(codes, pool_size=[3, 3], padding=[1, 1, 1, 1], layout="NHWC")
                gv = (codes, pool_codes)
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Inception, Expected)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(shape).astype("float32") for shape in [(1, 6, 6, 8), (1, 6, 6, 16)]]
    before, after = relay_amp.run(Inception, inputs), relay_amp.run(HoistOverMoves()(Inception), inputs)
    for was, now in zip(before, after):
        assert now.dtype == np.uint8 and was.any()
        np.testing.assert_array_equal(was, now)  # exact: the codes commute with the moves and the pool's max


@pytest.mark.parametrize("reason,op", [
    ("SiLU decreases below -1.28: its max over a window is not the max's SiLU", R.nn.silu),
    ("a negative scale turns the window's max into its min", lambda t: R.multiply(t, R.const(-2.0, "float32"))),
    ("a constant minus the value decreases", lambda t: R.subtract(R.const(1.0, "float32"), t)),
])
def test_ops_that_decrease_stay_after_a_max_pool(reason, op):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 6, 6, 8), "float32")):
            with R.dataflow():
                gv = op(R.nn.max_pool2d(x, pool_size=[2, 2], strides=[2, 2], layout="NHWC"))
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Before, Before)


def test_a_max_pool_whose_input_something_else_reads_keeps_the_ops_after_it():
    """The pool's input would be quantized whole beside the residual add that reads it in fp32."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 6, 6, 8), "float32")):
            with R.dataflow():
                pooled = R.nn.max_pool2d(x, pool_size=[2, 2], strides=[2, 2], layout="NHWC")
                scaled = R.multiply(pooled, R.const(20.0, "float32"))
                gv = (scaled, R.add(x, x))
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Before, Before)


def _upsampled(method: str):
    @I.ir_module
    class Upsampled:  # a decoder's upsampling (U-Net, FPN), cast to bf16 by AMP for the conv after it
        @R.function
        def main(x: R.Tensor((1, 8, 4, 4), "float32")) -> R.Tensor((1, 8, 8, 8), "bfloat16"):
            with R.dataflow():
                gv = R.astype(R.image.resize2d(x, R.shape([8, 8]), method=method), "bfloat16")
                R.output(gv)
            return gv

    return Upsampled


def test_a_cast_moves_before_a_nearest_neighbour_resize_only():
    """A nearest-neighbour resize copies values: the cast goes first and the resize moves half the bytes (a quarter
    of the values cast). A linear resize computes new values, which the cast must round."""
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8, 4, 4), "float32")) -> R.Tensor((1, 8, 8, 8), "bfloat16"):
            with R.dataflow():
                gv = R.image.resize2d(R.astype(x, "bfloat16"), R.shape([8, 8]), method="nearest_neighbor")
                R.output(gv)
            return gv

    nearest = _upsampled("nearest_neighbor")
    assert_transforms(HoistOverMoves(), nearest, Expected)
    assert_transforms(HoistOverMoves(), _upsampled("linear"), _upsampled("linear"))
    x = np.random.default_rng(4).standard_normal((1, 8, 4, 4)).astype("float32")
    before, after = relay_amp.run(nearest, [x])[0], relay_amp.run(HoistOverMoves()(nearest), [x])[0]
    np.testing.assert_array_equal(before.astype("float32"), after.astype("float32"))


def test_a_csp_darknets_concats_move_quantized_codes(tmp_path):
    """timm's CSPDarkNet (cs3darknet_s: each stage splits a conv's output in halves, runs its blocks on one and
    concatenates both for a quantized 1x1 conv; written on GoogLeNet and YOLOv8n): the halves' convs share one range
    (relay_amp.passes.quantize.shared), so the codes the kernels store are split and concatenated as bytes. The build
    computes what the quantized module does. Without bias correction: this random model's logits are 1e-5 of the
    sums they come from, and with its constants the kernels' fused multiply-adds round a few codes one step from
    where the VM's separate ops do (24 of a residual's), which moves the logits by 10%."""
    _, imported, x, _ = timm_through_onnx("cs3darknet_s", tmp_path)
    rng = np.random.default_rng(0)
    quantized = relay_amp.quantize(imported, [rng.standard_normal(x.shape).astype("float32") for _ in range(4)],
                                   bias_correction=False)
    concats = prepared_calls(quantized, "concatenate")
    assert len(concats) == 4
    assert all(field.ty.dtype == "uint8" for value in concats for field in value.args[1].fields)
    got = run_executable(relay_amp.build(quantized, relay_amp.targets.host_preset()), [x])[0]
    reference = relay_amp.run(quantized, [x])[0]
    np.testing.assert_allclose(got, reference, atol=0.02 * np.abs(reference).max())  # a code's rounding apart



@I.ir_module
class LinearAttention:
    """EfficientViT's linear attention as quantize leaves it: two quantized kernels' dequantized fp32 outputs (the
    first also cast for a depthwise conv) concatenated, split into heads of query, key and value; the query and key
    ReLU'd, the value padded with ones; each cast to bf16 for its matmul."""
    @R.function
    def main(a: R.Tensor((1, 4, 4, 8), "float32"), b: R.Tensor((1, 4, 4, 16), "float32")):
        with R.dataflow():
            for_conv = R.astype(a, "bfloat16")
            joined = R.concat((a, b), axis=3)
            heads = R.reshape(joined, R.shape([1, 16, 2, 12]))
            query = R.astype(R.nn.relu(R.strided_slice(heads, axes=[3], begin=[0], end=[4])), "bfloat16")
            key = R.astype(R.permute_dims(R.nn.relu(R.strided_slice(heads, axes=[3], begin=[4], end=[8])),
                                          axes=[0, 2, 3, 1]), "bfloat16")
            value = R.astype(R.nn.pad(R.strided_slice(heads, axes=[3], begin=[8], end=[12]),
                                      pad_width=[0, 0, 0, 0, 0, 0, 0, 1], pad_value=1.0), "bfloat16")
            gv = (for_conv, query, key, value)
            R.output(gv)
        return gv


def test_casts_move_before_relus_and_exact_pads_and_into_the_parts_of_the_concat():
    """A cast to bf16 rounds to the same values before a ReLU or a pad by a value bf16 holds as after it: the three
    heads' casts meet before the slices, as one, and enter the concat's parts, one of them the cast the depthwise
    conv reads already; the kernels before them then store bf16 (EfficientViT-B0 int8q: 0.90x the time, outputs
    bit-identical on a 2-core Sapphire Rapids)."""
    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((1, 4, 4, 8), "float32"), b: R.Tensor((1, 4, 4, 16), "float32")):
            with R.dataflow():
                for_conv = R.astype(a, "bfloat16")
                joined = R.concat((for_conv, R.astype(b, "bfloat16")), axis=3)
                heads = R.reshape(joined, R.shape([1, 16, 2, 12]))
                query = R.nn.relu(R.strided_slice(heads, axes=[3], begin=[0], end=[4]))
                key = R.permute_dims(R.nn.relu(R.strided_slice(heads, axes=[3], begin=[4], end=[8])),
                                     axes=[0, 2, 3, 1])
                value = R.nn.pad(R.strided_slice(heads, axes=[3], begin=[8], end=[12]),
                                 pad_width=[0, 0, 0, 0, 0, 0, 0, 1], pad_value=1.0)
                gv = (for_conv, query, key, value)
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), LinearAttention, Expected)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, 4, 4, 8)).astype("float32"), rng.standard_normal((1, 4, 4, 16)).astype("float32")]
    for before, after in zip(relay_amp.run(LinearAttention, inputs), relay_amp.run(HoistOverMoves()(LinearAttention),
                                                                                 inputs)):
        np.testing.assert_array_equal(before.astype("float32"), after.astype("float32"))  # exact: rounding commutes


@pytest.mark.parametrize("dtype, value, mode, moves", [
    ("bfloat16", 1.0, "constant", True), ("uint8", 1.0, "constant", True),
    ("bfloat16", 0.1, "constant", False), ("uint8", 0.5, "constant", False), ("bfloat16", 0.0, "reflect", False)])
def test_a_cast_moves_before_a_pad_only_where_it_pads_with_a_value_the_cast_dtype_holds(dtype, value, mode, moves):
    """A pad of a transpose, then a cast: the cast moves before both where the pad's value is exact in its dtype
    (quantize's codes too), not before a pad by 0.1 (bf16 holds 0.10009765625) or 0.5 (in codes), nor a reflect
    pad."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((8, 4), "float32")):
            with R.dataflow():
                padded = R.nn.pad(R.permute_dims(x, axes=[1, 0]), [0, 0, 1, 1], pad_value=value, pad_mode=mode)
                gv = R.astype(padded, dtype)
                R.output(gv)
            return gv

    @I.ir_module
    class Moved:
        @R.function
        def main(x: R.Tensor((8, 4), "float32")):
            with R.dataflow():
                gv = R.nn.pad(R.permute_dims(R.astype(x, dtype), axes=[1, 0]), [0, 0, 1, 1], pad_value=value,
                              pad_mode=mode)
                R.output(gv)
            return gv

    assert_transforms(HoistOverMoves(), Before, Moved if moves else Before)
