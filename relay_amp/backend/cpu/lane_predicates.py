"""lane_predicates: vector loops whose predicate tells their lanes apart, run in whole vectors but the one it cuts.

A kernel that stores part of its computed channels (`kernels.ConvSpec.stored_channels`: attention scores over 197
tokens computed as 224, a vocabulary of 50257 words as 50272) writes its accumulators back under a predicate on the
channel, `channel < 197`, in 16-lane vectors. TVM's vectorizer runs a loop whose predicate differs between its
lanes one lane at a time (an extract, a compare and a branch per element), and it cannot tell the vectors the
predicate keeps whole from the one it cuts, so every vector of the write-back ran so. `WholeVectorWriteBacks`
splits such a loop, in the scheduled functions, into a test of its last lane and two copies: the vector loop where
every lane passes (its predicate less the lanes' part), a serial loop with the predicate where the vector is cut.

ViT-B's attention scores as a model's output (12x197x64 by 12x64x197, `relay-amp bench attention_scores`), 2-core
Zen 4: the kernel 0.359 -> 0.177 ms in bf16 and 0.427 -> 0.298 ms in fp32 (at 208 stored channels: 0.166 and
0.300), the model bf16 1.41x -> 1.58x fp32, int8 1.25x -> 1.91x. A classifier's 1000 logits or GPT-2's 50257 are
bound by their weights' bytes: those models' outputs are bit-identical and their times unchanged.
"""

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from ..._ir import conjuncts, reads_var


def _conjunction(terms: list) -> tvm.ir.Expr:
    """The terms joined by `and` (true for none)."""
    return tirx.all(*terms) if terms else tirx.const(True, "bool")


def _last_lane_passes(term: tvm.ir.Expr, lane: tirx.Var, last: int) -> "tvm.ir.Expr | None":
    """For `term` an `a < b` whose `a - b` grows with `lane` (a constant positive step), its test at lane `last`
    (every lane before it passes then too); else None."""
    if not isinstance(term, tirx.LT):
        return None
    step, rest = tvm.sym.detect_linear_equation(term.a - term.b, [lane]) or (None, None)
    if not isinstance(step, tirx.IntImm) or step.value <= 0:
        return None
    return tirx.LT(rest + step * last, tirx.const(0, rest.ty))


def _renamed(stmt: tirx.Stmt, variables: list) -> tirx.Stmt:
    """`stmt` with a new variable for each of `variables` (a copy of a loop beside itself keeps one definition of
    each variable)."""
    fresh = [(var, tirx.Var(f"{var.name}_lanes", var.ty)) for var in variables]

    def rename(var: tirx.Var) -> tirx.Var:
        return next((new for old, new in fresh if old.same_as(var)), var)

    return tvm_ffi.structural_map(stmt, [(tirx.Var, rename)])


def _split_vector_loop(loop: tirx.For) -> tirx.Stmt:
    """`loop` split where it is a vector loop of one block whose predicate bounds the lanes from above."""
    if loop.kind != tirx.ForKind.VECTORIZED or not isinstance(loop.body, s_tir.SBlockRealize):
        return loop
    if not isinstance(loop.min, tirx.IntImm) or not isinstance(loop.extent, tirx.IntImm):
        return loop
    realize, lane = loop.body, loop.loop_var
    terms = conjuncts(realize.predicate)
    varying = [term for term in terms if reads_var(term, lane)]
    if not varying:
        return loop
    whole = [_last_lane_passes(term, lane, loop.min.value + loop.extent.value - 1) for term in varying]
    if any(test is None for test in whole):
        return loop
    uniform = _conjunction([term for term in terms if not reads_var(term, lane)])
    vectors = tirx.For(lane, loop.min, loop.extent, loop.kind,
                       s_tir.SBlockRealize(realize.iter_values, uniform, realize.block), loop.thread_binding,
                       loop.annotations)
    lanes = _renamed(tirx.For(lane, loop.min, loop.extent, tirx.ForKind.SERIAL, realize, None, loop.annotations),
                     [lane, *(iter_var.var for iter_var in realize.block.iter_vars)])
    return tirx.IfThenElse(_conjunction(whole), vectors, lanes)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="WholeVectorWriteBacks")
def WholeVectorWriteBacks(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx) -> tirx.PrimFunc:  # noqa: N802
    """Every vector loop of `func` around one block whose predicate bounds its lanes from above, split into its
    whole vectors and the one the bound cuts."""
    body = tvm_ffi.structural_map(func.body, [(tirx.For, _split_vector_loop)])
    return func if body.same_as(func.body) else func.with_body(body)
