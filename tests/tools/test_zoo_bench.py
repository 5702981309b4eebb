"""The zoo benchmark: slow-path detection, and the files it writes."""

import json

import pytest

pytest.importorskip("torch")
zoo_bench = pytest.importorskip("relay_amp.tools.zoo_bench")

from relay_amp import ModelLoadError, targets  # noqa: E402
from relay_amp.tools.cli import main  # noqa: E402
from relay_amp.tools.profile import ProfileRow  # noqa: E402


def test_slow_paths_are_groups_much_slower_in_bf16():
    rows = [ProfileRow("erf", {}, {"float32": 0.1, "bfloat16": 2.0}),  # 20x and most of the time
            ProfileRow("matmul", {}, {"float32": 4.0, "bfloat16": 2.0}),  # faster
            ProfileRow("cast", {}, {"bfloat16": 0.01})]  # new, but too small to matter
    assert zoo_bench.slow_paths(rows) == ["erf 0.10->2.00 ms"]


def test_bench_zoo_writes_json_markdown_and_chart(tmp_path):
    results = zoo_bench.bench_zoo(["distilbert"], ["bfloat16"], "cpu", tmp_path, rounds=1, repeat=1, tiny=True)
    ms = results[0].ms
    assert {"relay_amp fp32", "relay_amp bf16", "torch fp32", "torch bf16", "onnxruntime fp32"} <= set(ms)
    assert results[0].error["relay_amp fp32"] < 1e-4  # the same weights in every runtime
    saved = json.loads((tmp_path / "zoo.json").read_text())
    assert saved["models"][0]["model"] == "distilbert" and saved["dtypes"] == ["bfloat16"]
    assert saved["core"] == str(targets.get_target("cpu").attrs["mcpu"])  # the suite names no model: the cpu's own
    assert "| distilbert |" in (tmp_path / "zoo.md").read_text()
    assert (tmp_path / "zoo.png").read_bytes()[:4] == b"\x89PNG"


def test_a_model_that_fails_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    def bench_model(name, dtypes, target, **options):
        if name == "gpt2":
            raise ModelLoadError("cannot import ONNX model 'main_graph': list assignment index out of range")
        return zoo_bench.ZooResult(name, ms={"relay_amp fp32": 2.0, "torch fp32": 4.0},
                                   error={"relay_amp fp32": 0.0, "torch fp32": 0.0})

    monkeypatch.setattr(zoo_bench, "bench_model", bench_model)
    assert main(["bench", "zoo:gpt2,bert", "--results", str(tmp_path)]) == 1
    error = capsys.readouterr().err.strip()
    assert error == ("relay-amp: error: 1 of 2 zoo models failed: gpt2 (cannot import ONNX model 'main_graph': list "
                     "assignment index out of range)")
    rows = {line.split("|")[1].strip(): line for line in (tmp_path / "zoo.md").read_text().splitlines()[2:]}
    assert "failed: cannot import ONNX model" in rows["gpt2"] and "2.00 (0e+00)" in rows["bert"]
    saved = json.loads((tmp_path / "zoo.json").read_text())["models"]
    assert [(m["model"], bool(m["failure"])) for m in saved] == [("gpt2", True), ("bert", False)]
    assert zoo_bench.failures([zoo_bench.ZooResult("bert")]) == ""


def test_cli_bench_zoo_rejects_an_unknown_model_in_one_line(capsys):
    assert main(["bench", "zoo:resnet9"]) == 1
    assert "unknown zoo model 'resnet9'" in capsys.readouterr().err


@pytest.mark.parametrize("name, kind_metric", [("resnet50", "top-1 share"), ("distilbert", "min cosine")])
def test_int8q_runs_beside_onnxruntime_int8_and_both_are_checked_against_fp32(name, kind_metric):
    result = zoo_bench.bench_model(name, ["int8q"], "cpu", rounds=1, repeat=1, tiny=True)
    runners = {"relay_amp int8q", zoo_bench.ORT_INT8, zoo_bench.ORT_FILE_INT8}
    assert runners <= set(result.ms)
    assert set(result.agreement) == runners
    floor = 0.9 if kind_metric == "top-1 share" else 0.98  # tiny random models; the full ones are in the README
    assert result.agreement["relay_amp int8q"] >= floor, kind_metric
    assert result.agreement[zoo_bench.ORT_FILE_INT8] >= floor, kind_metric  # ONNX Runtime's file, realized by us
    table = zoo_bench.markdown_table([result])
    assert "int8q vs ORT int8" in table and "ORT's int8 file: relay_amp vs ORT" in table and f"| {name} |" in table


def test_onnxruntimes_quantizer_failing_leaves_its_int8_columns_failed_and_the_rest_measured(monkeypatch):
    """ONNX Runtime's quantizer raised a bare Exception on Swin-T's file, which ended a whole zoo run; now its two
    int8 runners are recorded as failed, with why, and relay_amp's int8q is timed and checked as usual."""
    def quantizer(*args):
        raise Exception("Incomplete symbolic shape inference")  # the type ONNX Runtime raises

    monkeypatch.setattr(zoo_bench, "ort_quantized", quantizer)
    result = zoo_bench.bench_model("distilbert", ["int8q"], "cpu", rounds=1, repeat=1, tiny=True)
    assert "relay_amp int8q" in result.ms and not {zoo_bench.ORT_INT8, zoo_bench.ORT_FILE_INT8} & set(result.ms)
    assert result.peer_failures == {zoo_bench.ORT_INT8: "ONNX Runtime's quantizer failed: Incomplete symbolic shape "
                                                        "inference"}
    assert set(result.agreement) == {"relay_amp int8q"} and result.agreement["relay_amp int8q"] >= 0.98
    row = zoo_bench.markdown_table([result]).splitlines()[2]
    assert "| failed: ONNX Runtime's quantizer failed: Incomplete symbolic shape inference |" in row
    assert f" {result.agreement['relay_amp int8q']:.4g} / - / - " in row


def test_profile_model_profiles_the_zoo_export_on_the_benchs_inputs_and_calibration(monkeypatch):
    """A zoo model's profile sees what its bench builds: the ONNX export, the example input timed there and the 16
    calibration batches int8q is calibrated on (seeds 1-16, apart from the timed input's 0)."""
    seen = {}

    def profile(mod, dtypes, target, repeat, **options):
        seen.update(options, mod=mod, dtypes=dtypes)
        return []

    monkeypatch.setattr(zoo_bench, "profile", profile)
    assert zoo_bench.profile_model("distilbert", ["float32", "int8q"], "cpu", 1, tiny=True) == []
    zoo = zoo_bench.zoo
    assert [x.tolist() for x in seen["inputs"]] == [x.tolist() for x in zoo.example_inputs("distilbert", True)]
    assert len(seen["calibration"]) == zoo_bench.CALIBRATION_INPUTS
    for seed, batch in zip([1, zoo_bench.CALIBRATION_INPUTS], [seen["calibration"][0], seen["calibration"][-1]]):
        assert [x.tolist() for x in batch] == [x.tolist() for x in zoo.example_inputs("distilbert", True, seed)]
    assert [p.name for p in seen["mod"]["main"].params] == ["input_ids", "attention_mask"]


def test_profile_model_times_every_variant_of_a_tiny_zoo_model():
    from relay_amp.tools.profile import WHOLE_RUN

    rows = zoo_bench.profile_model("distilbert", ["float32", "int8q"], "cpu", 1, tiny=True)
    whole = next(row for row in rows if row.group == WHOLE_RUN)
    assert set(whole.ms) == {"float32", "int8q"} and all(ms > 0 for ms in whole.ms.values())
    assert any("relay_amp_dot_kernel" in row.group for row in rows)


def test_cli_profile_takes_one_zoo_model_at_its_zoo_size(monkeypatch, capsys):
    from relay_amp.tools.profile import ProfileRow

    calls = []

    def profile_model(name, dtypes, target, repeat, **options):
        calls.append((name, dtypes, repeat, options["by_shape"]))
        return [ProfileRow("conv2d_add", {"float32": 1, "int8q": 1}, {"float32": 2.0, "int8q": 1.0})]

    monkeypatch.setattr(zoo_bench, "profile_model", profile_model)
    assert main(["profile", "zoo:mixnet_s", "--dtypes", "fp32,int8q", "--repeat", "3", "--by-shape"]) == 0
    assert calls == [("mixnet_s", ["float32", "int8q"], 3, True)] and "conv2d_add" in capsys.readouterr().out
    assert main(["profile", "zoo:resnet9"]) == 1
    assert "unknown zoo model 'resnet9'" in capsys.readouterr().err
    assert main(["profile", "zoo:bert", "--batch", "4"]) == 1
    assert capsys.readouterr().err.strip() == ("relay-amp: error: profile zoo:NAME profiles the zoo model at its zoo "
                                               "size: --batch and --dim do not apply")
    assert len(calls) == 1
