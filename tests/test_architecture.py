"""The package layout: imports point down the pipeline, and ARCHITECTURE.md names every module there is."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "relay_amp"
# Each room and the rooms it must not import from (tools > compile > backend > passes > core).
FORBIDDEN = {
    "passes": ("backend", "compile", "tools"),
    "backend": ("compile", "tools"),
    "compile": ("tools",),
    "tools": (),
    "core": ("passes", "backend", "compile", "tools"),
}
ROOMS = ("passes", "backend", "compile", "tools")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _dotted(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _room(dotted: list[str]) -> str:
    return dotted[1] if len(dotted) > 1 and dotted[1] in ROOMS else "core"


def _imported(path: Path) -> set[str]:
    """Every relay_amp module `path` imports, as dotted names."""
    package = _dotted(path) if path.name == "__init__.py" else _dotted(path)[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = base + (node.module.split(".") if node.module else [])
            found.update(".".join(target + ([alias.name] if not node.module else [])) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("relay_amp")}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_the_pipeline(path):
    room = _room(_dotted(path))
    if path.parent == PACKAGE and path.name in ("__init__.py", "transform.py"):
        return  # the public API re-exports from every room
    upward = [name for name in _imported(path) if _room(name.split(".")) in FORBIDDEN[room]]
    assert not upward, f"{path.relative_to(PACKAGE)} ({room}) imports {upward}"


def test_architecture_page_names_every_module():
    page = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    missing = [str(p.relative_to(ROOT)) for p in _modules()
               if p.name != "__init__.py" and str(p.relative_to(PACKAGE)) not in page]
    assert not missing, f"ARCHITECTURE.md does not mention {missing}"


def test_the_import_check_sees_relative_imports():
    amx = PACKAGE / "backend" / "cpu" / "amx.py"  # `from . import kernels`, `from ...errors import DTypeError`
    assert {"relay_amp.errors", "relay_amp.backend.cpu.kernels"} <= _imported(amx)
    assert _room(["relay_amp", "backend", "cpu", "amx"]) == "backend" and _room(["relay_amp", "errors"]) == "core"
