"""Test configuration: make sibling test modules importable (shared model builders and checks), build the CPU
presets for no core in particular (the same kernels on every host; tests of per-core choices name a core), quantize
to 8-bit activation codes on every host (tests of 7-bit codes name them), split the cores between pytest-xdist's
workers, and keep PyTorch off AMX where its AMX kernels die (before any test runs a torch op)."""

import importlib.util
import os
import sys
from pathlib import Path

import psutil
import pytest

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each worker before it imports this file
if WORKERS > 1:  # each worker's TVM, OpenMP (PyTorch) and their spinning threads on its share of the cores only
    for name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(name, str(max(1, len(os.sched_getaffinity(0)) // WORKERS)))

from relay_amp.targets import CPU_MODEL_ENV  # noqa: E402 (after the thread counts: importing relay_amp sizes TVM's pool)

sys.path.insert(0, str(Path(__file__).parent))
os.environ[CPU_MODEL_ENV] = ""  # set before any test module makes a target


# the files that take longest, longest first: xdist hands each worker a whole file at a time in collection order
# (--no-loadscope-reorder), so these start first and the short files fill in beside them (measured on a 2-core Zen 3,
# session 77: in xdist's default order, by each file's count of tests, the workers took 1322 s for 988 s of work
# each, 330 s of it the zoo file's; 1038 s in this order)
LONGEST_FILES = ("tools/test_zoo.py", "passes/test_quantize.py", "compile/test_tuning.py",
                 "backend/cpu/test_schedules.py", "test_onnx_quantized.py", "tools/test_accuracy.py",
                 "test_tutorials.py", "passes/test_transposes.py", "backend/cpu/test_widen.py",
                 "compile/test_tuning_rpc.py", "passes/test_amp_numeric.py")
WORKER_MEMORY = 3 << 30  # a worker's peak resident memory is about 2 GB (torch, TVM, a zoo model's builds)


@pytest.fixture(autouse=True)
def eight_bit_activation_codes(monkeypatch):
    """quantize's automatic activation bits follow the host (relay_amp.targets.seven_bit_codes: 7 on AVX2 hosts
    without VNNI); tests quantize to 8 bits on every host unless they name the bits or put the host's rule back."""
    from relay_amp.passes.quantize import realize

    monkeypatch.setattr(realize, "seven_bit_codes", lambda target=None: False)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU this process may use (xdist's own count may see one core with two threads), as
    many as the free memory holds."""
    return max(1, min(len(os.sched_getaffinity(0)), psutil.virtual_memory().available // WORKER_MEMORY))


def pytest_collection_modifyitems(session, config, items):
    """The longest files' tests first, in LONGEST_FILES' order, then the rest as collected."""
    tests = Path(__file__).parent
    rank = {str(tests / name): place for place, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(str(item.path), len(LONGEST_FILES)))


def pytest_configure(config):
    """Cap oneDNN below AMX for the session where PyTorch's AMX path dies (relay_amp.tools.pytorch)."""
    if importlib.util.find_spec("torch") is not None:
        from relay_amp.tools.pytorch import avoid_broken_onednn_amx

        avoid_broken_onednn_amx()
