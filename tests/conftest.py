"""Test configuration: make sibling test modules importable (shared model builders and checks), build the CPU
presets for no core in particular (the same kernels on every host; tests of per-core choices name a core), split the
cores between pytest-xdist's workers, and keep PyTorch off AMX where its AMX kernels die (before any test runs a
torch op)."""

import importlib.util
import os
import sys
from pathlib import Path

import psutil

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each worker before it imports this file
if WORKERS > 1:  # each worker's TVM, OpenMP (PyTorch) and their spinning threads on its share of the cores only
    for name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(name, str(max(1, len(os.sched_getaffinity(0)) // WORKERS)))

from relay_amp.targets import CPU_MODEL_ENV  # noqa: E402 (after the thread counts: importing relay_amp sizes TVM's pool)

sys.path.insert(0, str(Path(__file__).parent))
os.environ[CPU_MODEL_ENV] = ""  # set before any test module makes a target


WORKER_MEMORY = 3 << 30  # a worker's peak resident memory is about 2 GB (torch, TVM, a zoo model's builds)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU this process may use (xdist's own count may see one core with two threads), as
    many as the free memory holds."""
    return max(1, min(len(os.sched_getaffinity(0)), psutil.virtual_memory().available // WORKER_MEMORY))


def pytest_configure(config):
    """Cap oneDNN below AMX for the session where PyTorch's AMX path dies (relay_amp.tools.pytorch)."""
    if importlib.util.find_spec("torch") is not None:
        from relay_amp.tools.pytorch import avoid_broken_onednn_amx

        avoid_broken_onednn_amx()
