"""MetaSchedule autotuning with the XGBoost cost model, and the tuning logs that builds reuse."""

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import tvm
import tvm_ffi
from tqdm import tqdm
from tvm.driver import build as tvm_build
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
from tvm.s_tir.meta_schedule.builder.local_builder import default_export
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from .._ir import import_tensor_intrinsics
from ..backend import pipeline_for
from ..errors import OptionError, TuningError
from ..serialization import atomic_write_text
from ..targets import check_host, get_target

LOG_FILES = ("database_workload.json", "database_tuning_record.json")
MANIFEST = "relay_amp.json"
FAILED_RUN_SECS = 1e9  # MetaSchedule stores a failed build or run as 1e10 seconds
COST_MODELS = ("xgb", "random")
BUILDER_TIMEOUT_S = 300
BUILDS_PER_WORKER = 64  # candidates a builder worker compiles before a fresh one replaces it
RUNNER_TIMEOUT_S = 60
RPC_WAIT_S = 60.0  # how long a tune waits for a server of its key to register with the tracker
RPC_POLL_S = 1.0
TRACKER_TIMEOUT_S = 10.0
NEW_CANDIDATE_ATTEMPTS = 3  # searches for unmeasured candidates before an operator counts as explored


def log_dir(root: str | os.PathLike, model: str, dtype: str, target: str) -> Path:
    """Where the tuning log of a built-in model in one dtype for one target preset lives."""
    return Path(root) / f"{model}-{dtype}-{target}"


def prepare(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """`mod` as its backend prepares it for tuning and building (dispatch, legalization, fusion)."""
    with target:
        return pipeline_for(target).prepare_passes(target)(mod)


def tuning_tasks(prepared: tvm.IRModule, target: tvm.target.Target) -> list:
    """MetaSchedule's tasks for a prepared module, less the functions with loops of data-dependent extent (the expert
    kernel's rows per expert): MetaSchedule rejects every candidate of those (DisallowDynamicLoop), and they run as
    built."""
    return [task for task in ms.relax_integration.extract_tasks(prepared, target)
            if not _dynamic_loops(task.dispatched[0]["main"])]


def _dynamic_loops(func: tvm.tirx.PrimFunc) -> bool:
    """Whether a loop of `func` has an extent that is not a constant."""
    found = []

    def note(loop: tvm.tirx.For) -> tvm.tirx.For:
        found.append(not isinstance(loop.extent, tvm.tirx.IntImm))
        return loop
    tvm_ffi.structural_map(func.body, [(tvm.tirx.For, note)])
    return any(found)


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params: dict | None) -> tvm.runtime.Module:
    """Compile one measure candidate in a builder worker, as MetaSchedule's default builder does but without first
    importing all of TVM's tensor intrinsics (~35 s per worker: candidates arrive tensorized already); the
    backend's `candidate_passes` first and its TIR pipeline, so that the candidate is the code a build would run."""
    scheduled = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    backend = pipeline_for(target)
    return tvm_build(backend.candidate_passes(target)(scheduled), target=target, pipeline=backend.TIR_PIPELINE)


def _build_and_export(candidate: tuple) -> str:
    """Build one (build function, module, target) candidate in a builder worker; its exported library's path."""
    build, mod, target = candidate
    return default_export(build(mod, target, None))


@derived_object
class _PooledBuilder(ms.builder.PyBuilder):
    """MetaSchedule's local builder with its worker processes kept for the whole tune: TVM's starts new ones for
    every batch of candidates, and each new worker imports TVM and relay_amp (seconds per batch on two cores).
    A worker is replaced after BUILDS_PER_WORKER candidates (TVM restarts them for memory they leak) or a timeout;
    `workers` defaults to one per CPU."""

    def __init__(self, build: Callable, timeout_s: float, workers: int | None = None):
        super().__init__()
        self.build_function, self.timeout_s = build, timeout_s
        self.pool = PopenPoolExecutor(workers, timeout=timeout_s, maximum_process_uses=BUILDS_PER_WORKER)

    def build(self, build_inputs: list) -> list:
        """Build every candidate in the pool's workers; a failure or timeout becomes that candidate's error."""
        results = self.pool.map_with_error_catching(
            _build_and_export, [(self.build_function, candidate.mod, candidate.target) for candidate in build_inputs])
        return [self._result(result) for result in results]

    def _result(self, result) -> ms.builder.BuilderResult:
        if result.status == StatusKind.COMPLETE:
            return ms.builder.BuilderResult(result.value, None)
        if result.status == StatusKind.TIMEOUT:
            return ms.builder.BuilderResult(None, f"relay_amp builder: timed out after {self.timeout_s} s")
        return ms.builder.BuilderResult(None, f"relay_amp builder: {result.value}")


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    """Advances a progress bar by the candidates measured."""

    def __init__(self, bar: tqdm):
        super().__init__()
        self.bar = bar

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        self.bar.update(len(measure_candidates))


@derived_object
class _SkipMeasured(ms.search_strategy.PySearchStrategy):
    """Evolutionary search that first measures the operator's untuned schedule (the records then never choose a
    slower one) and leaves out the candidates the database already holds, so a resumed run does not measure
    again what an earlier run on the same work_dir measured (MetaSchedule's own search would)."""

    def __init__(self, search: ms.search_strategy.SearchStrategy | None = None):
        super().__init__()
        self.search = search or ms.search_strategy.EvolutionarySearch()
        self.workload = None
        self.context = None
        self.measured = set()
        self.untuned_pending = True  # the untuned schedule still to be proposed (once per run)
        self.untuned_in_flight = False

    def _initialize_with_tune_context(self, context) -> None:
        self.workload, self.context = context.mod, context
        self.search._initialize_with_tune_context(context)

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        self.search.pre_tuning(max_trials, num_trials_per_iter, design_spaces, database, cost_model)
        self.measured = {tvm_ffi.structural_hash(record.as_measure_candidate().sch.mod)
                         for record in _records_of(database, self.workload)}

    def post_tuning(self) -> None:
        self.search.post_tuning()

    def generate_measure_candidates(self):
        untuned = self._untuned_candidate() if self.untuned_pending else None
        self.untuned_pending = False
        self.untuned_in_flight = untuned is not None  # measured in the first batch: records never pick slower
        return [untuned, *(self._fresh_candidates() or [])] if untuned else self._fresh_candidates()

    def _fresh_candidates(self) -> list | None:
        """The search's next candidates that the log does not hold; None when it has no more."""
        for _ in range(NEW_CANDIDATE_ATTEMPTS):
            candidates = self.search.generate_measure_candidates()
            if candidates is None:
                return None
            fresh = [c for c in candidates if tvm_ffi.structural_hash(c.sch.mod) not in self.measured]
            if fresh:
                return fresh
        return None  # the search keeps proposing measured candidates: this operator's space is explored

    def _untuned_candidate(self) -> ms.MeasureCandidate | None:
        """The schedule an untuned build gives this operator, postprocessed as MetaSchedule's own candidates are,
        unless the log holds it; None once measured or where the backend has none."""
        target = self.context.target
        sch = pipeline_for(target).untuned_schedule(self.workload["main"], target)
        if sch is None:
            return None
        sch.enter_postproc()
        if not all(postproc.apply(sch) for postproc in self.context.space_generator.postprocs):
            return None
        if tvm_ffi.structural_hash(sch.mod) in self.measured:
            return None
        return ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_entry_func(sch.mod, remove_preproc=True))

    def notify_runner_results(self, measure_candidates, results) -> None:
        self.measured.update(tvm_ffi.structural_hash(c.sch.mod) for c in measure_candidates)
        if self.untuned_in_flight:  # the first candidate is not the search's own: it is not told of it
            self.untuned_in_flight = False
            measure_candidates, results = measure_candidates[1:], results[1:]
        if measure_candidates:
            self.search.notify_runner_results(measure_candidates, results)

    def clone(self) -> "_SkipMeasured":
        return _SkipMeasured(self.search.clone())


def tune(mod: tvm.IRModule, target: "str | tvm.target.Target", work_dir: str | os.PathLike, trials: int, *,
         cost_model: str = "xgb", trials_per_task: int | None = None, trials_per_iter: int = 16,
         seed: int = 0, progress: bool = True, description: dict | None = None,
         builder_timeout_s: int = BUILDER_TIMEOUT_S, rpc_tracker: str | None = None, rpc_key: str | None = None,
         rpc_wait_s: float = RPC_WAIT_S) -> ms.Database:
    """Tune every operator of `mod` for `target` with MetaSchedule; the records go to work_dir.

    Records are written as they are measured, and a run on a work_dir that already holds records
    measures only the trials still missing (a resumed run). With `rpc_tracker` ("HOST:PORT") and
    `rpc_key`, candidates run on the tracker's servers for that key, as many at once as it has.
    """
    _check_options(trials, cost_model, trials_per_task, rpc_tracker, rpc_key)
    if rpc_tracker is None:
        check_host(target)
    tgt = get_target(target)
    prepared = prepare(mod, tgt)
    extracted = tuning_tasks(prepared, tgt)
    if not extracted:
        raise TuningError("the module has no operator to tune")
    servers = _wait_for_servers(rpc_tracker, rpc_key, rpc_wait_s) if rpc_tracker else 0  # before the work dir
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    database = _open_log(work_dir, allow_missing=True)
    measured = [len(_records_of(database, task.dispatched[0])) for task in extracted]
    remaining = trials - sum(measured)
    pending = [task for task, done in zip(extracted, measured)
               if trials_per_task is None or done < trials_per_task]
    if remaining > 0 and pending:
        runner = (_rpc_runner(rpc_tracker, rpc_key, servers, rpc_wait_s) if servers
                  else ms.runner.LocalRunner(timeout_sec=RUNNER_TIMEOUT_S))
        with tqdm(total=remaining, desc="tuning", unit="trial", disable=not progress) as bar:
            counter = _Progress(bar)
            _run_tuner(pending, database, work_dir, tgt, remaining, trials_per_task, trials_per_iter, cost_model,
                       seed, counter, builder_timeout_s, runner)
    if not _successful_records(database):
        raise TuningError(f"all {trials} tuning trials failed to build or run; see {work_dir / 'logs'}")
    _write_manifest(work_dir, tgt, trials, cost_model, description or {})
    return database


def _check_options(trials, cost_model, trials_per_task, rpc_tracker, rpc_key) -> None:
    if not isinstance(trials, int) or trials < 1:
        raise OptionError(f"trials must be a positive integer, got {trials!r}")
    if trials_per_task is not None and (not isinstance(trials_per_task, int) or trials_per_task < 1):
        raise OptionError(f"trials_per_task must be a positive integer, got {trials_per_task!r}")
    if cost_model not in COST_MODELS:
        raise OptionError(f"cost_model must be one of {list(COST_MODELS)}, got {cost_model!r}")
    if (rpc_tracker is None) != (rpc_key is None):
        raise OptionError("rpc_tracker and rpc_key go together: give both or neither")
    if rpc_tracker is not None:
        parse_tracker(rpc_tracker)


def _records_of(database: ms.Database, workload: tvm.IRModule) -> list:
    """The records of one operator (failed ones included: they were measured)."""
    if database is None or not database.has_workload(workload):
        return []
    return [record for record in database.get_all_tuning_records()
            if tvm_ffi.structural_equal(record.workload.mod, workload)]


def _run_tuner(extracted, database, work_dir: Path, target, trials, trials_per_task, trials_per_iter, cost_model,
               seed, counter, builder_timeout_s, runner):
    quiet = logging.getLogger("tvm.s_tir.meta_schedule")
    level, foreign = quiet.level, [h for h in quiet.handlers if not h.get_name()]
    quiet.setLevel(logging.WARNING)  # the console handler takes this level; the log files keep DEBUG
    for handler in foreign:  # MetaSchedule's logger setup crashes on unnamed handlers (pytest's, a user's)
        quiet.removeHandler(handler)
    builder = _PooledBuilder(build_candidate, builder_timeout_s)
    try:
        import_tensor_intrinsics()  # MetaSchedule's tune contexts import them, about a minute slower
        tasks, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            extracted, str(work_dir), strategy=_SkipMeasured(), seed=seed)
        return ms.tune_tasks(
            tasks=tasks, task_weights=weights, work_dir=str(work_dir), max_trials_global=trials,
            max_trials_per_task=trials_per_task, num_trials_per_iter=trials_per_iter, cost_model=cost_model,
            builder=builder, runner=runner,
            database=database,
            # round-robin commits each task's measurements as soon as they are done; the gradient scheduler holds
            # every result of its first round until all tasks were sent once (a kill then lost them all)
            task_scheduler="round-robin",
            measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [counter],
        )
    finally:
        builder.pool.shutdown()
        quiet.setLevel(level)
        for handler in foreign:
            quiet.addHandler(handler)


def parse_tracker(address: str) -> tuple[str, int]:
    """The host and port of an RPC tracker address "HOST:PORT"."""
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise OptionError(f"rpc_tracker must be HOST:PORT, got {address!r}")
    return host, int(port)


def rpc_servers(rpc_tracker: str, rpc_key: str, timeout_s: float = TRACKER_TIMEOUT_S) -> int:
    """How many RPC servers the tracker at "HOST:PORT" has registered for `rpc_key` (TuningError if it does not answer)."""
    config = _rpc_config(rpc_tracker, rpc_key, max(1, int(timeout_s)))
    try:  # TVM's own connect retries for 60 s: a plain socket says at once whether the tracker listens
        socket.create_connection((config.tracker_host, config.tracker_port), timeout=timeout_s).close()
        return config.count_num_servers(allow_missing=True)
    except Exception as err:  # TVM raises ValueError on a timeout and socket errors on a refused connection
        raise TuningError(f"the RPC tracker {rpc_tracker} does not answer (key {rpc_key!r}): {err}") from err


def _rpc_config(rpc_tracker: str, rpc_key: str, session_timeout_s: int) -> ms.runner.RPCConfig:
    host, port = parse_tracker(rpc_tracker)
    return ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=rpc_key,
                               session_timeout_sec=session_timeout_s)


def _wait_for_servers(rpc_tracker: str, rpc_key: str, wait_s: float) -> int:
    """The number of servers for the key, once there is one; TuningError after `wait_s` without any."""
    deadline = time.monotonic() + wait_s
    while (servers := rpc_servers(rpc_tracker, rpc_key)) == 0:
        if time.monotonic() > deadline:
            raise TuningError(f"the RPC tracker {rpc_tracker} has no server for key {rpc_key!r} "
                              f"(waited {wait_s:g} s)")
        time.sleep(RPC_POLL_S)
    return servers


def _rpc_runner(rpc_tracker: str, rpc_key: str, servers: int, wait_s: float) -> ms.runner.Runner:
    """MetaSchedule's RPC runner with one worker per server of the key, each run bounded in time."""
    runner = ms.runner.RPCRunner(_rpc_config(rpc_tracker, rpc_key, RUNNER_TIMEOUT_S), max_workers=servers)
    # RPCRunner's pool waits forever for a server that went away; this one kills a run after a bounded time
    runner.pool = PopenPoolExecutor(max_workers=servers, timeout=RUNNER_TIMEOUT_S + wait_s)
    return runner


def _successful_records(database: ms.Database) -> list:
    return [r for r in database.get_all_tuning_records()
            if r.run_secs and min(float(s) for s in r.run_secs) < FAILED_RUN_SECS]


def _write_manifest(work_dir: Path, target, trials: int, cost_model: str, description: dict) -> None:
    manifest = {"target": str(target), "trials": trials, "cost_model": cost_model, **description}
    atomic_write_text(work_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def load_database(work_dir: str | os.PathLike) -> ms.Database:
    """Open the tuning log in work_dir, checking that it is complete and well-formed JSON first."""
    return _open_log(Path(work_dir), allow_missing=False)


def _open_log(work_dir: Path, allow_missing: bool) -> ms.Database:
    """The JSON database in work_dir after checking its files; `allow_missing` lets a new log start empty."""
    for name in LOG_FILES:
        path = work_dir / name
        if path.is_file():
            _check_json_lines(path)
        elif not allow_missing:
            raise TuningError(f"tuning log {work_dir} is incomplete: {name} is missing")
    try:
        return ms.database.JSONDatabase(work_dir=str(work_dir), allow_missing=allow_missing)
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
    tasks = tuning_tasks(prepared, target)
    return sum(database.has_workload(task.dispatched[0]) for task in tasks)
