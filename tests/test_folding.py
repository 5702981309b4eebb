"""relay_amp._folding: every computation of constants folded by one build, as TVM's FoldConstant folds them."""

import numpy as np
import tvm
from tvm import relax

from relay_amp._folding import FoldConstants, fold_constants
from relay_amp.runtime import compile_module, run_executable

from pass_checks import assert_transforms

WEIGHT = np.arange(6, dtype="float32").reshape(3, 2) / 4


def _module(body, *inputs) -> tvm.IRModule:
    """main(*inputs) computing `body(builder, *inputs)` in one dataflow block."""
    builder = relax.BlockBuilder()
    with builder.function("main", list(inputs)):
        with builder.dataflow():
            output = builder.emit_output(body(builder, *inputs))
        builder.emit_func_output(output)
    return builder.get()


def _scaled_weight_added(builder, x):
    weight = builder.emit(relax.op.permute_dims(relax.const(WEIGHT)))
    scaled = builder.emit(relax.op.multiply(weight, relax.const(2.0, "float32")))
    shifted = builder.emit(relax.op.subtract(scaled, relax.const(np.ones((2, 3), "float32"))))
    return relax.op.add(x, shifted)


def test_a_chain_of_constants_folds_into_its_reader_as_tvms_fold_constant_folds_it():
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    before = _module(_scaled_weight_added, x)
    x2 = relax.Var("x", relax.TensorType((2, 3), "float32"))
    expected = _module(lambda builder, x: relax.op.add(x, relax.const(WEIGHT.T * 2 - 1)), x2)
    assert_transforms(FoldConstants, before, expected)
    tvm.ir.assert_structural_equal(fold_constants(before), relax.transform.FoldConstant()(before))


def test_every_computation_of_a_function_is_compiled_once(monkeypatch):
    compiled = []
    original = tvm.compile
    monkeypatch.setattr(tvm, "compile", lambda *args, **kwargs: compiled.append(args) or original(*args, **kwargs))
    fold_constants(_module(_scaled_weight_added, relax.Var("x", relax.TensorType((2, 3), "float32"))))
    assert len(compiled) == 1  # three ops of constants: TVM's FoldConstant builds each of them apart


def test_a_tuple_of_constants_folds_through_its_items_and_the_result_is_unchanged():
    """A training-mode batch norm of a weight (BiT's weight standardization) returns a tuple; its first item is
    folded, where TVM's FoldConstant leaves tuple results alone."""
    def standardized_weight_added(builder, x):
        weight = relax.const(WEIGHT.reshape(1, 3, 2, 1))
        stats = [relax.const(np.full((3,), v, "float32")) for v in (1.0, 0.0, 0.0, 1.0)]
        normed = builder.emit(relax.op.nn.batch_norm(weight, *stats, axis=1, training=True))
        return relax.op.add(x, builder.emit(relax.TupleGetItem(normed, 0)))

    x = relax.Var("x", relax.TensorType((1, 3, 2, 1), "float32"))
    before = _module(standardized_weight_added, x)
    after = fold_constants(before)
    relax.analysis.well_formed(after)
    assert "batch_norm" not in after.script() and "batch_norm" in before.script()
    data = np.random.default_rng(0).standard_normal((1, 3, 2, 1)).astype("float32")
    np.testing.assert_allclose(run_executable(compile_module(after), [data])[0],
                               run_executable(compile_module(before), [data])[0], rtol=1e-6, atol=1e-6)


def test_static_shapes_fold_to_tensors_and_symbolic_ones_stay():
    def positions(builder, x):
        static = builder.emit(relax.op.shape_to_tensor(relax.ShapeExpr([2, 3])))
        symbolic = builder.emit(relax.op.shape_of(x))
        return relax.Tuple([static, builder.emit(relax.op.shape_to_tensor(symbolic))])

    n = tvm.tirx.Var("n", "int64")
    before = _module(positions, relax.Var("x", relax.TensorType((n, 3), "float32")))
    after = fold_constants(before)
    relax.analysis.well_formed(after)
    assert after.script().count("R.shape_to_tensor") == 1 and "R.shape_of" in after.script()
    executable = compile_module(after)
    static, symbolic = relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(np.zeros((4, 3), "f")))
    assert static.numpy().tolist() == [2, 3] and symbolic.numpy().tolist() == [4, 3]


def test_bindings_outside_dataflow_blocks_are_left_as_tvms_fold_constant_leaves_them():
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 2), "float32"))
    with builder.function("main", [x]):
        doubled = builder.emit(relax.op.multiply(relax.const(WEIGHT), relax.const(2.0, "float32")))
        builder.emit_func_output(builder.emit(relax.op.add(x, doubled)))
    before = builder.get()
    assert_transforms(FoldConstants, before, before)


def test_a_function_whose_one_build_fails_is_folded_op_by_op_as_tvm_does(monkeypatch):
    before = _module(_scaled_weight_added, relax.Var("x", relax.TensorType((2, 3), "float32")))

    def failing_build(*args, **kwargs):
        raise tvm.error.InternalError("cannot build this on the host")

    monkeypatch.setattr(tvm, "compile", failing_build)
    tvm.ir.assert_structural_equal(fold_constants(before), relax.transform.FoldConstant()(before))


def test_a_weight_held_packed_is_not_folded():
    """A file's int4 weight (a call of packed_int4's dequantization PrimFunc on its packed constants) stays packed:
    folded, it would be 8x its bytes in fp32 (a backend makes it dense, in the dtype it is read in)."""
    from relay_amp.packed_int4 import PackedWeight, with_dequantize_kernel

    held = PackedWeight(np.arange(16, dtype="uint32").reshape(1, 1, 16), np.ones((1, 16), "float32"))
    mod, kernel = with_dequantize_kernel(tvm.IRModule(), held.spec)
    builder = relax.BlockBuilder(mod)
    x = relax.Var("x", relax.TensorType((2, 8), "float32"))
    with builder.function("main", [x]):
        with builder.dataflow():
            weight = builder.emit(held.call(kernel))
            output = builder.emit_output(relax.op.matmul(x, weight))
        builder.emit_func_output(output)
    before = builder.get()
    assert_transforms(FoldConstants, before, before)
