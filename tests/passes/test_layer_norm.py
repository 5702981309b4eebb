"""LayerNormsAsOps: a layer norm spelled out (ONNX exporters before opset 17) becomes one relax.nn.layer_norm."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp.transform import LayerNormsAsOps

from builders import relu_module
from pass_checks import assert_transforms

SHAPE = (2, 5, 8)
SCALE = np.linspace(0.5, 2.0, 8).astype("float32")
SHIFT = np.linspace(-1.0, 1.0, 8).astype("float32")


def _module(build_norm) -> tvm.IRModule:
    """main(x [2, 5, 8]) = relu(build_norm(bb, x))."""
    return relu_module(build_norm, SHAPE)


def _spelled_out(bb: relax.BlockBuilder, x: relax.Expr, axis: int = -1, affine: bool = True, squared_by: str = "power",
                 epsilon: bool = True) -> relax.Expr:
    """LayerNorm as TVM's ONNX importer writes an opset-14 export: mean, subtract, power, mean, add, sqrt, divide,
    multiply, add."""
    mean = bb.emit(relax.op.mean(x, axis=[axis], keepdims=True))
    centered = bb.emit(relax.op.subtract(x, mean))
    squared = bb.emit(relax.op.power(centered, relax.const(2.0, "float32")) if squared_by == "power"
                      else relax.op.multiply(centered, centered))
    variance = bb.emit(relax.op.mean(squared, axis=[axis], keepdims=True))
    if epsilon:
        variance = bb.emit(relax.op.add(variance, relax.const(1e-5, "float32")))
    normalized = bb.emit(relax.op.divide(centered, bb.emit(relax.op.sqrt(variance))))
    if not affine:
        return normalized
    return bb.emit(relax.op.add(bb.emit(relax.op.multiply(normalized, relax.const(SCALE))), relax.const(SHIFT)))


def _layer_norm(gamma: np.ndarray, beta: np.ndarray, epsilon: float = float(np.float32(1e-5))):
    return lambda bb, x: bb.emit(relax.op.nn.layer_norm(x, relax.const(gamma), relax.const(beta), axes=[-1],
                                                        epsilon=epsilon))


@pytest.mark.parametrize("squared_by", ["power", "multiply"])
def test_a_spelled_out_layer_norm_becomes_one_op_with_its_scale_and_shift(squared_by):
    before = _module(lambda bb, x: _spelled_out(bb, x, squared_by=squared_by))
    assert_transforms(LayerNormsAsOps(), before, _module(_layer_norm(SCALE, SHIFT)))
    assert_transforms(relay_amp.transform.LayerNormsAsOps(), before, _module(_layer_norm(SCALE, SHIFT)))


def test_without_an_affine_step_or_an_epsilon_the_op_gets_ones_zeros_and_no_epsilon():
    expected = _module(_layer_norm(np.ones(8, "float32"), np.zeros(8, "float32"), epsilon=0.0))
    assert_transforms(LayerNormsAsOps(), _module(lambda bb, x: _spelled_out(bb, x, affine=False, epsilon=False)),
                      expected)


def test_a_norm_over_another_axis_is_left_alone():
    mod = _module(lambda bb, x: _spelled_out(bb, x, axis=1))
    tvm.ir.assert_structural_equal(LayerNormsAsOps()(mod), mod)


@pytest.mark.parametrize("affine", [True, False])
def test_the_layer_norm_computes_what_the_spelling_did(affine):
    before = _module(lambda bb, x: _spelled_out(bb, x, affine=affine))
    data = np.random.default_rng(0).standard_normal(SHAPE).astype("float32") * 3 + 1
    np.testing.assert_allclose(relay_amp.run(LayerNormsAsOps()(before), [data])[0], relay_amp.run(before, [data])[0],
                               rtol=1e-5, atol=1e-5)


def test_an_opset_14_export_of_bert_imports_with_the_layer_norms_of_an_opset_17_one(tmp_path):
    """The same norms with the same epsilon (1e-12: onnxscript's optimizer had dropped the opset-14 one)."""
    torch = pytest.importorskip("torch")
    zoo = pytest.importorskip("relay_amp.tools.zoo")
    module, inputs = zoo.torch_module("bert", tiny=True), zoo.example_inputs("bert", tiny=True)

    def epsilons(opset: int) -> list[float]:
        path = tmp_path / f"bert{opset}.onnx"
        with torch.no_grad():
            torch.onnx.export(module, tuple(torch.from_numpy(x) for x in inputs), str(path),
                              input_names=module.input_names[:len(inputs)], opset_version=opset, dynamo=False)
        main = relay_amp.frontend.from_onnx(path)["main"]
        return [float(b.value.attrs.epsilon) for block in main.body.blocks for b in block.bindings
                if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
                and b.value.op.name == "relax.nn.layer_norm"]

    assert epsilons(14) == epsilons(17) != []
