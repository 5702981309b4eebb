"""Tuning through TVM's RPC tracker: two local servers measure, the records build, and a farm without servers
(or without a tracker) is a TuningError within a bounded wait, not a hang."""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import relay_amp
from relay_amp import targets
from relay_amp.compile.build import build
from relay_amp.compile.tuning import parse_tracker, rpc_servers, tune
from relay_amp.runtime import run_executable
from relay_amp.tools.cli import main

from test_build import matmul_module

KEY = "relay-amp-test"
START_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _spawn(*args: str) -> subprocess.Popen:
    """A TVM RPC process in its own process group (a server forks its serving loop into a child)."""
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _wait_for(address: str, servers: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if rpc_servers(address, KEY, timeout_s=2) >= servers:
                return
        except relay_amp.TuningError:
            pass  # the tracker is still importing TVM
        time.sleep(0.5)
    pytest.fail(f"the RPC tracker at {address} did not list {servers} servers within {START_TIMEOUT_S} s")


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
    processes.clear()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass  # already stopped


@pytest.fixture
def tracker():
    """A tracker on 127.0.0.1 with no server; its address, and the list to add processes to (all torn down)."""
    port = _free_port()
    processes = [_spawn("tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                        "--port-end", str(port + 1))]
    address = f"127.0.0.1:{port}"
    try:
        _wait_for(address, 0)
        yield address, processes
    finally:
        _stop(processes)


def _add_servers(address: str, processes: list[subprocess.Popen], count: int) -> None:
    for _ in range(count):
        port = _free_port()
        processes.append(_spawn("tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(port),
                                "--port-end", str(port + 1), "--tracker", address, "--key", KEY))
    _wait_for(address, count)


def test_tune_through_two_rpc_servers_then_build_from_the_records(tracker, tmp_path):
    address, processes = tracker
    _add_servers(address, processes, 2)
    assert rpc_servers(address, KEY) == 2 and rpc_servers(address, "another-key") == 0
    target = targets.host_preset()
    mod = relay_amp.to_mixed_precision(matmul_module(32), "bfloat16")
    database = tune(mod, target, tmp_path, trials=2, trials_per_iter=2, progress=False,
                    rpc_tracker=address, rpc_key=KEY)
    assert any(min(float(s) for s in record.run_secs) < 1.0 for record in database.get_all_tuning_records())
    inputs = [np.random.default_rng(0).standard_normal((32, 32)).astype("float32") for _ in range(2)]
    got = run_executable(build(mod, target, tmp_path), inputs)[0]
    np.testing.assert_allclose(got, inputs[0] @ inputs[1], rtol=0.05, atol=0.3)  # bf16 operands, depth 32

    servers = processes[1:]
    del processes[1:]
    _stop(servers)  # the servers go away: the next tune waits a bounded time, then says so
    started = time.monotonic()
    with pytest.raises(relay_amp.TuningError, match=f"no server for key '{KEY}'"):
        tune(mod, target, tmp_path / "again", trials=2, rpc_tracker=address, rpc_key=KEY, rpc_wait_s=3)
    assert time.monotonic() - started < 30


def test_a_tracker_that_does_not_answer_is_a_tuning_error_naming_it():
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    with pytest.raises(relay_amp.TuningError, match=f"RPC tracker {address} does not answer"):
        rpc_servers(address, KEY, timeout_s=2)


def test_the_cli_says_so_in_one_line(capsys, tmp_path):
    address = f"127.0.0.1:{_free_port()}"
    assert main(["tune", "matmul", "--trials", "2", "--work-dir", str(tmp_path), "--rpc-tracker", address,
                 "--rpc-key", KEY]) == 1
    err = capsys.readouterr().err.strip()
    assert "does not answer" in err and "\n" not in err


@pytest.mark.parametrize("options, fragment", [
    ({"rpc_tracker": "127.0.0.1:9190"}, "give both or neither"),
    ({"rpc_key": KEY}, "give both or neither"),
    ({"rpc_tracker": "no-port", "rpc_key": KEY}, "HOST:PORT"),
    ({"rpc_tracker": "host:99999", "rpc_key": KEY}, "HOST:PORT"),
])
def test_bad_rpc_options(options, fragment, tmp_path):
    with pytest.raises(relay_amp.OptionError, match=fragment):
        tune(matmul_module(32), "cpu", tmp_path, trials=2, **options)


def test_parse_tracker_splits_host_and_port():
    assert parse_tracker("farm.example:9190") == ("farm.example", 9190)
    assert parse_tracker("[::1]:9190") == ("[::1]", 9190)
