"""The wheel a plain `pip install .` builds holds every subpackage and data file, and imports on its own."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """relay_amp's wheel, built from a copy of this checkout as `pip install .` builds it (isolated setuptools)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):  # a copy: no build/ left in the checkout, none reused from it
        shutil.copy(ROOT / name, source)
    shutil.copytree(ROOT / "relay_amp", source / "relay_amp", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    str(source), "-w", str(out)], check=True, capture_output=True)
    return next(out.glob("relay_amp-*.whl"))


def test_wheel_holds_every_package_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.relative_to(ROOT)) for p in (ROOT / "relay_amp").rglob("__init__.py")}
    data = {str(p.relative_to(ROOT)) for p in (ROOT / "relay_amp" / "data").iterdir()}
    assert packages | data <= names, sorted((packages | data) - names)


def test_wheel_imports_without_the_checkout(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path)
    probe = "import relay_amp, sys; sys.stdout.write(relay_amp.__file__)"
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)},
                           check=True, capture_output=True, text=True).stdout
    assert found.startswith(str(tmp_path))


def test_the_files_the_suite_runs_first_exist():
    """conftest.LONGEST_FILES names test files by path: a renamed one would silently lose its place."""
    from conftest import LONGEST_FILES

    assert [name for name in LONGEST_FILES if not (ROOT / "tests" / name).is_file()] == []
