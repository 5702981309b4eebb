"""Every tutorial runs from start to end (they are scripts in notebook cell format)."""

import runpy
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).resolve().parents[1] / "tutorials").glob("*.py"))


def test_there_are_tutorials():
    assert TUTORIALS


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_tutorial_runs(path, capsys, monkeypatch):
    monkeypatch.setenv("RELAY_AMP_TUTORIAL_TRIALS", "4")  # tutorials that tune do a handful of trials
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out
