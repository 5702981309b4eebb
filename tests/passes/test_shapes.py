"""shapes: symbolic input dims listed by name and bound to sizes (Specialize)."""

import numpy as np
import pytest
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import relay_amp

from pass_checks import assert_transforms


@I.ir_module
class Dynamic:  # an export's dynamic batch and sequence axes, and a shape computed from them
    @R.function
    def main(x: R.Tensor(("batch", "sequence", 4), "float32"),
             mask: R.Tensor(("batch", "sequence"), "float32")) -> R.Tensor(("batch * sequence * 4",), "float32"):
        batch = T.int64()
        sequence = T.int64()
        with R.dataflow():
            masked = R.multiply(x, R.expand_dims(mask, axis=[2]))
            flat = R.reshape(masked, R.shape([batch * sequence * 4]))
            R.output(flat)
        return flat


def test_specialize_binds_the_named_dims_everywhere_they_appear():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, "sequence", 4), "float32"),
                 mask: R.Tensor((2, "sequence"), "float32")) -> R.Tensor(("sequence * 8",), "float32"):
            sequence = T.int64()
            with R.dataflow():
                masked = R.multiply(x, R.expand_dims(mask, axis=[2]))
                flat = R.reshape(masked, R.shape([sequence * 8]))
                R.output(flat)
            return flat

    assert_transforms(relay_amp.transform.Specialize({"batch": 2}), Dynamic, Expected)


def test_symbolic_dims_lists_input_dims_in_order_and_none_once_bound():
    assert relay_amp.symbolic_dims(Dynamic) == ["batch", "sequence"]
    assert relay_amp.symbolic_dims(relay_amp.specialize(Dynamic, {"batch": 2, "sequence": 3})) == []


def test_a_specialized_module_computes_what_the_dynamic_one_does():
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((2, 3, 4)).astype("float32"), rng.standard_normal((2, 3)).astype("float32")]
    static = relay_amp.specialize(Dynamic, {"batch": 2, "sequence": 3})
    expected = (inputs[0] * inputs[1][:, :, None]).reshape(-1)
    np.testing.assert_array_equal(relay_amp.run(static, inputs)[0], expected)
    np.testing.assert_array_equal(relay_amp.run(Dynamic, inputs)[0], expected)


@pytest.mark.parametrize("dims, message", [
    ({"batch_size": 1}, "no symbolic input dim 'batch_size'; its symbolic dims: batch, sequence"),
    ({"batch": -1}, "'batch' must be bound to a non-negative int, got -1"),
    ({"batch": True}, "'batch' must be bound to a non-negative int, got True"),
    ({"sequence": 1.5}, "'sequence' must be bound to a non-negative int, got 1.5"),
])
def test_bad_dims_are_option_errors_naming_them(dims, message):
    with pytest.raises(relay_amp.OptionError, match=message):
        relay_amp.specialize(Dynamic, dims)


def test_a_static_module_has_no_dims_to_bind():
    static = relay_amp.specialize(Dynamic, {"batch": 1, "sequence": 1})
    with pytest.raises(relay_amp.OptionError, match=r"its symbolic dims: none \(its input shapes are static\)"):
        relay_amp.specialize(static, {"batch": 1})
