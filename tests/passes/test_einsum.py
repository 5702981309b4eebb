"""EinsumsAsMatmuls: einsums of two tensors (relax.einsum, or TVM's ONNX importer's TE einsum) become one matmul
between transposes and reshapes, and compute what numpy's einsum computes."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, topi
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import frontend
from relay_amp._einsum import te_einsum_subscripts
from relay_amp.transform import EinsumsAsMatmuls

from pass_checks import assert_transforms


def _einsum_module(subscripts: str, *shapes, te: bool = False) -> tvm.IRModule:
    """main(a, b) = einsum(subscripts, a, b): relax.einsum, or (te) a call of topi.einsum as TVM's ONNX importer
    writes an Einsum node."""
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in zip("ab", shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            if te:
                out = bb.emit_output(bb.emit_te(topi.einsum, subscripts, *params))
            else:
                out = bb.emit_output(relax.op.einsum(params, subscripts))
        bb.emit_func_output(out)
    return bb.get()


def test_attention_scores_as_xlnet_spells_them_become_a_batched_matmul():
    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((6, 1, 2, 4), "float32"),
                 b: R.Tensor((5, 1, 2, 4), "float32")) -> R.Tensor((1, 2, 6, 5), "float32"):
            with R.dataflow():
                lhs = R.permute_dims(a, axes=[1, 2, 0, 3])
                lhs_grouped = R.reshape(lhs, R.shape([2, 6, 4]))
                rhs = R.permute_dims(b, axes=[1, 2, 3, 0])
                rhs_grouped = R.reshape(rhs, R.shape([2, 4, 5]))
                product = R.matmul(lhs_grouped, rhs_grouped, out_dtype="float32")
                gv = R.reshape(product, R.shape([1, 2, 6, 5]))
                R.output(gv)
            return gv

    assert_transforms(EinsumsAsMatmuls(), _einsum_module("ibnd,jbnd->bnij", (6, 1, 2, 4), (5, 1, 2, 4)), Expected)


def test_a_projection_by_a_weight_is_a_matmul_of_flattened_rows_and_columns():
    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((6, 1, 8), "float32"),
                 b: R.Tensor((8, 2, 4), "float32")) -> R.Tensor((6, 1, 2, 4), "float32"):
            with R.dataflow():
                rows = R.reshape(a, R.shape([6, 8]))
                columns = R.reshape(b, R.shape([8, 8]))
                product = R.matmul(rows, columns, out_dtype="float32")
                gv = R.reshape(product, R.shape([6, 1, 2, 4]))
                R.output(gv)
            return gv

    assert_transforms(EinsumsAsMatmuls(), _einsum_module("ibh,hnd->ibnd", (6, 1, 8), (8, 2, 4)), Expected)


CASES = [  # subscripts, shapes: batch, free and contracted axes in every order, an output transposed
    ("ij,jk->ik", (3, 4), (4, 5)),
    ("bij,bjk->bik", (2, 3, 4), (2, 4, 5)),
    ("ibnd,jbnd->bnij", (6, 1, 2, 4), (5, 1, 2, 4)),
    ("bnij,jbnd->ibnd", (1, 2, 6, 5), (5, 1, 2, 4)),
    ("ibh,hnd->ibnd", (6, 1, 8), (8, 2, 4)),
    ("ik,jk->kji", (3, 4), (5, 4)),
    ("k,kn->n", (4,), (4, 5)),
    ("bhqd,bhkd->bhqk", (2, 3, 4, 8), (2, 3, 5, 8)),
]


@pytest.mark.parametrize("te", [False, True], ids=["relax", "te"])
@pytest.mark.parametrize("subscripts,lhs,rhs", CASES)
def test_every_einsum_of_two_tensors_computes_what_numpy_computes(subscripts, lhs, rhs, te):
    before = _einsum_module(subscripts, lhs, rhs, te=te)
    after = EinsumsAsMatmuls()(before)
    relax.analysis.well_formed(after)
    ops = {binding.value.op.name for binding in after["main"].body.blocks[0].bindings
           if isinstance(binding.value, relax.Call)}
    assert "relax.matmul" in ops and not ops & {"relax.einsum", "relax.call_tir"}
    rng = np.random.default_rng(0)
    data = [rng.standard_normal(shape).astype("float32") for shape in (lhs, rhs)]
    np.testing.assert_allclose(relay_amp.run(after, data)[0], np.einsum(subscripts, *data), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("subscripts,lhs,rhs", [("ij,jk->i", (3, 4), (4, 5)), ("...j,jk->...k", (3, 4), (4, 5)),
                                                ("ii,ij->ij", (4, 4), (4, 5))])
def test_an_axis_summed_alone_an_ellipsis_or_a_diagonal_stays_an_einsum(subscripts, lhs, rhs):
    before = _einsum_module(subscripts, lhs, rhs)
    tvm.ir.assert_structural_equal(EinsumsAsMatmuls()(before), before)


def test_the_te_einsum_is_read_back_from_its_store():
    func = next(f for _, f in _einsum_module("ibh,hnd->ibnd", (6, 1, 8), (8, 2, 4), te=True).functions_items()
                if isinstance(f, tvm.tirx.PrimFunc))
    assert te_einsum_subscripts(func) == "abc,cde->abde"
    relu = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    with relu.function("main", [x]):
        relu.emit_func_output(relu.emit_te(topi.nn.relu, x))
    assert te_einsum_subscripts(next(f for _, f in relu.get().functions_items()
                                     if isinstance(f, tvm.tirx.PrimFunc))) is None


def test_an_onnx_einsum_imports_as_a_matmul():
    weight = np.random.default_rng(1).standard_normal((8, 2, 4)).astype("float32")
    graph = helper.make_graph([helper.make_node("Einsum", ["x", "w"], ["y"], equation="ibh,hnd->ibnd")], "einsum",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 1, 2, 4])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    mod = frontend.from_onnx(model)
    ops = [binding.value.op.name for binding in mod["main"].body.blocks[0].bindings]
    assert "relax.matmul" in ops and "relax.call_tir" not in ops
    x = np.random.default_rng(0).standard_normal((6, 1, 8)).astype("float32")
    np.testing.assert_allclose(relay_amp.run(mod, [x])[0], np.einsum("ibh,hnd->ibnd", x, weight), rtol=1e-5, atol=1e-5)
