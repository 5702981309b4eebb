"""Test configuration: make sibling test modules importable (shared model builders)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
