"""OutputReshapesAsViews: a reshape bound to a block's output is a view of a tensor the block computed for it
alone; a kernel result that is the model's output (logits) is not copied. ContiguousTakesAsViews: a take of one
index that selects an aligned contiguous block is a view of it."""

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import relay_amp
from relay_amp.backend.views import ContiguousTakesAsViews, OutputReshapesAsViews
from relay_amp.runtime import virtual_machine

from pass_checks import assert_transforms


@I.ir_module
class ReshapedOutput:
    @T.prim_func(private=True, s_tir=True)
    def double(x: T.Buffer((T.int64(1), T.int64(8)), "float32"), y: T.Buffer((T.int64(1), T.int64(8)), "float32")):
        for i in range(T.int64(8)):
            with T.sblock("double"):
                v = T.axis.spatial(T.int64(8), i)
                y[T.int64(0), v] = x[T.int64(0), v] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def reshape(x: T.Buffer((T.int64(1), T.int64(8)), "float32"), y: T.Buffer((T.int64(2), T.int64(4)), "float32")):
        for i, j in T.grid(T.int64(2), T.int64(4)):
            with T.sblock("reshape"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[T.int64(0), vi * T.int64(4) + vj]

    @T.prim_func(private=True, s_tir=True)
    def leading(x: T.Buffer((T.int64(1), T.int64(8)), "float32"), y: T.Buffer((T.int64(1), T.int64(5)), "float32")):
        for j in range(T.int64(5)):
            with T.sblock("leading"):
                vj = T.axis.spatial(T.int64(5), j)
                y[T.int64(0), vj] = x[T.int64(0), vj]

    @R.function
    def main(x: R.Tensor((1, 8), "float32")) -> R.Tuple(R.Tensor((2, 4), "float32"), R.Tensor((2, 4), "float32")):
        cls = ReshapedOutput
        with R.dataflow():
            doubled = R.call_tir(cls.double, (x,), out_ty=R.Tensor((1, 8), "float32"))
            viewed = R.call_tir(cls.reshape, (doubled,), out_ty=R.Tensor((2, 4), "float32"))
            shared = R.call_tir(cls.double, (x,), out_ty=R.Tensor((1, 8), "float32"))
            copied = R.call_tir(cls.reshape, (shared,), out_ty=R.Tensor((2, 4), "float32"))
            input_copy = R.call_tir(cls.reshape, (x,), out_ty=R.Tensor((2, 4), "float32"))
            doubled_again = R.call_tir(cls.double, (x,), out_ty=R.Tensor((1, 8), "float32"))
            first = R.call_tir(cls.leading, (doubled_again,), out_ty=R.Tensor((1, 5), "float32"))
            gv = (viewed, copied, shared, input_copy, first)
            R.output(viewed, copied, shared, input_copy, first, gv)
        return (viewed, copied)


def test_only_a_reshape_of_a_tensor_computed_for_it_alone_becomes_a_view():
    """Not one of a tensor another output holds, not one of an input, not a slice of leading values (a reshape's
    pattern, fewer values)."""

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def double(x: T.Buffer((T.int64(1), T.int64(8)), "float32"),
                   y: T.Buffer((T.int64(1), T.int64(8)), "float32")):
            for i in range(T.int64(8)):
                with T.sblock("double"):
                    v = T.axis.spatial(T.int64(8), i)
                    y[T.int64(0), v] = x[T.int64(0), v] * T.float32(2)

        @T.prim_func(private=True, s_tir=True)
        def reshape(x: T.Buffer((T.int64(1), T.int64(8)), "float32"),
                    y: T.Buffer((T.int64(2), T.int64(4)), "float32")):
            for i, j in T.grid(T.int64(2), T.int64(4)):
                with T.sblock("reshape"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[T.int64(0), vi * T.int64(4) + vj]

        @T.prim_func(private=True, s_tir=True)
        def leading(x: T.Buffer((T.int64(1), T.int64(8)), "float32"),
                    y: T.Buffer((T.int64(1), T.int64(5)), "float32")):
            for j in range(T.int64(5)):
                with T.sblock("leading"):
                    vj = T.axis.spatial(T.int64(5), j)
                    y[T.int64(0), vj] = x[T.int64(0), vj]

        @R.function
        def main(x: R.Tensor((1, 8), "float32")) -> R.Tuple(R.Tensor((2, 4), "float32"),
                                                             R.Tensor((2, 4), "float32")):
            cls = Expected
            with R.dataflow():
                doubled = R.call_tir(cls.double, (x,), out_ty=R.Tensor((1, 8), "float32"))
                viewed = R.reshape(doubled, R.shape([2, 4]))
                shared = R.call_tir(cls.double, (x,), out_ty=R.Tensor((1, 8), "float32"))
                copied = R.call_tir(cls.reshape, (shared,), out_ty=R.Tensor((2, 4), "float32"))
                input_copy = R.call_tir(cls.reshape, (x,), out_ty=R.Tensor((2, 4), "float32"))
                doubled_again = R.call_tir(cls.double, (x,), out_ty=R.Tensor((1, 8), "float32"))
                first = R.call_tir(cls.leading, (doubled_again,), out_ty=R.Tensor((1, 5), "float32"))
                gv = (viewed, copied, shared, input_copy, first)
                R.output(viewed, copied, shared, input_copy, first, gv)
            return (viewed, copied)

    assert_transforms(OutputReshapesAsViews(), ReshapedOutput, Expected)


def test_a_module_without_main_is_left_as_it_is():
    kernels_only = tvm.IRModule({"double": ReshapedOutput["double"]})
    assert OutputReshapesAsViews()(kernels_only).same_as(kernels_only)


def _logits_model(weight: np.ndarray) -> tvm.IRModule:
    builder = relax.BlockBuilder()
    hidden = relax.Var("hidden", relax.TensorType((1, 24, weight.shape[0]), "float32"))
    with builder.function("main", [hidden]):
        with builder.dataflow():
            logits = builder.emit_output(relax.op.matmul(hidden, relax.const(weight)))
        builder.emit_func_output(logits)
    return builder.get()


def test_a_kernel_result_returned_by_the_model_is_its_own_storage_on_every_run():
    """The logits come from the kernel through a view, not a copy (the build has no reshape or slice PrimFunc), and
    the view is fresh storage per run: a second run leaves the first run's output as it was (fp32, within 1e-5)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((32, 45)).astype("float32")  # 45 channels: the kernel computes 48, stores 45
    executable = relay_amp.build(_logits_model(weight), relay_amp.targets.host_preset())
    called = {line.split()[1] for line in executable.as_text().splitlines() if line.strip().startswith("call ")}
    copies = [name for name in called if ("reshape" in name or "slice" in name) and not name.startswith("vm.")]
    assert not copies, called
    vm = virtual_machine(executable)
    first, second = (rng.standard_normal((1, 24, 32)).astype("float32") for _ in range(2))
    kept = vm["main"](tvm.runtime.tensor(first))
    vm["main"](tvm.runtime.tensor(second))
    np.testing.assert_allclose(kept.numpy(), first @ weight, rtol=1e-5, atol=1e-5)


@I.ir_module
class Takes:
    @R.function
    def main(x: R.Tensor((3, 2, 16), "float32"), odd: R.Tensor((3, 5), "float32"),
             flat: R.Tensor((1, 4, 16), "float32")):
        with R.dataflow():
            y = R.multiply(x, R.const(2.0, "float32"))
            row = R.take(y, R.const(1, "int64"), axis=0)
            inner = R.take(y, R.const(1, "int64"), axis=1)
            of_input = R.take(x, R.const(2, "int64"), axis=-3)
            misaligned = R.take(odd, R.const(1, "int64"), axis=0)
            past_unit_axis = R.take(flat, R.const(3, "int64"), axis=1)
            rows = R.take(y, R.const([0, 2], "int64"), axis=0)
            out_of_range = R.take(y, R.const(3, "int64"), axis=0, mode="clip")
            gv = (row, inner, of_input, misaligned, past_unit_axis, rows, out_of_range)
            R.output(gv)
        return gv


def test_a_take_of_one_index_that_selects_an_aligned_contiguous_block_becomes_a_view():
    """A row along the leading axis (of a computed tensor or an input), and one along an axis after unit ones; not
    a take along an inner axis past an outer one (strided), one of 20-byte rows (off TVM's 64-byte alignment), one
    of several indices, nor one out of range (TVM's take clips it)."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((3, 2, 16), "float32"), odd: R.Tensor((3, 5), "float32"),
                 flat: R.Tensor((1, 4, 16), "float32")):
            with R.dataflow():
                y = R.multiply(x, R.const(2.0, "float32"))
                row_view = R.memory.view(y, R.shape([2, 16]), R.dtype("float32"), R.prim_value(128))
                row = R.memory.ensure_zero_offset(row_view)
                inner = R.take(y, R.const(1, "int64"), axis=1)
                input_view = R.memory.view(x, R.shape([2, 16]), R.dtype("float32"), R.prim_value(256))
                of_input = R.memory.ensure_zero_offset(input_view)
                misaligned = R.take(odd, R.const(1, "int64"), axis=0)
                flat_view = R.memory.view(flat, R.shape([1, 16]), R.dtype("float32"), R.prim_value(192))
                past_unit_axis = R.memory.ensure_zero_offset(flat_view)
                rows = R.take(y, R.const([0, 2], "int64"), axis=0)
                out_of_range = R.take(y, R.const(3, "int64"), axis=0, mode="clip")
                gv = (row, inner, of_input, misaligned, past_unit_axis, rows, out_of_range)
                R.output(gv)
            return gv

    assert_transforms(ContiguousTakesAsViews(), Takes, Expected)


@I.ir_module
class TakePastUnitAxesTransposed:
    @R.function
    def main(x: R.Tensor((1, 3, 4, 16), "float32")):
        with R.dataflow():
            y = R.multiply(x, R.const(2.0, "float32"))
            gv = R.permute_dims(R.take(y, R.const(2, "int64"), axis=1), [0, 2, 1])
            R.output(gv)
        return gv


def test_a_take_past_unit_axes_keeps_them_for_a_reader_that_counts_them():
    """A take of one index along an axis after unit axes (a qkv split of a batch of one, as the dynamo exporter
    writes CSATv2's attention) is a view with those unit axes: a transpose reading it as 3-D builds and computes
    numpy's result. The view once dropped them, and the transpose's type check failed the build."""
    x = np.random.default_rng(0).standard_normal((1, 3, 4, 16)).astype("float32")
    vm = virtual_machine(relay_amp.build(TakePastUnitAxesTransposed, relay_amp.targets.host_preset()))
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(got, np.transpose(2 * x[:, 2], (0, 2, 1)))


@I.ir_module
class ViewedPastLastRead:
    @R.function
    def main(x: R.Tensor((3, 2, 16), "float32")):
        with R.dataflow():
            doubled = R.multiply(x, R.const(2.0, "float32"))
            row = R.take(doubled, R.const(1, "int64"), axis=0)
            tripled = R.multiply(x, R.const(3.0, "float32"))  # doubled's size, allocated after its last read
            gv = R.add(row, R.take(tripled, R.const(2, "int64"), axis=0))
            R.output(gv)
        return gv


def test_takes_read_as_views_compute_what_copies_do_on_every_run():
    """Built and run twice: the views read the rows they stand for (exactly), the kept takes stay functions, and
    the memory planner keeps a viewed tensor's storage while its view is read, though the view is the tensor's
    last reader (a tensor of its size allocated after that would otherwise take its storage)."""
    rng = np.random.default_rng(0)
    executable = relay_amp.build(Takes, relay_amp.targets.host_preset())
    called = {line.split()[1] for line in executable.as_text().splitlines() if line.strip().startswith("call ")}
    assert "vm.builtin.ensure_zero_offset" in called and len([name for name in called if "take" in name]) == 4
    vm, reused = virtual_machine(executable), virtual_machine(relay_amp.build(ViewedPastLastRead, "cpu"))
    for _ in range(2):
        x, odd, flat = (rng.standard_normal(shape).astype("float32") for shape in ((3, 2, 16), (3, 5), (1, 4, 16)))
        got = [item.numpy() for item in vm["main"](*(tvm.runtime.tensor(v) for v in (x, odd, flat)))]
        y = 2 * x
        expected = [y[1], y[:, 1], x[2], odd[1], flat[:, 3], y[[0, 2]], y[2]]
        for value, want in zip(got, expected):
            assert value.shape == want.shape
            np.testing.assert_array_equal(value, want)
        np.testing.assert_array_equal(reused["main"](tvm.runtime.tensor(x)).numpy(), 2 * x[1] + 3 * x[2])
