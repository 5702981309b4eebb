"""The committed tuning logs under tune_logs/ load, describe themselves, and match their model."""

import json
from pathlib import Path

import pytest

from relay_amp import models
from relay_amp.compile.tuning import MANIFEST, load_database, log_dir, matching_records
from relay_amp.targets import get_target
from relay_amp.tools.bench import variant

ROOT = Path(__file__).resolve().parents[2] / "tune_logs"
LOGS = sorted(path for path in ROOT.iterdir() if (path / MANIFEST).is_file())


COMMITTED = [("bert", "float32", "cpu-avx512-bf16"), ("bert", "bfloat16", "cpu-avx512-bf16"),
             ("resnet18", "bfloat16", "cpu-avx512-bf16"), ("resnet18", "bfloat16", "cpu-amx"),
             ("matmul", "float32", "cpu-avx512-bf16"), ("matmul", "bfloat16", "cpu-avx512-bf16"),
             ("matmul", "bfloat16", "cpu-amx"),
             ("matmul", "int8", "cpu-avx512-bf16")]


def test_the_committed_logs_are_the_ones_listed():
    assert {path.name for path in LOGS} == {log_dir(ROOT, *entry).name for entry in COMMITTED}


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name)
def test_committed_log_matches_its_model(path):
    manifest = json.loads((path / MANIFEST).read_text())
    mod = variant(models.get_model(manifest["model"], batch=manifest["batch"]), manifest["dtype"])
    target = get_target(path.name.split("-", 2)[2])
    database = load_database(path)
    assert matching_records(database, mod, target) > 0
    assert path.name == log_dir(ROOT, manifest["model"], manifest["dtype"], path.name.split("-", 2)[2]).name
