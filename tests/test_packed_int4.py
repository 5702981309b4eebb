"""packed_int4: the packed layout, weights held packed in a module (a file's int4 codes) and their dequantization."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp.packed_int4 import (PackedWeight, WeightSpec, pack_int4, pack_nibbles, packed_weight, unpack_int4,
                                   unpack_nibbles, weight_spec_of, with_dequantize_kernel)

from builders import tensor

RNG = np.random.default_rng(0)
DEPTH, COLUMNS, GROUP = 64, 32, 16


def test_packing_round_trips_every_code():
    codes = RNG.integers(-8, 8, (256, 48)).astype("int8")
    codes[0, 0], codes[1, 0] = -8, 7
    packed = pack_int4(codes)
    assert packed.dtype == np.uint32 and packed.shape == (3, 32, 16)
    np.testing.assert_array_equal(unpack_int4(packed), codes)
    np.testing.assert_array_equal(unpack_nibbles(packed), codes + 8)


def test_packing_puts_even_rows_low_and_odd_rows_high():
    codes = np.full((8, 16), -8, "int8")  # nibble 0 everywhere
    codes[2, 0], codes[3, 0] = -7, -6  # rows 2 and 3: pair 1, low and high half
    assert pack_int4(codes)[0, 0, 0] == (1 << 4) | (2 << 20)
    np.testing.assert_array_equal(pack_nibbles((codes + 8).astype("uint8")), pack_int4(codes))


def _weight(zero_points: bool) -> tuple[PackedWeight, np.ndarray]:
    """A random held weight and the fp32 weight it holds, computed here as (nibble - zero point) x scale."""
    nibbles = RNG.integers(0, 16, (DEPTH, COLUMNS)).astype("uint8")
    scales = RNG.uniform(0.01, 0.1, (DEPTH // GROUP, COLUMNS)).astype("float32")
    zeros = RNG.uniform(0, 15, scales.shape).astype("float32") if zero_points else None
    points = np.repeat(zeros if zero_points else np.full(scales.shape, 8, "float32"), GROUP, axis=0)
    dense = (nibbles.astype("float32") - points) * np.repeat(scales, GROUP, axis=0)
    return PackedWeight(pack_nibbles(nibbles), scales, zeros), dense


@pytest.mark.parametrize("zero_points", [False, True])
def test_a_held_weight_dequantizes_on_the_host_as_its_primfunc_does_on_the_vm(zero_points):
    held, dense = _weight(zero_points)
    assert held.spec == WeightSpec(DEPTH, COLUMNS, GROUP, zero_points)
    np.testing.assert_array_equal(held.dense(), dense)
    np.testing.assert_array_equal(held.dense("bfloat16"), dense.astype(ml_dtypes.bfloat16))
    mod, kernel = with_dequantize_kernel(tvm.IRModule(), held.spec)
    bb = relax.BlockBuilder(mod)
    with bb.function("main", []):
        out = bb.emit(held.call(kernel))
        bb.emit_func_output(out)
    vm_module = bb.get()
    relax.analysis.well_formed(vm_module)
    np.testing.assert_array_equal(relay_amp.run(vm_module, [])[0], dense)


def test_the_zero_point_shift_is_what_zero_points_add_to_the_symmetric_reading():
    held, dense = _weight(True)
    symmetric = PackedWeight(held.packed, held.scales).dense()
    np.testing.assert_allclose(dense, symmetric + np.repeat(held.zero_point_shift(), GROUP, axis=0), atol=1e-6)


def test_a_dequantize_kernel_is_added_once_per_spec_and_marked():
    spec = WeightSpec(DEPTH, COLUMNS, GROUP)
    mod, first = with_dequantize_kernel(tvm.IRModule(), spec)
    mod, again = with_dequantize_kernel(mod, spec)
    mod, other = with_dequantize_kernel(mod, WeightSpec(DEPTH, COLUMNS, GROUP, zero_points=True))
    assert first.same_as(again) and not first.same_as(other) and len(mod.functions) == 2
    assert weight_spec_of(mod[first]) == spec and weight_spec_of(mod[other]).zero_points


def test_only_a_dequantize_call_on_constants_is_a_held_weight():
    held, _ = _weight(False)
    mod, kernel = with_dequantize_kernel(tvm.IRModule(), held.spec)
    x = tensor("x", (DEPTH, COLUMNS))
    assert packed_weight(mod, relax.op.add(x, x)) is None
    assert packed_weight(mod, relax.call_tir(kernel, [x, relax.const(held.scales)],
                                             relax.TensorType((DEPTH, COLUMNS), "float32"))) is None
    found = packed_weight(mod, held.call(kernel))
    for got, expected in zip(found.operands(), held.operands(), strict=True):
        np.testing.assert_array_equal(got, expected)
