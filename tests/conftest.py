"""Test configuration: make sibling test modules importable (shared model builders and checks)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
