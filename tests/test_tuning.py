"""MetaSchedule tuning: a real (tiny) run, its records reused by build, and bad logs rejected."""

import json
import logging
import shutil

import numpy as np
import pytest

import relay_amp
from relay_amp import models
from relay_amp.build import build
from relay_amp.runtime import run_executable
from relay_amp.tuning import MANIFEST, load_database, tune
from test_build import matmul_module


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A 32x32 matmul tuned with 4 trials (about a minute: MetaSchedule's workers start slowly)."""
    work_dir = tmp_path_factory.mktemp("tune") / "matmul"
    mod = matmul_module(32)
    database = tune(mod, "cpu", work_dir, trials=4, trials_per_iter=4, progress=False,
                    description={"model": "matmul32"})
    return mod, work_dir, database


def test_tune_writes_successful_records_and_a_manifest(tuned):
    _, work_dir, database = tuned
    runs = [min(float(s) for s in r.run_secs) for r in database.get_all_tuning_records()]
    assert runs and min(runs) < 1.0
    manifest = json.loads((work_dir / MANIFEST).read_text())
    assert manifest["model"] == "matmul32" and manifest["trials"] == 4 and manifest["cost_model"] == "xgb"


def test_build_with_tuning_log_matches_reference(tuned):
    mod, work_dir, _ = tuned
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((32, 32)).astype("float32") for _ in range(2)]
    got = run_executable(build(mod, "cpu", work_dir), inputs)[0]
    np.testing.assert_allclose(got, inputs[0] @ inputs[1], rtol=1e-4, atol=1e-4)


def test_log_for_another_model_is_a_clear_error(tuned):
    _, work_dir, _ = tuned
    with pytest.raises(relay_amp.TuningError, match="no record for any operator"):
        build(models.small_cnn(), "cpu", work_dir)


def test_corrupt_or_incomplete_log_is_a_clear_error(tuned, tmp_path):
    _, work_dir, _ = tuned
    corrupt = tmp_path / "corrupt"
    shutil.copytree(work_dir, corrupt)
    with open(corrupt / "database_tuning_record.json", "a") as records:
        records.write('[0, {"trace": \n')
    with pytest.raises(relay_amp.TuningError, match="corrupt at line"):
        load_database(corrupt)
    (corrupt / "database_workload.json").unlink()
    with pytest.raises(relay_amp.TuningError, match="database_workload.json is missing"):
        load_database(corrupt)


def test_tune_survives_unnamed_handlers_on_meta_schedules_logger(tuned, tmp_path):
    # pytest's log capture (or a user) leaves unnamed handlers there; MetaSchedule's own setup crashes on them
    meta_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    unnamed = logging.NullHandler()
    meta_logger.addHandler(unnamed)
    try:
        tune(matmul_module(16), "cpu", tmp_path / "again", trials=1, trials_per_iter=1, progress=False)
        assert unnamed in meta_logger.handlers
    finally:
        meta_logger.removeHandler(unnamed)


def test_all_trials_failing_is_an_error_not_a_silent_success(tmp_path):
    # a 1 s builder timeout fails every build, as MetaSchedule's default 30 s does on a slow start
    with pytest.raises(relay_amp.TuningError, match="all 2 tuning trials failed"):
        tune(matmul_module(32), "cpu", tmp_path / "failing", trials=2, trials_per_iter=2, progress=False,
             builder_timeout_s=1)


@pytest.mark.parametrize("options, fragment", [({"trials": 0}, "trials"), ({"trials": 2, "cost_model": "mlp"}, "cost_model")])
def test_bad_tuning_options(options, fragment, tmp_path):
    with pytest.raises(relay_amp.OptionError, match=fragment):
        tune(matmul_module(32), "cpu", tmp_path, **options)
