"""relay_amp._ir helpers that have no pass of their own to be tested through."""

import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

from relay_amp._ir import conjuncts, depthwise_weight, is_scalar_constant, is_static_shape, opaque_scheduled, reads_var

IMPORT_IN_A_FRESH_PROCESS = """
import inspect
import tvm
from relay_amp._ir import import_tensor_intrinsics
stack = inspect.stack
module = import_tensor_intrinsics("tvm.s_tir.tensor_intrin.x86")
assert inspect.stack is stack, "inspect.stack was not restored"
assert module is import_tensor_intrinsics("tvm.s_tir.tensor_intrin.x86")
tvm.s_tir.TensorIntrin.get("dot_16x4_vnni")  # raises if the TVMScript intrinsics were not registered
tvm.s_tir.TensorIntrin.get("wmma_sync_16x16x16_f16f16f32")  # the package's CUDA ones came with it
print("ok")
"""


def test_tensor_intrinsics_import_registers_them_and_restores_inspect():
    result = subprocess.run([sys.executable, "-c", IMPORT_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_tvmscript_parsed_under_fast_script_parsing_reads_the_callers_variables_and_inspect_is_restored():
    import inspect

    from tvm.script import tirx as T

    from relay_amp._ir import fast_script_parsing

    stack, scale = inspect.stack, 3.5
    with fast_script_parsing():
        assert inspect.stack is not stack

        @T.prim_func(s_tir=True)
        def scaled(a: T.Buffer((4,), "float32")):
            for i in range(4):
                a[i] = a[i] * T.float32(scale)  # a local of this test, found through the frames it is given

    assert inspect.stack is stack
    assert "3.5" in scaled.script()


def test_clamped_emits_maximum_then_minimum_by_constants_leaving_out_infinite_bounds():
    import math

    import tvm
    from tvm import relax

    from relay_amp._ir import clamped

    def body(low: float, high: float) -> relax.Function:
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((4,), "float32"))
        with bb.function("main", [x]):
            with bb.dataflow():
                out = bb.emit_output(clamped(bb, x, low, high))
            bb.emit_func_output(out)
        return bb.get()["main"]

    def expected(*ops) -> relax.Function:
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((4,), "float32"))
        with bb.function("main", [x]):
            with bb.dataflow():
                value = x
                for op, bound in ops[:-1]:
                    value = bb.emit(op(value, relax.const(bound, "float32")))
                op, bound = ops[-1]
                out = bb.emit_output(op(value, relax.const(bound, "float32")))
            bb.emit_func_output(out)
        return bb.get()["main"]

    tvm.ir.assert_structural_equal(body(0.0, 6.0), expected((relax.op.maximum, 0.0), (relax.op.minimum, 6.0)))
    tvm.ir.assert_structural_equal(body(-math.inf, 6.0), expected((relax.op.minimum, 6.0)))
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    assert clamped(relax.BlockBuilder(), x, -math.inf, math.inf) is x


def test_reduces_exactly_reads_negative_axes_from_the_end_and_wants_them_kept():
    from tvm import relax

    from relay_amp._ir import reduces_exactly

    x = relax.Var("x", relax.TensorType((2, 3, 4), "float32"))
    assert reduces_exactly(relax.op.mean(x, axis=[-1], keepdims=True), [2])
    assert reduces_exactly(relax.op.sum(x, axis=[2, 1], keepdims=True), [1, 2])
    assert not reduces_exactly(relax.op.mean(x, axis=[-1], keepdims=False), [2])  # the axis is dropped
    assert not reduces_exactly(relax.op.mean(x, axis=[1], keepdims=True), [2])
    assert not reduces_exactly(relax.op.mean(x, keepdims=True), [2])  # every axis


def test_slice_window_reads_begin_and_end_on_every_axis_of_unit_step_slices():
    from tvm import relax

    from relay_amp._ir import slice_window

    x = relax.Var("x", relax.TensorType((2, 6, 48), "float32"))
    assert slice_window(relax.op.strided_slice(x, axes=[-1], begin=[0], end=[45])) == ([0, 0, 0], [2, 6, 45])
    assert slice_window(relax.op.strided_slice(x, axes=[1, 2], begin=[2, 8], end=[5, 16])) == ([0, 2, 8], [2, 5, 16])
    assert slice_window(relax.op.strided_slice(x, axes=[2], begin=[0], end=[48], strides=[2])) is None  # every other
    assert slice_window(relax.op.strided_slice(x, axes=[2], begin=[40], end=[60])) is None  # past the end


def test_calls_any_op_looks_through_every_relax_function_for_the_named_ops():
    from tvm.script import ir as I
    from tvm.script import relax as R

    from relay_amp._ir import calls_any_op

    @I.ir_module
    class Module:
        @R.function(private=True)
        def helper(x: R.Tensor((2, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            return R.nn.relu(x)

        @R.function
        def main(x: R.Tensor((2, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            cls = Module
            with R.dataflow():
                gv = cls.helper(R.tanh(x))
                R.output(gv)
            return gv

    assert calls_any_op(Module, ["relax.nn.relu"])  # only the helper calls it
    assert calls_any_op(Module, ["relax.nn.conv2d", "relax.tanh"])
    assert not calls_any_op(Module, ["relax.nn.conv2d", "relax.matmul"])


@pytest.mark.parametrize("groups, weight_shape, found", [
    (8, (3, 3, 1, 8), True),  # depthwise: one output channel per input channel
    (8, (3, 3, 1, 16), False),  # a channel multiplier of 2
    (1, (3, 3, 8, 8), False),  # a dense conv
])
def test_depthwise_weight_is_the_weight_of_depthwise_nhwc_convs_only(groups, weight_shape, found):
    weight = np.ones(weight_shape, "float32")
    call = relax.op.nn.conv2d(relax.Var("x", relax.TensorType((1, 6, 6, 8), "float32")), relax.const(weight),
                              groups=groups, data_layout="NHWC", kernel_layout="HWIO")
    got = depthwise_weight(call)
    assert (got is not None) == found and (not found or got.shape == weight_shape)


def test_type_shape_reads_static_and_symbolic_dims_of_a_tensor_type_and_none_otherwise():
    from tvm import tirx

    from relay_amp._ir import type_shape

    n = tirx.Var("n", "int64")
    assert type_shape(relax.TensorType((1, n, 8), "float32")) == (1, "n", 8)
    assert type_shape(relax.TensorType(None, "float32", ndim=2)) is None
    assert type_shape(relax.TupleType([relax.TensorType((2,), "float32")])) is None


def test_split_part_bounds_cut_where_the_parts_types_say_and_none_for_a_symbolic_axis():
    from tvm import tirx

    from relay_amp._ir import split_part_bounds

    def split(shape, sections, axis):
        x = relax.Var("x", relax.TensorType(shape, "float32"))
        return relax.BlockBuilder().normalize(relax.op.split(x, sections, axis))

    assert split_part_bounds(split((1, 4, 48), [16, 32], 2)) == [(0, 16), (16, 32), (32, 48)]
    assert split_part_bounds(split((2, 6, 8), 3, -2)) == [(0, 2), (2, 4), (4, 6)]
    assert split_part_bounds(split((1, tirx.Var("n", "int64"), 8), 2, 1)) is None


def test_binding_readers_lists_each_read_and_the_result_as_none():
    from relay_amp._ir import binding_readers

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 2), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            doubled = bb.emit(relax.op.add(x, x))
            out = bb.emit_output(relax.op.multiply(doubled, x))
        bb.emit_func_output(relax.Tuple([out, doubled]))
    func = bb.get()["main"]
    bindings = func.body.blocks[0].bindings
    readers = binding_readers(func)
    assert readers[x] == [bindings[0], bindings[0], bindings[1]]
    assert readers[doubled] == [bindings[1], None] and readers[out] == [None]


@pytest.mark.parametrize("shape, static", [((1, 8), True), ((), True), ((1, "n"), False), (None, False)])
def test_is_static_shape_wants_every_extent_an_int(shape, static):
    assert is_static_shape(shape) == static


def test_is_scalar_constant_is_true_for_rank_zero_constants_only():
    assert is_scalar_constant(relax.const(1.0, "float32"))
    assert not is_scalar_constant(relax.const(np.ones(3, "float32")))
    assert not is_scalar_constant(relax.Var("x", relax.TensorType((), "float32")))


def test_call_te_once_builds_a_te_function_once_per_key_and_argument_types():
    """Equal keys on arguments of one static type call the first call's PrimFunc; another shape, another key or a
    symbolic shape builds again. The module holds one PrimFunc per TE function built, and computes what call_te's
    would."""
    import tvm
    from tvm import topi

    from relay_amp._ir import call_te_once
    from relay_amp.runtime import run

    bb, known, built = relax.BlockBuilder(), {}, []
    x, y = relax.Var("x", relax.TensorType((2, 3), "float32")), relax.Var("y", relax.TensorType((3, 2), "float32"))
    n = tvm.tirx.Var("n", "int64")
    z = relax.Var("z", relax.TensorType((n, 2), "float32"))

    def sigmoid(a):
        built.append(a.shape)
        return topi.sigmoid(a)

    with bb.function("main", [x, y, z]):
        with bb.dataflow():
            first = bb.emit(call_te_once(bb, known, "sigmoid", sigmoid, x, primfunc_name_hint="sigmoid"))
            again = bb.emit(call_te_once(bb, known, "sigmoid", sigmoid, first, primfunc_name_hint="sigmoid"))
            other_shape = bb.emit(call_te_once(bb, known, "sigmoid", sigmoid, y, primfunc_name_hint="sigmoid"))
            other_key = bb.emit(call_te_once(bb, known, "tanh", lambda a: topi.tanh(a), x, primfunc_name_hint="tanh"))
            symbolic = bb.emit(call_te_once(bb, known, "sigmoid", sigmoid, z, primfunc_name_hint="sigmoid"))
            out = bb.emit_output(relax.Tuple([again, other_shape, other_key, symbolic]))
        bb.emit_func_output(out)
    mod = bb.get()
    bindings = mod["main"].body.blocks[0].bindings
    assert len(built) == 3  # x's type, y's, z's: `again` called the first PrimFunc
    assert bindings[1].value.args[0].same_as(bindings[0].value.args[0])
    assert len([f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]) == 4
    a = np.linspace(-3, 3, 6, dtype="float32").reshape(2, 3)
    b, c = a.reshape(3, 2) / 2, np.linspace(-2, 2, 4, dtype="float32").reshape(2, 2)
    got = run(mod, [a, b, c])
    for value, expected in zip(got, [_sigmoid(_sigmoid(a)), _sigmoid(b), np.tanh(a), _sigmoid(c)]):
        np.testing.assert_allclose(value, expected, rtol=1e-5)


def _sigmoid(values: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-values))


@T.prim_func(private=True)
def _copy(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):
    for i in range(4):
        y[i] = x[i]


def test_add_func_once_adds_one_primfunc_per_key():
    """A key seen before returns the GlobalVar its first call added, without making the function again."""
    from relay_amp._ir import add_func_once

    bb, known, made = relax.BlockBuilder(), {}, []

    def make():
        made.append(1)
        return _copy

    first = add_func_once(bb, known, "copy", make, "copy")
    assert add_func_once(bb, known, "copy", make, "copy_again").same_as(first) and len(made) == 1
    assert not add_func_once(bb, known, "other", lambda: _copy.with_attr("other", 1), "other").same_as(first)
    assert len(bb.get().functions) == 2


def test_conjuncts_split_a_condition_at_its_ands_and_reads_var_finds_the_variables_it_reads():
    row, lane = tvm.tirx.Var("row", "int32"), tvm.tirx.Var("lane", "int32")
    bound, cut = row < 3, lane < 5
    terms = conjuncts(tvm.tirx.And(tvm.tirx.And(bound, cut), row < lane))
    assert len(terms) == 3 and terms[0].same_as(bound) and terms[1].same_as(cut)
    (alone,) = conjuncts(bound)
    assert alone.same_as(bound)
    assert [reads_var(term, lane) for term in terms] == [False, True, True]


def test_opaque_scheduled_marks_a_primfunc_scheduled_and_opaque_to_fusion():
    """The default schedules skip a function marked scheduled, and FuseOps leaves a call of an opaque one alone
    (relax's kOpaque op pattern, 8)."""
    @T.prim_func(private=True)
    def double(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
        for i in range(4):
            b[i] = a[i] * T.float32(2)

    marked = opaque_scheduled(double)
    assert (bool(marked.attrs["tirx.is_scheduled"]), int(marked.attrs["op_pattern"])) == (True, 8)
    assert double.attrs is None or "op_pattern" not in double.attrs  # the input function is left as it was
