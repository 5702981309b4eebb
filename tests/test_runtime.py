"""The Relax VM helpers and the size of TVM's CPU thread pool."""

import os
import subprocess
import sys

import numpy as np
import pytest
from tvm import relax

import relay_amp
from relay_amp import runtime, targets


def test_host_cores_counts_hyperthreads_of_a_core_once(monkeypatch):
    monkeypatch.setattr(targets, "host_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(targets, "_core_of", lambda cpu: ("0", str(cpu // 2)))  # two threads per core
    assert targets.host_cores() == 2


def test_host_cores_is_at_most_the_cpus_this_process_may_use():
    assert 1 <= targets.host_cores() <= len(targets.host_cpus())


def test_importing_relay_amp_gives_tvm_one_thread_per_core():
    """TVM alone would run half the logical CPUs: one thread on a 2-vCPU VM without hyperthreads."""
    env = {name: value for name, value in os.environ.items() if name not in runtime.THREAD_ENV}
    script = "import relay_amp; print(relay_amp.runtime.pool_threads(), relay_amp.targets.host_cores())"
    threads, cores = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                    check=True).stdout.split()
    assert threads == cores


def test_configure_threads_resizes_a_running_pool():
    before = runtime.pool_threads()
    try:
        relay_amp.run(_doubling_module(), [np.ones(4, "float32")])  # the pool is running
        assert relay_amp.configure_threads(1) == 1
        np.testing.assert_array_equal(relay_amp.run(_doubling_module(), [np.ones(4, "float32")])[0], 2)
    finally:
        relay_amp.configure_threads(before)
    assert runtime.pool_threads() == before


def test_configure_threads_leaves_a_size_the_user_chose(monkeypatch):
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(runtime, "host_cores", lambda: 3)  # what it would pick if it ignored the user
    before = runtime.pool_threads()
    assert relay_amp.configure_threads() == before
    assert "TVM_NUM_THREADS" not in os.environ


def test_configure_threads_refuses_zero_threads():
    with pytest.raises(relay_amp.OptionError, match="at least 1"):
        relay_amp.configure_threads(0)


def _doubling_module():
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with builder.function("main", [x]):
        builder.emit_func_output(builder.emit(relax.op.add(x, x)))
    return builder.get()
