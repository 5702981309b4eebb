"""profile: per-call times of a build, variants lined up by the ops each call computes."""

import json

import pytest

from relay_amp import OptionError, models
from relay_amp.tools.cli import main
from relay_amp.compile.build import build
from relay_amp.tools import profile as profile_module
from relay_amp.tools.profile import (WHOLE_RUN, call_group, call_key, call_times, format_profile, profile,
                                     profile_to_json)


@pytest.mark.parametrize("symbol, group", [
    ("fused_reshape7_cast4_add5_divide_erf_add6_multiply1_reshape8", "add_divide_erf_add_multiply"),
    ("fused_add1_divide_erf_add_multiply_reshape2", "add_divide_erf_add_multiply"),
    ("fused_reshape4_reshape5_split2", "split"),  # GPT-2's fp32 QKV split; bf16 fuses one reshape elsewhere
    ("reshape3", "reshape"),
    ("relay_amp_dot_kernel12", "relay_amp_dot_kernel"),
    ("fused_astype3", "cast"),
    ("fused_conv2d3_add2_maximum_minimum_pad1", "conv2d_add_maximum_minimum"),  # the pad a bf16 build adds
    ("pad4", "pad"),
    # LeViT's attention bias and mask in bf16, whose slice trims scores computed over whole pairs of column blocks
    ("fused_reshape7_add_cast1_cast2_add1_strided_slice", "add_add"),
    ("fused_reshape7_add_add1", "add_add"),  # the same in fp32
    ("fused_reshape24_strided_slice2", "strided_slice"),
    ("fused_strided_slice4_pad3", "pad"),  # RegNetY's bf16 trims its channel padding and pads, fp32 pads alone
    ("vm.builtin.alloc_storage", "vm.builtin.alloc_storage"),
])
def test_call_groups_drop_casts_pads_slices_reshapes_and_numbering(symbol, group):
    assert call_group(symbol) == group


def test_profile_lines_up_dtype_variants_worst_penalty_first():
    rows = profile(models.small_cnn(), ["float32", "bfloat16"], "cpu", repeat=2)
    penalties = [row.penalty("float32", "bfloat16") for row in rows]
    assert penalties == sorted(penalties, reverse=True)
    both = [row for row in rows if set(row.ms) == {"float32", "bfloat16"}]
    # the convs of both builds are one row: relay_amp's kernel (where the host has AVX-512), else TVM's conv2d
    assert any("conv2d" in row.group or "dot_kernel" in row.group for row in both)
    assert all(row.calls[d] >= 1 and row.ms[d] >= 0 for row in rows for d in row.ms)
    table = format_profile(rows, ["float32", "bfloat16"], top=3)
    assert "bfloat16 / float32" in table and table.splitlines()[-2].startswith("total")
    assert json.loads(profile_to_json(rows, model="small_cnn"))["rows"][0]["group"] == rows[0].group


def test_whole_runs_without_the_hook_are_a_row_of_their_own_apart_from_the_total():
    """The hook's own time falls inside every call's, so profile also times each variant's whole run without it:
    one call per run, positive, and no part of the total of the call groups."""
    rows = profile(models.small_cnn(), ["float32", "bfloat16"], "cpu", repeat=2)
    whole = [row for row in rows if row.group == WHOLE_RUN]
    assert len(whole) == 1 and whole[0].calls == {"float32": 1, "bfloat16": 1}
    assert all(ms > 0 for ms in whole[0].ms.values())
    lines = format_profile(rows, ["float32", "bfloat16"]).splitlines()
    calls_total = sum(row.ms["float32"] for row in rows if row.group != WHOLE_RUN and "float32" in row.ms)
    assert lines[-2].split()[:2] == ["total", f"{calls_total:.3f}"] and lines[-1].startswith(WHOLE_RUN)


def test_by_shape_splits_the_kernels_by_the_result_each_writes():
    """The kernels of a model are one call group; by shape, each output shape is a row of its own, lined up across
    the dtypes (the fp32 and bf16 kernels of a conv write the same shape), and a shape longer than the table's
    column is kept whole."""
    class Tensor:
        def __init__(self, shape):
            self.shape = shape

    assert call_key("relay_amp_dot_kernel7", [Tensor((1, 8, 8, 16)), Tensor((2, 3)), Tensor((1, 8, 8, 32))]) \
        == "relay_amp_dot_kernel -> (1, 8, 8, 32)"
    assert call_key("vm.builtin.alloc_tensor", [Tensor((4,))]) == "vm.builtin.alloc_tensor"
    rows = profile(models.small_cnn(), ["float32", "bfloat16"], "cpu", repeat=1, by_shape=True)
    convs = [row for row in rows if " -> (" in row.group and ("conv2d" in row.group or "dot_kernel" in row.group)]
    assert len({row.group for row in convs}) >= 2 and any(set(row.ms) == {"float32", "bfloat16"} for row in convs)
    long = profile_module.ProfileRow("x" * 90 + " -> (1, 56, 56, 144)", {"float32": 1}, {"float32": 0.1})
    assert "(1, 56, 56, 144)" in format_profile([long], ["float32"])


def test_call_times_run_the_variants_in_turn_rotating_the_first(monkeypatch):
    order = []
    timed_run = profile_module._CallTimer.run
    monkeypatch.setattr(profile_module._CallTimer, "run", lambda self: (order.append(id(self)), timed_run(self)))
    mod = models.small_cnn()
    executable = build(mod, "cpu")
    times = call_times({"a": executable, "b": executable}, models.example_inputs(mod), repeat=3, warmup=0)
    first, second = order[:2]
    assert first != second and order == [first, second, second, first, first, second]
    assert set(times) == {"a", "b"} and times["a"].keys() == times["b"].keys()


def test_profile_needs_a_dtype_and_a_positive_repeat():
    with pytest.raises(OptionError, match="at least one dtype"):
        profile(models.small_cnn(), [])
    with pytest.raises(OptionError, match="repeat must be at least 1"):
        profile(models.small_cnn(), ["float32"], repeat=0)


def test_cli_profile_prints_the_table_and_one_line_errors(capsys):
    assert main(["profile", "small_cnn", "--dtypes", "fp32,bf16", "--repeat", "1", "--top", "3"]) == 0
    assert "call group" in capsys.readouterr().out
    assert main(["profile", "small_cnn", "--repeat", "1", "--by-shape", "--json"]) == 0
    assert any(" -> (" in row["group"] for row in json.loads(capsys.readouterr().out)["rows"])
    assert main(["profile", "small_cnn", "--repeat", "0"]) == 1
    assert capsys.readouterr().err.strip() == "relay-amp: error: repeat must be at least 1, got 0"
