"""Shared ranges: quantized layers whose inputs are moves of one value (a split's halves, their concat) get one range,
so the CPU pipeline computes their codes once and moves bytes."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp.passes.quantize.observers import Histogram, merged, threshold
from relay_amp.passes.quantize.shared import moved_input_groups
from relay_amp.runtime import run_executable

from builders import tensor
from pass_checks import prepared_calls


def _c2f(bottleneck_gain: float = 1.0) -> tuple[tvm.IRModule, list]:
    """YOLOv8's C2f block in small: a conv's output split in halves, a bottleneck conv on the second, the halves and
    the bottleneck's output (times `bottleneck_gain`) concatenated for a last conv. Also the vars x, b, joined."""
    rng = np.random.default_rng(0)

    def conv(data, out_channels, in_channels, kernel):
        weight = rng.standard_normal((out_channels, in_channels, kernel, kernel)).astype("float32") * 0.3
        return relax.op.nn.conv2d(data, relax.const(weight), padding=kernel // 2)

    x = tensor("x", (1, 8, 8, 8))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            first = bb.emit(relax.op.nn.relu(conv(x, 16, 8, 1)))
            halves = bb.emit(relax.op.split(first, 2, axis=1))
            a, b = bb.emit(relax.TupleGetItem(halves, 0)), bb.emit(relax.TupleGetItem(halves, 1))
            bottleneck = bb.emit(relax.op.nn.relu(conv(b, 8, 8, 3)))
            gained = bb.emit(relax.op.multiply(bottleneck, relax.const(bottleneck_gain)))
            joined = bb.emit(relax.op.concat([a, b, gained], axis=1))
            out = bb.emit_output(conv(joined, 8, 24, 1))
        bb.emit_func_output(out)
    return bb.get(), [x, b, joined]


def _calibration(count: int = 4) -> list:
    rng = np.random.default_rng(1)
    return [rng.standard_normal((1, 8, 8, 8)).astype("float32") for _ in range(count)]


def test_layer_inputs_that_are_moves_of_one_value_form_a_group():
    mod, (x, b, joined) = _c2f()
    assert moved_input_groups(mod["main"], [x, b, joined]) == [[1, 2]]  # x reaches nothing the others do
    assert moved_input_groups(mod["main"], [x, b]) == []


def test_layers_reading_moves_of_one_value_share_the_range_of_both_their_inputs():
    quantized = relay_amp.quantize(_c2f()[0], _calibration())
    first, bottleneck, last = relay_amp.quant_plan(quantized).entries
    alone = relay_amp.quant_plan(relay_amp.quantize(_c2f()[0], _calibration(), excluded_layers=[2])).entries[1]
    assert bottleneck.threshold == last.threshold > alone.threshold  # minmax over both inputs: the larger one
    assert bottleneck.reason.endswith("one range with layers 1, 2") and last.reason == bottleneck.reason
    assert "one range" not in first.reason


def test_shared_ranges_can_be_turned_off():
    entries = relay_amp.quant_plan(relay_amp.quantize(_c2f()[0], _calibration(), shared_ranges=False)).entries
    assert not any("one range" in entry.reason for entry in entries) and entries[1].threshold < entries[2].threshold


def test_a_range_over_twice_a_members_own_is_not_shared():
    """The bottleneck's output, 10x larger, would leave the bottleneck conv's input a tenth of the codes."""
    entries = relay_amp.quant_plan(relay_amp.quantize(_c2f(bottleneck_gain=10.0)[0], _calibration())).entries
    assert not any("one range" in entry.reason for entry in entries)
    assert entries[2].threshold > 2 * entries[1].threshold


def test_the_cpu_pipeline_concatenates_the_codes_the_kernels_store():
    """Each kernel stores its output's codes (the first conv's are split), and the concat moves bytes; the build
    computes what the quantized module does."""
    quantized = relay_amp.quantize(_c2f()[0], _calibration())
    concats = prepared_calls(quantized, "concatenate")
    assert len(concats) == 1 and [field.ty.dtype for field in concats[0].args[1].fields] == ["uint8"] * 3
    x = _calibration(5)[-1]
    got = run_executable(relay_amp.build(quantized, relay_amp.targets.host_preset()), [x])[0]
    reference = relay_amp.run(quantized, [x])[0]
    np.testing.assert_allclose(got, reference, atol=0.01 * np.abs(reference).max())  # a code's rounding apart


@pytest.mark.parametrize("observer", ["minmax", "percentile", "entropy"])
def test_a_merged_histogram_counts_every_value_of_its_parts(observer):
    rng = np.random.default_rng(2)
    small, large = rng.standard_normal(5000), np.concatenate([rng.standard_normal(5000) * 4, np.zeros(7)])
    parts = [Histogram(), Histogram()]
    parts[0].add(small)
    parts[1].add(large)
    together = Histogram()
    together.add(np.concatenate([small, large]))
    both = merged(parts)
    assert (both.top, both.minimum, both.zeros) == (together.top, together.minimum, 7)
    assert both.counts.sum() == together.counts.sum() == 10000
    assert threshold(both, observer, 127) == pytest.approx(threshold(together, observer, 127), rel=0.02)
