"""Test configuration: make sibling test modules importable (shared model builders and checks), and keep PyTorch
off AMX where its AMX kernels die (before any test runs a torch op)."""

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    """Cap oneDNN below AMX for the session where PyTorch's AMX path dies (relay_amp.tools.pytorch)."""
    if importlib.util.find_spec("torch") is not None:
        from relay_amp.tools.pytorch import avoid_broken_onednn_amx

        avoid_broken_onednn_amx()
