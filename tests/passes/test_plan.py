"""The precision plan: recorded per call, saved, edited by hand and re-applied."""

import json

import pytest
import tvm

import relay_amp
from relay_amp import models
from relay_amp.passes.amp import PrecisionPlan
from relay_amp.passes.amp.plan import PLAN_ATTR


@pytest.fixture(scope="module")
def cnn():
    return models.small_cnn()


def test_plan_records_every_float_op_call_with_dtype_and_reason(cnn):
    plan = relay_amp.precision_plan(relay_amp.to_mixed_precision(cnn, "float16"))
    by_op = {(e.op, e.dtype, e.reason) for e in plan.entries}
    assert ("relax.nn.conv2d", "float16", "target list") in by_op
    assert ("relax.nn.batch_norm", "float32", "fp32 list") in by_op
    assert ("relax.nn.adaptive_avg_pool2d", "float32", "fp32 list") in by_op
    assert [e.index for e in plan.entries] == sorted(e.index for e in plan.entries)
    assert plan.casts_inserted > 0
    summary = plan.summary()
    assert "target list" in summary and f"{plan.casts_inserted} casts inserted" in summary


def test_plan_round_trips_through_json_and_reapplies_identically(cnn, tmp_path):
    converted = relay_amp.to_mixed_precision(cnn, "bfloat16", excluded_layers=[1])
    plan = relay_amp.precision_plan(converted)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = PrecisionPlan.load(path)
    assert loaded == plan
    reapplied = relay_amp.apply_plan(cnn, loaded)
    tvm.ir.assert_structural_equal(reapplied.without_attr(PLAN_ATTR), converted.without_attr(PLAN_ATTR))
    assert {e.reason for e in relay_amp.precision_plan(reapplied).entries} == {"plan"}


def test_hand_edited_plan_moves_a_layer_back_to_fp32(cnn, tmp_path):
    plan = relay_amp.precision_plan(relay_amp.to_mixed_precision(cnn, "float16"))
    data = json.loads(plan.to_json())
    first_conv = next(e for e in data["entries"] if e["op"] == "relax.nn.conv2d")
    first_conv["dtype"] = "float32"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    reapplied = relay_amp.apply_plan(cnn, PrecisionPlan.load(path))
    entry = next(e for e in relay_amp.precision_plan(reapplied).entries if e.index == first_conv["index"])
    assert (entry.dtype, entry.reason) == ("float32", "plan")
    first = relay_amp.list_layers(reapplied)[0]
    assert first.input_dtypes == ("float32", "float32")


def test_plan_that_does_not_match_the_module_is_rejected(cnn):
    plan = relay_amp.precision_plan(relay_amp.to_mixed_precision(cnn, "float16"))
    with pytest.raises(relay_amp.LayerIndexError, match="does not match"):
        relay_amp.apply_plan(models.bert_encoder(seq_len=8, layers=1), plan)


def test_corrupt_plan_file_and_missing_plan_are_clear_errors(tmp_path, cnn):
    path = tmp_path / "bad.json"
    path.write_text('{"format": 1, "entries": [{"index": 0}]}')
    with pytest.raises(relay_amp.ModelLoadError, match="bad.json"):
        PrecisionPlan.load(path)
    with pytest.raises(relay_amp.ModelLoadError, match="absent.json"):
        PrecisionPlan.load(tmp_path / "absent.json")
    with pytest.raises(relay_amp.ModuleError, match="no precision plan"):
        relay_amp.precision_plan(cnn)
