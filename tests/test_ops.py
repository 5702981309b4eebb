"""relay_amp.ops helpers that have no pass of their own to be tested through."""

from tvm import relax

from relay_amp._ir import rewrite_function
from relay_amp.ops import bound_call, bound_value, call_op_name, sliced_by_binding, tuple_fields

from builders import single_output_module, tensor


def test_sliced_by_binding_names_what_a_bound_slice_reads_and_nothing_else():
    x = tensor("x", (4, 8))
    mod = single_output_module(
        lambda x: relax.op.negative(relax.op.exp(relax.op.strided_slice(x, axes=[1], begin=[0], end=[4]))), x)
    found = {}

    @relax.expr_functor.mutator
    class Probe(relax.PyExprMutator):
        def visit_call_(self, call: relax.Call) -> relax.Expr:
            new_call = super().visit_call_(call)
            found.setdefault(call_op_name(new_call), sliced_by_binding(self, new_call.args[0]))
            return new_call

    rewrite_function(Probe(mod), mod, "main")
    assert found["relax.exp"].same_as(x)  # exp reads a var bound to a slice of x
    assert found["relax.negative"] is None  # negative reads a var bound to exp
    assert found["relax.strided_slice"] is None  # x is a parameter: no binding


def test_bound_call_finds_a_var_bound_to_a_call_of_the_op_named():
    x = tensor("x", (4, 8))
    mod = single_output_module(lambda x: relax.op.negative(relax.op.exp(x)), x)
    found = {}

    @relax.expr_functor.mutator
    class Probe(relax.PyExprMutator):
        def visit_call_(self, call: relax.Call) -> relax.Expr:
            new_call = super().visit_call_(call)
            arg = new_call.args[0]
            found[call_op_name(new_call)] = (bound_call(self, arg, "relax.exp"), bound_call(self, arg, "relax.add"))
            return new_call

    rewrite_function(Probe(mod), mod, "main")
    exp_call, not_add = found["relax.negative"]
    assert call_op_name(exp_call) == "relax.exp" and exp_call.args[0].same_as(x) and not_add is None
    assert found["relax.exp"] == (None, None)  # x is a parameter: no binding


def test_tuple_fields_reads_a_tuple_in_place_or_through_its_binding():
    a, b = tensor("a", (2, 3)), tensor("b", (2, 3))
    builder = relax.BlockBuilder()
    with builder.function("main", [a, b]):
        with builder.dataflow():
            pair = builder.emit(relax.Tuple([a, b]))
            total = builder.emit_output(relax.op.add(a, b))
        builder.emit_func_output(total)
        bound, inline, other = (tuple_fields(builder, expr) for expr in (pair, relax.Tuple([b, a]), total))
    assert [field.same_as(var) for field, var in zip(bound, (a, b))] == [True, True]
    assert [field.same_as(var) for field, var in zip(inline, (b, a))] == [True, True]
    assert other is None


def test_bound_value_reads_through_a_vars_binding_and_passes_anything_else():
    a = tensor("a", (2, 3))
    builder = relax.BlockBuilder()
    with builder.function("main", [a]):
        with builder.dataflow():
            doubled = builder.emit(relax.op.add(a, a))
            total = builder.emit_output(relax.op.multiply(doubled, a))
        builder.emit_func_output(total)
        inline = relax.op.exp(a)
        found = [bound_value(builder, expr) for expr in (doubled, inline, a)]
    assert call_op_name(found[0]) == "relax.add" and found[1].same_as(inline) and found[2] is None
