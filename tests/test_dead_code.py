"""_dead_code: TVM's dead-code elimination, with the dead dataflow bindings pruned first in one backward sweep."""

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import _dead_code
from relay_amp._dead_code import EliminateDeadCode, remove_all_unused

from pass_checks import assert_transforms


@I.ir_module
class WithDeadCode:
    @R.function
    def main(x: R.Tensor((2, 3), "float32"), n: R.Tensor(ndim=1, dtype="float32")) -> R.Tensor((2, 3), "float32"):
        with R.dataflow():
            dead_head = R.exp(x)  # read only by dead bindings: goes with them
            dead_mid = R.add(dead_head, x)
            dead_tail = R.multiply(dead_mid, dead_mid)
            unread_cast = R.match_cast(n, R.Tensor((3,), "float32"))  # a shape check: stays, read or not
            live = R.add(x, x)
            dead_output = R.subtract(live, x)  # a block output nothing after the block reads
            R.output(live, dead_output)
        unread_outside = R.exp(live)  # outside dataflow blocks TVM's pass removes it
        gv = R.multiply(live, live)
        return gv

    @R.function(private=True)
    def unreachable(x: R.Tensor((2,), "float32")) -> R.Tensor((2,), "float32"):
        return x


@I.ir_module
class WithoutDeadCode:
    @R.function
    def main(x: R.Tensor((2, 3), "float32"), n: R.Tensor(ndim=1, dtype="float32")) -> R.Tensor((2, 3), "float32"):
        with R.dataflow():
            unread_cast = R.match_cast(n, R.Tensor((3,), "float32"))
            live = R.add(x, x)
            R.output(live)
        gv = R.multiply(live, live)
        return gv


def test_dead_bindings_and_unreachable_functions_are_removed_as_tvm_removes_them(monkeypatch):
    monkeypatch.setattr(_dead_code, "SWEPT", 1)
    assert_transforms(EliminateDeadCode(["main"]), WithDeadCode, WithoutDeadCode)
    tvm.ir.assert_structural_equal(relax.transform.DeadCodeElimination(["main"])(WithDeadCode), WithoutDeadCode)


def test_remove_all_unused_gives_tvms_function_and_leaves_its_input_as_it_was(monkeypatch):
    monkeypatch.setattr(_dead_code, "SWEPT", 1)
    text = WithDeadCode.script()
    pruned = remove_all_unused(WithDeadCode["main"])
    relax.analysis.well_formed(pruned)
    tvm.ir.assert_structural_equal(pruned, relax.analysis.remove_all_unused(WithDeadCode["main"]))
    tvm.ir.assert_structural_equal(pruned, WithoutDeadCode["main"])
    assert WithDeadCode.script() == text


def test_tvms_pass_is_handed_a_function_with_no_dead_dataflow_binding(monkeypatch):
    dataflow_block = _handed_to_tvm(monkeypatch, WithDeadCode)["main"].body.blocks[0]
    assert [binding.var.name for binding in dataflow_block.bindings] == ["unread_cast", "live"]  # the sweep's work


def test_a_module_with_nothing_dead_goes_to_tvms_pass_as_it_is(monkeypatch):
    assert _handed_to_tvm(monkeypatch, WithoutDeadCode).same_as(WithoutDeadCode)


def test_functions_shorter_than_swept_go_to_tvms_pass_as_they_are(monkeypatch):
    assert _handed_to_tvm(monkeypatch, WithDeadCode, swept=_dead_code.SWEPT).same_as(WithDeadCode)


def _handed_to_tvm(monkeypatch, mod: tvm.IRModule, swept: int = 1) -> tvm.IRModule:
    """The module EliminateDeadCode hands TVM's DeadCodeElimination when it runs on `mod`, sweeping functions of
    `swept` bindings or more."""
    monkeypatch.setattr(_dead_code, "SWEPT", swept)
    handed = []
    tvms_pass = relax.transform.DeadCodeElimination

    def recording(entry_functions):
        return tvm.transform.module_pass(lambda mod, ctx: handed.append(mod) or tvms_pass(entry_functions)(mod),
                                         opt_level=0, name="recording")

    monkeypatch.setattr(_dead_code.relax.transform, "DeadCodeElimination", recording)
    EliminateDeadCode(["main"])(mod)
    return handed[0]


def test_outputs_are_those_of_the_module_before_on_the_vm(monkeypatch):
    monkeypatch.setattr(_dead_code, "SWEPT", 1)

    @I.ir_module
    class Chain:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                dead = R.sqrt(x)
                scaled = R.multiply(x, R.const(0.5, "float32"))
                dead_again = R.add(dead, scaled)
                gv = R.tanh(scaled)
                R.output(gv)
            return gv

    data = np.random.default_rng(0).uniform(0.1, 2.0, (4, 8)).astype("float32")
    pruned = EliminateDeadCode()(Chain)
    assert "sqrt" not in pruned.script()
    # removal only: the same values exactly
    np.testing.assert_allclose(relay_amp.run(pruned, [data])[0], relay_amp.run(Chain, [data])[0], rtol=0, atol=0)
