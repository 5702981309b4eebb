"""MetaSchedule tuning: a real (tiny) run, its records reused by build, and bad logs rejected."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax, te, topi
from tvm.s_tir import meta_schedule as ms

import relay_amp
from relay_amp import models, targets
from relay_amp.backend.cpu import kernels, schedules
from relay_amp.backend.cuda import pipeline as cuda_pipeline
from relay_amp.compile import tuning
from relay_amp.compile.build import build
from relay_amp.compile.tuning import MANIFEST, load_database, tune
from relay_amp.runtime import run_executable

from builders import expert_layer, single_output_module, tensor
from test_build import matmul_module


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A 32x32 matmul (4 operators) tuned with 8 trials: each operator's untuned schedule and one candidate of the
    search (about two minutes: MetaSchedule's workers start slowly)."""
    work_dir = tmp_path_factory.mktemp("tune") / "matmul"
    mod = matmul_module(32)
    database = tune(mod, "cpu", work_dir, trials=8, trials_per_iter=2, progress=False,
                    description={"model": "matmul32"})
    return mod, work_dir, database


def test_tune_writes_successful_records_and_a_manifest(tuned):
    _, work_dir, database = tuned
    runs = [min(float(s) for s in r.run_secs) for r in database.get_all_tuning_records()]
    assert runs and min(runs) < 1.0
    manifest = json.loads((work_dir / MANIFEST).read_text())
    assert manifest["model"] == "matmul32" and manifest["trials"] == 8 and manifest["cost_model"] == "xgb"


def test_every_operator_has_its_untuned_schedule_measured_so_records_never_lose_to_it(tuned):
    _, work_dir, _ = tuned
    records = [json.loads(line) for line in (work_dir / "database_tuning_record.json").read_text().splitlines()]
    workloads = len((work_dir / "database_workload.json").read_text().splitlines())
    # relay_amp's default schedules are fixed: their traces sample nothing, MetaSchedule's candidates' traces do
    untuned = {workload for workload, (trace, *_) in records if "Sample" not in json.dumps(trace)}
    assert untuned == set(range(workloads))


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


def test_all_trials_failing_is_an_error_not_a_silent_success(tmp_path, monkeypatch):
    # every build fails in the builder's worker (a lambda travels to it by value)
    monkeypatch.setattr(tuning, "build_candidate", lambda mod, target, params: 1 / 0)
    with pytest.raises(relay_amp.TuningError, match="all 2 tuning trials failed"):
        tune(matmul_module(32), "cpu", tmp_path / "failing", trials=2, trials_per_iter=2, progress=False)


@pytest.mark.parametrize("options, fragment", [({"trials": 0}, "trials"), ({"trials": 2, "cost_model": "mlp"}, "cost_model")])
def test_bad_tuning_options(options, fragment, tmp_path):
    with pytest.raises(relay_amp.OptionError, match=fragment):
        tune(matmul_module(32), "cpu", tmp_path, **options)


def _bf16_conv_module():
    weight = relax.const(np.random.default_rng(0).standard_normal((1, 1, 32, 32)).astype(ml_dtypes.bfloat16))
    return single_output_module(
        lambda x: relax.op.nn.conv2d(x, weight, data_layout="NHWC", kernel_layout="HWIO", out_dtype="float32"),
        tensor("x", (1, 8, 8, 32), "bfloat16"))


def test_tuned_bf16_kernel_is_tensorized_and_matches(tmp_path):
    # the conv becomes one relay_amp kernel, the only task; MetaSchedule samples its register tile
    if not targets.host_supports("avx512_bf16"):
        pytest.skip("host CPU lacks avx512_bf16: tuning measures the kernel by running it")
    mod = _bf16_conv_module()
    database = tune(mod, "cpu-avx512-bf16", tmp_path, trials=2, trials_per_iter=2, progress=False)
    traces = [record.trace for record in database.get_all_tuning_records()]
    assert traces and all(kernels.BF16_DOT.name in str(trace) for trace in traces)
    inputs = [np.random.default_rng(1).standard_normal((1, 8, 8, 32)).astype(ml_dtypes.bfloat16)]
    got = run_executable(build(mod, "cpu-avx512-bf16", tmp_path), inputs)[0].astype("float64")
    expected = relay_amp.run(mod, inputs)[0].astype("float64")
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()  # same bf16 products, summed in another order


def _schedules(work_dir) -> list[tuple]:
    """(workload, trace) of every record in a work dir's log, as written."""
    lines = (work_dir / "database_tuning_record.json").read_text().splitlines()
    return [(record[0], json.dumps(record[1][0])) for record in map(json.loads, filter(None, lines))]


def test_a_complete_work_dir_is_not_measured_again(tuned, tmp_path):
    mod, work_dir, _ = tuned
    resumed = tmp_path / "resumed"
    shutil.copytree(work_dir, resumed)
    before = _schedules(resumed)
    started = time.monotonic()
    tune(mod, "cpu", resumed, trials=len(before), trials_per_iter=4, progress=False)
    assert _schedules(resumed) == before and time.monotonic() - started < 20  # no builder, no runner


KILLED_TUNE = """
import sys
sys.path[:0] = {paths!r}
from test_build import matmul_module
from relay_amp.compile.tuning import tune
tune(matmul_module(16), "cpu", {work_dir!r}, trials=8, trials_per_iter=1, cost_model="random", progress=False)
"""


def test_a_killed_tune_resumes_keeping_its_records_and_measuring_nothing_twice(tmp_path):
    work_dir = tmp_path / "killed"
    paths = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    script = KILLED_TUNE.format(paths=paths, work_dir=str(work_dir))
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (work_dir / "database_tuning_record.json").is_file() or not _schedules(work_dir):
            assert process.poll() is None and time.monotonic() < deadline, "the tune ended before a record"
            time.sleep(0.5)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # mid-run: records are on disk as soon as they are measured
        process.wait()
    kept = _schedules(work_dir)
    tune(matmul_module(16), "cpu", work_dir, trials=8, trials_per_iter=1, cost_model="random", progress=False)
    after = _schedules(work_dir)
    assert after[:len(kept)] == kept and len(after) > len(kept)
    assert len(set(after)) == len(after)  # nothing measured twice


def test_the_builder_keeps_its_worker_from_batch_to_batch_and_reports_a_failed_build(tmp_path):
    """MetaSchedule's LocalBuilder starts new workers for every batch of candidates, and each imports TVM and
    relay_amp; relay_amp's builder keeps them for the whole tune."""
    a = te.placeholder((64,), "float32", name="a")
    module = tvm.IRModule({"main": te.create_prim_func([a, te.compute((64,), lambda i: a[i] * 2, name="b")])})
    candidate = ms.builder.BuilderInput(module, targets.get_target("cpu"))
    pids = tmp_path / "pids"

    def build_noting_the_worker(mod, target, params):  # a local function travels to the worker by value
        with open(pids, "a") as log:
            log.write(f"{os.getpid()}\n")
        return tuning.build_candidate(mod, target, params)

    builder = tuning._PooledBuilder(build_noting_the_worker, timeout_s=60, workers=1)
    failing = tuning._PooledBuilder(lambda *_: 1 / 0, timeout_s=60, workers=1)
    try:
        results = [builder.build([candidate])[0] for _ in range(3)]
        (failed,) = failing.build([candidate])
    finally:
        builder.pool.shutdown()
        failing.pool.shutdown()
    assert all(result.error_msg is None and os.path.isfile(result.artifact_path) for result in results)
    assert len(pids.read_text().split()) == 3 and len(set(pids.read_text().split())) == 1
    assert failed.artifact_path is None and "division by zero" in failed.error_msg


def test_a_measured_candidate_rounds_to_bf16_as_a_built_function_does():
    a = te.placeholder((64,), "float32", name="a")
    b = te.compute((64,), lambda i: (a[i] * 2).astype("bfloat16"), name="b")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, b]))
    sch.vectorize(sch.split(sch.get_loops(sch.get_sblock("b"))[0], [None, 16])[1])
    candidate = tuning.build_candidate(sch.mod, targets.get_target("cpu-avx512-bf16"), None)
    assert "vcvtneps2bf16" in candidate.inspect_source("asm")  # relay_amp.backend.cpu.bf16_round, as in a build


def test_a_measured_candidate_keeps_its_row_buffers_on_the_stack_as_a_built_function_does():
    """A softmax over rows of 256 keeps a 1 KB row of exps in each parallel row: relay_amp.backend.cpu.stack."""
    x = te.placeholder((64, 256), "float32", name="x")
    softmax = te.create_prim_func([x, topi.nn.softmax(x, axis=1)])
    sch = schedules.RowReductionRule().apply(softmax, targets.get_target("cpu"), False)
    candidate = tuning.build_candidate(sch.mod, targets.get_target("cpu"), None)
    assert "load ptr, ptr @__TVMBackendAllocWorkspace" not in candidate.inspect_source("ll")


def test_a_cuda_candidate_is_built_as_scheduled():
    a = te.placeholder((64,), "float32", name="a")
    module = tvm.IRModule({"main": te.create_prim_func([a, te.compute((64,), lambda i: a[i] * 2, name="b")])})
    passes = cuda_pipeline.candidate_passes(targets.get_target("cuda-tensorcore"))
    tvm.ir.assert_structural_equal(passes(module), module)


def test_functions_with_loops_of_data_dependent_extent_are_not_tuning_tasks():
    """The expert kernel (a mixture of experts' routed rows, each expert's count read at run time) runs as built:
    MetaSchedule rejects every candidate of a loop of dynamic extent (DisallowDynamicLoop), and a model whose only
    operator it was failed every trial. The matmul before it is a task; the kernel is not, and the default
    schedule leaves such a kernel as written."""
    target = targets.get_target(targets.host_preset())
    prepared = tuning.prepare(expert_layer(), target)
    kernel = next(func for gv, func in prepared.functions_items() if gv.name_hint == "expert_matmul")
    names = [task.task_name for task in tuning.tuning_tasks(prepared, target)]
    assert "expert_matmul" not in names and any("dot_kernel" in name for name in names)
    assert schedules.default_schedule(kernel, target) is None
