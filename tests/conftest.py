"""Test configuration: make sibling test modules importable (shared model builders and checks), build the CPU
presets for no core in particular (the same kernels on every host; tests of per-core choices name a core), and keep
PyTorch off AMX where its AMX kernels die (before any test runs a torch op)."""

import importlib.util
import os
import sys
from pathlib import Path

from relay_amp.targets import CPU_MODEL_ENV

sys.path.insert(0, str(Path(__file__).parent))
os.environ[CPU_MODEL_ENV] = ""  # set before any test module makes a target


def pytest_configure(config):
    """Cap oneDNN below AMX for the session where PyTorch's AMX path dies (relay_amp.tools.pytorch)."""
    if importlib.util.find_spec("torch") is not None:
        from relay_amp.tools.pytorch import avoid_broken_onednn_amx

        avoid_broken_onednn_amx()
