"""quantize_weights: constant-weight matmuls read int4 weights, eight codes per uint32, with per-group scales."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import packed_int4
from relay_amp.packed_int4 import PackedSpec, PackedWeight, pack_int4, pack_nibbles, with_dequantize_kernel
from relay_amp.passes.weight_only import dense_weights, held_codes, quantize_int4, quantize_weights
from relay_amp.transform import DenseWeights, QuantizeWeights

from builders import single_output_module, tensor
from pass_checks import assert_transforms

RNG = np.random.default_rng(0)
DEPTH, COLUMNS, GROUP = 64, 32, 32
WEIGHT = RNG.standard_normal((DEPTH, COLUMNS)).astype("float32")


def _matmul_module(data_shape=(2, 3, DEPTH), weight=WEIGHT, dtype="float32") -> tvm.IRModule:
    return single_output_module(lambda x: relax.op.matmul(x, relax.const(weight)), tensor("x", data_shape, dtype))


def _dequantized(weight: np.ndarray, group: int = GROUP) -> np.ndarray:
    codes, scales = quantize_int4(weight, group)
    depth, columns = weight.shape
    return (codes.reshape(depth // group, group, columns) * scales[:, None]).reshape(depth, columns)


def test_codes_are_symmetric_per_group_and_column():
    weight = RNG.standard_normal((64, 16)).astype("float32")
    weight[:32, 3] = 0.0  # an all-zero group keeps scale 1 and codes 0
    codes, scales = quantize_int4(weight, 32)
    assert codes.min() >= -8 and codes.max() <= 7 and scales.shape == (2, 16)
    assert scales[0, 3] == 1.0 and not codes[:32, 3].any()
    np.testing.assert_array_equal(codes.reshape(2, 32, 16).min(axis=1)[scales != 1.0], -8)  # the extreme's code
    error = np.abs(_dequantized(weight, 32) - weight).reshape(2, 32, 16)
    assert (error <= np.abs(scales)[:, None] + 1e-6).all()  # half a step, a whole one where +8 clips to +7


def test_weights_onnx_runtime_quantized_come_back_as_its_codes_and_scales():
    """ONNX Runtime's symmetric int4 (GenAI's int4 LLMs): each block's value of largest magnitude is code -8."""
    codes = RNG.integers(-8, 8, (64, 16)).astype("int8")
    codes[::32] = -8
    scales = (RNG.standard_normal((2, 16)) * 0.01).astype("float32")
    weight = (codes.reshape(2, 32, 16) * scales[:, None]).reshape(64, 16).astype("float32")
    again, again_scales = quantize_int4(weight, 32)
    np.testing.assert_array_equal(again, codes)
    np.testing.assert_array_equal(again_scales, scales)


def _expected(weight: np.ndarray, spec: PackedSpec, batch: tuple, held: PackedWeight | None = None) -> tvm.IRModule:
    if held is None:
        codes, scales = quantize_int4(weight, spec.group_size)
        held = PackedWeight(pack_int4(codes), scales)
    x = tensor("x", (*batch, spec.depth), spec.data_dtype)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            rows = bb.emit(relax.op.reshape(x, (spec.rows, spec.depth)))
            gvar = bb.add_func(packed_int4.reference_kernel(spec), "relay_amp_int4_matmul")
            product = bb.emit(relax.call_tir(gvar, [rows, relax.const(held.packed), relax.const(held.scales)],
                                             relax.TensorType((spec.rows, spec.columns), spec.out_dtype)))
            out = bb.emit_output(relax.op.reshape(product, (*batch, spec.columns)))
        bb.emit_func_output(out)
    return bb.get()


def test_a_constant_weight_matmul_becomes_a_packed_kernel_call():
    before = _matmul_module()
    spec = PackedSpec(6, DEPTH, COLUMNS, GROUP, "float32", "float32")
    assert_transforms(QuantizeWeights(group_size=GROUP), before, _expected(WEIGHT, spec, (2, 3)))


def test_after_amp_the_bf16_weight_is_packed_and_the_fp32_output_kept():
    before = relay_amp.to_mixed_precision(_matmul_module(data_shape=(1, DEPTH)), "bfloat16")
    after = quantize_weights(before, group_size=GROUP)
    (func,) = [f for _, f in after.functions_items() if packed_int4.spec_of(f) is not None]
    assert packed_int4.spec_of(func) == PackedSpec(1, DEPTH, COLUMNS, GROUP, "bfloat16", "float32")


@pytest.mark.parametrize("before", [
    single_output_module(relax.op.matmul, tensor("x", (4, DEPTH)), tensor("w", (DEPTH, COLUMNS))),  # runtime weight
    _matmul_module(),  # depth 64: not in groups of the default 128 rows
    _matmul_module(weight=WEIGHT[:, :24]),  # columns off the 16-column blocks
], ids=["runtime-weight", "depth", "columns"])
def test_matmuls_it_cannot_pack_are_left_alone(before):
    assert_transforms(QuantizeWeights(), before, before)


def test_excluded_layers_are_left_alone():
    before = _matmul_module()
    assert_transforms(QuantizeWeights(group_size=GROUP, excluded_layers=[0]), before, before)


@pytest.mark.parametrize("options, error", [
    ({"dtype": "int8"}, relay_amp.DTypeError),
    ({"group_size": 12}, relay_amp.OptionError),
    ({"group_size": True}, relay_amp.OptionError),
    ({"ops": ["relax.nn.conv2d"]}, relay_amp.OptionError),
    ({"excluded_layers": [3]}, relay_amp.LayerIndexError),
])
def test_bad_options_are_relay_amp_errors_naming_them(options, error):
    with pytest.raises(error):
        quantize_weights(_matmul_module(), **options)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_equal_the_dequantized_weights_product_on_the_vm(dtype):
    mod = relay_amp.to_mixed_precision(_matmul_module(), dtype) if dtype != "float32" else _matmul_module()
    x = RNG.standard_normal((2, 3, DEPTH)).astype("float32")
    got = relay_amp.run(quantize_weights(mod, group_size=GROUP), [x])[0]
    weight = WEIGHT.astype(ml_dtypes.bfloat16).astype("float32") if dtype == "bfloat16" else WEIGHT
    data = x.astype(ml_dtypes.bfloat16).astype("float32") if dtype == "bfloat16" else x
    expected = data @ _dequantized(weight)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_weights_quantized_in_smaller_groups_keep_them():
    """A weight dequantized from blocks of 32 (a MatMulNBits file) is packed in groups of 32 with its own codes, in
    fp32 and rounded to bf16; any other weight takes the group size asked for."""

    codes = RNG.integers(-8, 8, (256, 16)).astype("int8")
    codes[::32] = -8
    scales = (RNG.uniform(0.5, 1.5, (8, 16)) * 0.01).astype("float32")
    weight = (codes.reshape(8, 32, 16) * scales[:, None]).reshape(256, 16).astype("float32")
    for held in (weight, weight.astype(ml_dtypes.bfloat16)):
        again, _, size = held_codes(held, 128)
        assert size == 32
        np.testing.assert_array_equal(again, codes)
    assert held_codes(RNG.standard_normal((256, 16)).astype("float32"), 128)[2] == 128


def _held(zero_points: bool = False) -> PackedWeight:
    """A weight held packed as a file's int4 weights are (random nibbles, scales and zero points, groups of 16)."""
    scales = RNG.uniform(0.01, 0.1, (DEPTH // 16, COLUMNS)).astype("float32")
    zeros = RNG.integers(0, 16, scales.shape).astype("float32") if zero_points else None
    return PackedWeight(pack_nibbles(RNG.integers(0, 16, (DEPTH, COLUMNS)).astype("uint8")), scales, zeros)


def _held_module(held: PackedWeight, dtype: str = "float32") -> tvm.IRModule:
    """x @ the held weight: its dequantization call, cast to `dtype` as AMP casts it."""
    mod, kernel = with_dequantize_kernel(tvm.IRModule(), held.spec)
    x = tensor("x", (3, DEPTH), dtype)
    bb = relax.BlockBuilder(mod)
    with bb.function("main", [x]):
        with bb.dataflow():
            weight = bb.emit(held.call(kernel))
            weight = bb.emit(relax.op.astype(weight, dtype)) if dtype != "float32" else weight
            out = bb.emit_output(relax.op.matmul(x, weight))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_held_weight_is_packed_with_its_own_codes_and_scales(dtype):
    """A file's int4 weight (its dequantization call, cast by AMP or not) keeps its codes, scales and groups of 16,
    not the default 128: no second quantization."""
    held = _held()
    spec = PackedSpec(3, DEPTH, COLUMNS, 16, dtype, dtype)
    assert_transforms(QuantizeWeights(), _held_module(held, dtype), _expected(None, spec, (3,), held))


def test_a_held_weight_with_zero_points_matches_its_dense_product_on_the_vm():
    held = _held(zero_points=True)
    x = RNG.standard_normal((3, DEPTH)).astype("float32")
    after = quantize_weights(_held_module(held))
    assert "relay_amp_int4_matmul" in after.script() and "relay_amp_int4_weight" not in after.script()
    expected = x @ held.dense()
    np.testing.assert_allclose(relay_amp.run(after, [x])[0], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_weights_computes_each_held_weight_in_the_dtype_its_cast_asks_for(dtype):
    held = _held(zero_points=True)
    x = tensor("x", (3, DEPTH), dtype)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            weight = bb.emit(relax.const(held.dense(dtype), dtype))
            out = bb.emit_output(relax.op.matmul(x, weight))
        bb.emit_func_output(out)
    assert_transforms(DenseWeights(), _held_module(held, dtype), bb.get())


def test_dense_weights_leaves_a_module_without_held_weights_as_it_is():
    before = _matmul_module()
    assert dense_weights(before).same_as(before)


def test_a_held_weight_builds_dense_for_the_host():
    held = _held(zero_points=True)
    x = RNG.standard_normal((3, DEPTH)).astype("float32")
    executable = relay_amp.build(_held_module(held), relay_amp.targets.host_preset())
    np.testing.assert_allclose(relay_amp.runtime.run_executable(executable, [x])[0], x @ held.dense(), rtol=1e-5,
                               atol=1e-5)


def _routed_module() -> tvm.IRModule:
    """main(x: 6 tokens x 32) = a linear layer, a router GEMM to 4 experts and its top 2, then the frontend's form of
    an expert layer: the tokens times every expert's weight (32 x 4 * 16), each routed row's 16 outputs taken."""
    x = relax.Var("x", relax.TensorType((6, 32), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            hidden = builder.emit(relax.op.matmul(x, relax.const(RNG.standard_normal((32, 32)).astype("float32"))))
            scores = builder.emit(relax.op.matmul(hidden, relax.const(RNG.standard_normal((32, 4)).astype("float32"))))
            chosen = builder.emit(relax.op.topk(scores, 2, axis=-1, ret_type="indices", dtype="int64"))
            first_rows = relax.const(np.arange(6)[:, None] * 4, "int64")  # each token's row of expert 0
            index = builder.emit(relax.op.reshape(relax.op.add(chosen, first_rows), [12]))
            every = builder.emit(relax.op.matmul(hidden, relax.const(RNG.standard_normal((32, 64)).astype("float32"))))
            out = builder.emit_output(relax.op.take(relax.op.reshape(every, [24, 16]), index, axis=0))
        builder.emit_func_output(out)
    return builder.get()


def _reference(mod: tvm.IRModule, inputs: list) -> np.ndarray:
    """`mod` run by TVM's own build, its int4 matmuls on their reference PrimFuncs (every expert's products)."""
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(value) for value in inputs]).numpy()


def test_routers_stay_in_floats_and_expert_products_run_on_the_int4_expert_kernel():
    """The router GEMM keeps its float weight (int4 rounding changes which experts tokens go to); the product by
    every expert is packed, and the CPU backend computes only its routed rows, on the codes (not every expert's
    products, as the reference kernel does: a gpt-oss-style prompt took 1949 ms, 37 ms now), equal to the
    reference within 1e-5."""
    packed = quantize_weights(_routed_module(), group_size=32)
    calls = [line for line in packed["main"].script().splitlines() if "R.call_tir" in line or "R.matmul(" in line]
    assert sum("relay_amp_int4_matmul" in line for line in calls) == 2
    assert sum("R.matmul(" in line for line in calls) == 1
    executable = relay_amp.build(packed, relay_amp.targets.host_preset())
    assert "expert_matmul" in executable.as_text()
    x = RNG.standard_normal((6, 32)).astype("float32")
    np.testing.assert_allclose(relay_amp.runtime.run_executable(executable, [x])[0], _reference(packed, [x]),
                               rtol=1e-5, atol=1e-5)


def test_a_decode_steps_gathered_experts_are_packed_as_a_prompts():
    """A decode step's matmul of expert weights gathered per row (fewer rows than experts) becomes the product by
    every expert and a take, packed: the CPU backend reads only the chosen experts' codes."""
    x = relax.Var("x", relax.TensorType((2, 32), "float32"))
    index = relax.Var("index", relax.TensorType((2, 1), "int64"))
    stack = relax.const(RNG.standard_normal((4, 16, 32)).astype("float32"))  # (experts, outputs, depth)
    builder = relax.BlockBuilder()
    with builder.function("main", [x, index]):
        with builder.dataflow():
            weights = builder.emit(relax.op.gather_nd(stack, index))
            out = builder.emit_output(relax.op.matmul(weights, relax.op.expand_dims(x, 2)))
        builder.emit_func_output(out)
    packed = quantize_weights(builder.get(), group_size=32)
    assert "relay_amp_int4_matmul(" in packed.script() and "gather_nd" not in packed.script()
    executable = relay_amp.build(packed, relay_amp.targets.host_preset())
    assert "expert_matmul" in executable.as_text()
    inputs = [RNG.standard_normal((2, 32)).astype("float32"), np.array([[3], [1]], "int64")]
    np.testing.assert_allclose(relay_amp.runtime.run_executable(executable, inputs)[0], _reference(packed, inputs),
                               rtol=1e-5, atol=1e-5)
