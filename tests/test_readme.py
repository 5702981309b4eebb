"""README.md opens with the two commands a new user runs, and CI runs the same test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_install_and_test_commands():
    install, test = readme_commands()
    assert install.startswith("pip install") and "relay-amp " in install
    assert test.startswith("pip install") and "python -m pytest tests" in test


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    assert test_command in (ROOT / ".ci" / "run").read_text()
