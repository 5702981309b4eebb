"""code_bounds: the range a tensor's values can take, read back through the ops that computed it (the CUDA backend's
int4 operands are tested through its packing, in tests/backend/cuda)."""

import math

import numpy as np
import pytest
from tvm import relax

from relay_amp.backend.code_bounds import value_range

from builders import tensor


def _codes(bb: relax.BlockBuilder, x: relax.Expr, high: float, low: "float | None" = 0.0) -> relax.Expr:
    """quantize's codes of `x`: floored, clamped to [low, high] (no lower clamp where `low` is None), cast to uint8."""
    floored = bb.emit(relax.op.floor(x))
    if low is not None:
        floored = bb.emit(relax.op.maximum(floored, relax.const(low)))
    return bb.emit(relax.op.astype(bb.emit(relax.op.minimum(floored, relax.const(high))), "uint8"))


def _range(build, dtype: str = "float32") -> tuple[float, float]:
    """value_range of what `build(bb, x)` emits, for an NHWC `x` of `dtype`, in the builder that emitted it."""
    bb = relax.BlockBuilder()
    x = tensor("x", (1, 4, 4, 8), dtype)
    with bb.function("main", [x]):
        with bb.dataflow():
            value = build(bb, x)
            found = value_range(bb, value)
            out = bb.emit_output(value)
        bb.emit_func_output(out)
    return found


def _pooled(bb, x):
    return bb.emit(relax.op.nn.max_pool2d(_codes(bb, x, 127.0), pool_size=2, layout="NHWC"))


def _concatenated(bb, x):
    return bb.emit(relax.op.concat([_codes(bb, x, 127.0), _codes(bb, x, 100.0)], axis=3))


def _split_part(bb, x):
    parts = bb.emit(relax.op.split(_codes(bb, x, 127.0), 2, axis=3))
    return bb.emit(relax.TupleGetItem(parts, 1))


@pytest.mark.parametrize("build, expected", [
    (lambda bb, x: _codes(bb, x, 127.0), (0, 127)),  # quantize's 7-bit codes
    (lambda bb, x: _codes(bb, x, 127.0, low=None), (0, 255)),  # a negative value cast to uint8 wraps: all of it
    (lambda bb, x: bb.emit(relax.op.nn.pad(_codes(bb, x, 127.0), [0, 0, 1, 1, 1, 1, 0, 0], pad_value=64.0)), (0, 127)),
    (lambda bb, x: bb.emit(relax.op.nn.pad(_codes(bb, x, 127.0), [0, 0, 1, 1, 1, 1, 0, 0], pad_value=200.0)),
     (0, 200)),
    (_pooled, (0, 127)),
    (_concatenated, (0, 127)),
    (_split_part, (0, 127)),
    (lambda bb, x: bb.emit(relax.op.permute_dims(_codes(bb, x, 100.0), [0, 3, 1, 2])), (0, 100)),
    (lambda bb, x: bb.emit(relax.op.add(_codes(bb, x, 100.0), _codes(bb, x, 100.0))), (0, 255)),  # unknown: uint8's
    (lambda bb, x: bb.emit(relax.op.minimum(_codes(bb, x, 127.0), _codes(bb, x, 100.0))), (0, 100)),
    (lambda bb, x: bb.emit(relax.op.maximum(_codes(bb, x, 127.0), _codes(bb, x, 100.0))), (0, 127)),
    (lambda bb, x: bb.emit(relax.op.nn.relu(x)), (0, math.inf)),
    (lambda bb, x: bb.emit(relax.op.clip(x, 1.0, 5.0)), (1, 5)),
    (lambda bb, x: relax.const(np.array([[3, -2]], "int8")), (-2, 3)),
], ids=["codes", "codes_unclamped_below", "padded_by_zero_point", "padded_higher", "max_pooled", "concatenated",
        "split", "transposed", "added", "minimum_of_two", "maximum_of_two", "relu", "clip", "constant"])
def test_value_range_follows_codes_back_to_their_clamp(build, expected):
    assert _range(build) == expected


def test_a_parameters_range_is_its_dtypes():
    assert _range(lambda bb, x: x, "uint8") == (0, 255) and _range(lambda bb, x: x, "int8") == (-128, 127)
    assert _range(lambda bb, x: x) == (-math.inf, math.inf)
