"""sub_byte: int4/uint4 values held in int8/uint8 tensors, so a recast int4 module builds and computes exactly."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import models
from relay_amp.compile.build import build
from relay_amp.passes.sub_byte import HoldSubByteInBytes, hold_sub_byte_in_bytes
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor
from pass_checks import assert_transforms

SHAPE = (32, 32)


def _int4_matmul(dtype: str = "int4") -> tvm.IRModule:
    mod = single_output_module(relax.op.matmul, tensor("x", SHAPE), tensor("w", SHAPE))
    return relay_amp.recast(mod, dtype, "int32", ops=["relax.matmul"])


def _expected(holder: str, low: int, high: int) -> tvm.IRModule:
    x, w = tensor("x", SHAPE), tensor("w", SHAPE)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            held = [bb.emit(relax.op.astype(bb.emit(relax.op.clip(v, low, high)), holder)) for v in (x, w)]
            product = bb.emit(relax.op.matmul(*held, out_dtype="int32"))
            out = bb.emit_output(relax.op.astype(product, "float32"))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("dtype, holder, low, high", [("int4", "int8", -8, 7), ("uint4", "uint8", 0, 15)])
def test_casts_to_sub_byte_become_clamped_casts_to_bytes(dtype, holder, low, high):
    assert_transforms(HoldSubByteInBytes(), _int4_matmul(dtype), _expected(holder, low, high))


def test_a_module_without_sub_byte_values_is_unchanged():
    before = relay_amp.recast(single_output_module(relax.op.matmul, tensor("x", SHAPE), tensor("w", SHAPE)),
                              "int8", "int32", ops=["relax.matmul"])
    assert_transforms(HoldSubByteInBytes(), before, before)


@pytest.mark.parametrize("target", ["cpu", relay_amp.targets.host_preset()])
def test_an_int4_matmul_builds_and_equals_integer_arithmetic(target):
    rng = np.random.default_rng(0)
    x, w = (rng.integers(-8, 8, SHAPE).astype("float32") for _ in range(2))
    (got,) = run_executable(build(_int4_matmul(), target), [x, w])
    np.testing.assert_array_equal(got, x @ w)


def test_values_outside_int4_saturate():
    x = np.full(SHAPE, 100.0, "float32")
    (got,) = run_executable(build(_int4_matmul(), "cpu"), [x, -x])
    np.testing.assert_array_equal(got, np.full(SHAPE, 7 * -8 * SHAPE[0], "float32"))


def test_int4_convolutions_of_the_seed_workflow_build_and_equal_int8_on_int4_values():
    """recast(mod, 'int4', 'int32', skip_layers=[0]) on ResNet-18: the same result as int8 on inputs clamped to
    int4's range, since the int8 kernels compute both."""
    mod = models.resnet18(image_size=32, classes=7)
    inputs = models.example_inputs(mod)
    int4 = run_executable(build(relay_amp.recast(mod, "int4", "int32", skip_layers=[0]), "cpu"), inputs)[0]
    clamped = hold_sub_byte_in_bytes(relay_amp.recast(mod, "int4", "int32", skip_layers=[0]))
    np.testing.assert_array_equal(int4, run_executable(build(clamped, "cpu"), inputs)[0])
    assert np.isfinite(int4).all()


def test_a_sub_byte_input_or_constant_is_a_dtype_error_naming_it():
    with pytest.raises(relay_amp.DTypeError, match="takes x as a int4 tensor"):
        hold_sub_byte_in_bytes(single_output_module(relax.op.nn.relu, tensor("x", (16,), "int4")))
    with pytest.raises(relay_amp.DTypeError, match="relax.zeros makes a int4 tensor"):
        hold_sub_byte_in_bytes(single_output_module(
            lambda x: relax.op.add(x, relax.op.astype(relax.op.zeros((16,), "int4"), "float32")), tensor("x", (16,))))
