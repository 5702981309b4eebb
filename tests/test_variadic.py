"""_variadic: ONNX's Max, Min, Sum and Mean of runtime tensors as chains of binary ops, not a stack of broadcasts."""

import numpy as np
import pytest
from onnx import TensorProto, helper
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp._variadic import variadic_ops_as_binary
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms


def test_a_reduction_of_stacked_broadcasts_is_a_chain_of_binary_ops():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((3,), "float32"), c: R.Tensor((2, 1), "float32")
                 ) -> R.Tensor((2, 3), "float32"):
            with R.dataflow():
                wide_b = R.broadcast_to(b, R.shape([2, 3]))
                wide_c = R.broadcast_to(c, R.shape([2, 3]))
                stacked = R.stack((a, wide_b, wide_c), axis=0)
                gv = R.mean(stacked, axis=[0])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((3,), "float32"), c: R.Tensor((2, 1), "float32")
                 ) -> R.Tensor((2, 3), "float32"):
            with R.dataflow():
                ab = R.add(a, b)
                abc = R.add(ab, c)
                gv = R.divide(abc, R.const(3, "float32"))
                R.output(gv)
            return gv

    assert_transforms(variadic_ops_as_binary, Before, Expected)


def test_other_reductions_of_a_stack_are_left_alone():
    @I.ir_module
    class Kept:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((2, 3), "float32")) -> R.Tensor((3,), "float32"):
            with R.dataflow():
                stacked = R.stack((a, b), axis=1)
                gv = R.max(stacked, axis=[0, 1])
                R.output(gv)
            return gv

    assert_transforms(variadic_ops_as_binary, Kept, Kept)


@pytest.mark.parametrize("op_type, reference", [
    ("Max", lambda xs: np.maximum(np.maximum(*xs[:2]), xs[2])),
    ("Min", lambda xs: np.minimum(np.minimum(*xs[:2]), xs[2])),
    ("Sum", lambda xs: xs[0] + xs[1] + xs[2]),
    ("Mean", lambda xs: (xs[0] + xs[1] + xs[2]) / 3),
])
def test_onnx_variadic_ops_of_runtime_tensors_build_for_the_cpu_and_match(op_type, reference):
    """TVM's importer stacked them, and every CPU build's ConvertLayout failed on the stack."""
    shapes = {"a": [2, 3, 4], "b": [4], "c": [3, 1]}
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in shapes.items()]
    node = helper.make_node(op_type, list(shapes), ["y"])
    graph = helper.make_graph([node], "variadic", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                         [2, 3, 4])])
    mod = relay_amp.frontend.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert "R.stack" not in mod.script()
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(shape).astype("float32") for shape in shapes.values()]
    got = run_executable(relay_amp.build(mod, "cpu"), values)[0]
    np.testing.assert_allclose(got, reference(values), rtol=1e-6)
