"""MetaSchedule autotuning with the XGBoost cost model, and the tuning logs that builds reuse."""

import json
import logging
import os
from pathlib import Path

import tvm
from tqdm import tqdm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..backend import pipeline_for
from ..errors import OptionError, TuningError
from ..serialization import atomic_write_text
from ..targets import check_host, get_target

LOG_FILES = ("database_workload.json", "database_tuning_record.json")
MANIFEST = "relay_amp.json"
FAILED_RUN_SECS = 1e9  # MetaSchedule stores a failed build or run as 1e10 seconds
COST_MODELS = ("xgb", "random")
# MetaSchedule's builder workers re-import TVM's tensor intrinsics (~26 s): its default 30 s timeout fails every build
BUILDER_TIMEOUT_S = 300
RUNNER_TIMEOUT_S = 60


def log_dir(root: str | os.PathLike, model: str, dtype: str, target: str) -> Path:
    """Where the tuning log of a built-in model in one dtype for one target preset lives."""
    return Path(root) / f"{model}-{dtype}-{target}"


def prepare(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """`mod` as its backend prepares it for tuning and building (dispatch, legalization, fusion)."""
    with target:
        return pipeline_for(target).prepare_passes(target)(mod)


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    """Advances a progress bar by the candidates measured and counts the successful ones."""

    def __init__(self, bar: tqdm):
        super().__init__()
        self.bar = bar
        self.succeeded = 0

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        for result in runner_results:
            if result.error_msg is None and result.run_secs:
                self.succeeded += 1
        self.bar.update(len(measure_candidates))


def tune(mod: tvm.IRModule, target: "str | tvm.target.Target", work_dir: str | os.PathLike, trials: int, *,
         cost_model: str = "xgb", trials_per_task: int | None = None, trials_per_iter: int = 16,
         seed: int = 0, progress: bool = True, description: dict | None = None,
         builder_timeout_s: int = BUILDER_TIMEOUT_S) -> ms.Database:
    """Tune every operator of `mod` for `target` with MetaSchedule; the records go to work_dir."""
    if not isinstance(trials, int) or trials < 1:
        raise OptionError(f"trials must be a positive integer, got {trials!r}")
    if cost_model not in COST_MODELS:
        raise OptionError(f"cost_model must be one of {list(COST_MODELS)}, got {cost_model!r}")
    check_host(target)
    tgt = get_target(target)
    prepared = prepare(mod, tgt)
    if not ms.relax_integration.extract_tasks(prepared, tgt):
        raise TuningError("the module has no operator to tune")
    with tqdm(total=trials, desc="tuning", unit="trial", disable=not progress) as bar:
        counter = _Progress(bar)
        database = _run_tuner(prepared, tgt, Path(work_dir), trials, trials_per_task, trials_per_iter,
                              cost_model, seed, counter, builder_timeout_s)
    if counter.succeeded == 0 or not _successful_records(database):
        raise TuningError(f"all {trials} tuning trials failed to build or run; see {Path(work_dir) / 'logs'}")
    _write_manifest(Path(work_dir), tgt, trials, cost_model, description or {})
    return database


def _run_tuner(prepared, target, work_dir: Path, trials, trials_per_task, trials_per_iter, cost_model, seed, counter,
               builder_timeout_s):
    quiet = logging.getLogger("tvm.s_tir.meta_schedule")
    level, foreign = quiet.level, [h for h in quiet.handlers if not h.get_name()]
    quiet.setLevel(logging.WARNING)  # the console handler takes this level; the log files keep DEBUG
    for handler in foreign:  # MetaSchedule's logger setup crashes on unnamed handlers (pytest's, a user's)
        quiet.removeHandler(handler)
    try:
        return ms.relax_integration.tune_relax(
            prepared, {}, target, str(work_dir), trials, trials_per_task,
            num_trials_per_iter=trials_per_iter, cost_model=cost_model, seed=seed,
            builder=ms.builder.LocalBuilder(timeout_sec=builder_timeout_s),
            runner=ms.runner.LocalRunner(timeout_sec=RUNNER_TIMEOUT_S),
            measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [counter],
        )
    finally:
        quiet.setLevel(level)
        for handler in foreign:
            quiet.addHandler(handler)


def _successful_records(database: ms.Database) -> list:
    return [r for r in database.get_all_tuning_records()
            if r.run_secs and min(float(s) for s in r.run_secs) < FAILED_RUN_SECS]


def _write_manifest(work_dir: Path, target, trials: int, cost_model: str, description: dict) -> None:
    manifest = {"target": str(target), "trials": trials, "cost_model": cost_model, **description}
    atomic_write_text(work_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def load_database(work_dir: str | os.PathLike) -> ms.Database:
    """Open the tuning log in work_dir, checking that it is complete and well-formed JSON first."""
    work_dir = Path(work_dir)
    for name in LOG_FILES:
        path = work_dir / name
        if not path.is_file():
            raise TuningError(f"tuning log {work_dir} is incomplete: {name} is missing")
        _check_json_lines(path)
    try:
        return ms.database.JSONDatabase(work_dir=str(work_dir), allow_missing=False)
    except Exception as err:  # TVM raises its own error types for records it cannot decode
        raise TuningError(f"tuning log {work_dir} cannot be read: {err}") from err


def _check_json_lines(path: Path) -> None:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            raise TuningError(f"tuning log {path} is corrupt at line {number}: {err.msg}") from err


def matching_records(database: ms.Database, mod: tvm.IRModule, target: tvm.target.Target) -> int:
    """How many of `mod`'s operators for `target` have a record in the database."""
    return prepared_records(database, prepare(mod, target), target)


def prepared_records(database: ms.Database, prepared: tvm.IRModule, target: tvm.target.Target) -> int:
    """How many operators of an already prepared module (see `prepare`) have a record in the database."""
    tasks = ms.relax_integration.extract_tasks(prepared, target)
    return sum(database.has_workload(task.dispatched[0]) for task in tasks)
