"""Modules to and from JSON files, atomic writes, and dataclasses (kernel specs) back from their JSON."""

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import tvm

from .errors import ModelLoadError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int = 0o644) -> Iterator[Path]:
    """A temporary path in `path`'s folder (its suffix kept, for writers that choose a format by it) to write to;
    when the block ends without an exception it is given `mode` and renamed to `path`, else removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=f".tmp{target.suffix}")
    os.close(handle)
    try:
        yield Path(temp)
        os.chmod(temp, mode)  # mkstemp creates 0600; a written artifact is readable like any other file
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder, then rename it into place."""
    with atomic_path(path) as temp:
        temp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    if not isinstance(text, str):
        raise TypeError(f"expected text, got {type(text).__name__}")
    atomic_write_bytes(path, text.encode("utf-8"))


def save(mod: tvm.IRModule, path: str | os.PathLike) -> None:
    """Save a module (bf16/fp16 constants and the precision plan included) as TVM JSON, atomically."""
    atomic_write_text(path, tvm.ir.save_json(mod))


def load(path: str | os.PathLike) -> tvm.IRModule:
    """Load a module written by save(), or raise ModelLoadError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        mod = tvm.ir.load_json(text)
    except Exception as err:  # OSError, JSON errors and TVM's own error types
        raise ModelLoadError(f"cannot load a module from {path}: {err}") from err
    if not isinstance(mod, tvm.IRModule):
        raise ModelLoadError(f"{path} holds a {type(mod).__name__}, not an IRModule")
    return mod


def dataclass_from_json(cls, text: str):
    """An instance of dataclass `cls` from the JSON of its `asdict` (JSON's lists back to the tuples they were)."""
    fields = json.loads(text)
    return cls(**{name: tuple(value) if isinstance(value, list) else value for name, value in fields.items()})
