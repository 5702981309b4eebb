"""passes.blocks: long dataflow blocks cut where the fewest values cross, the values read past a cut handed over."""

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from relay_amp.passes.blocks import blocks_cut, blocks_joined

from pass_checks import assert_transforms


@I.ir_module
class Chain:
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        with R.dataflow():
            a = R.exp(x)
            b = R.add(a, x)
            c = R.multiply(b, b)
            d = R.add(c, a)
            gv = R.tanh(d)
            R.output(gv)
        return gv


@I.ir_module
class HandedOver:  # the parser joins adjacent dataflow blocks: this is the cut's two pieces, joined
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        with R.dataflow():
            a = R.exp(x)
            b = R.add(a, x)
            c = R.multiply(b, b)
            a_1 = a
            c_1 = c
            d = R.add(c_1, a_1)
            gv = R.tanh(d)
            R.output(a_1, c_1, gv)
        return gv


def test_a_block_past_the_limit_is_cut_where_the_fewest_values_cross_and_those_are_handed_over():
    cut = blocks_cut(Chain, limit=3)
    # after b two values cross (a, b), after c two (a, c): the later of equals; a and c handed over
    assert [len(block.bindings) for block in cut["main"].body.blocks] == [5, 2]
    assert_transforms(lambda mod: blocks_joined(blocks_cut(mod, limit=3)), Chain, HandedOver)


def test_blocks_within_the_limit_and_single_blocks_come_back_as_they_were():
    assert blocks_cut(Chain, limit=5).same_as(Chain)
    assert blocks_joined(Chain).same_as(Chain)


def test_a_value_read_two_pieces_later_is_handed_over_once():
    @I.ir_module
    class ReadLate:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            with R.dataflow():
                a = R.exp(x)
                b = R.add(a, x)
                c = R.multiply(b, b)
                d = R.add(c, c)
                gv = R.add(d, a)
                R.output(gv)
            return gv

    cut = blocks_cut(ReadLate, limit=2)
    pieces = cut["main"].body.blocks
    assert [[binding.var.name for binding in piece.bindings] for piece in pieces] == [
        ["a", "b", "a", "b"], ["c", "d", "d"], ["gv"]]
    tvm.relax.analysis.well_formed(cut)
    d_read, a_read = pieces[2].bindings[0].value.args
    assert d_read.same_as(pieces[1].bindings[2].var) and a_read.same_as(pieces[0].bindings[2].var)  # hand-overs
