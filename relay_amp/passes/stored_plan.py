"""Plans kept on a module and in JSON files: what the precision plan and the quantization plan share."""

import json
import os
from dataclasses import asdict
from typing import ClassVar

import tvm

from ..errors import ModelLoadError, ModuleError
from ..serialization import atomic_write_text


class StoredPlan:
    """Base of a dataclass plan with an `entries` list: JSON, files and the module attribute it lives in."""

    FORMAT: ClassVar[int]
    ATTR: ClassVar[str]  # the module attribute holding the plan
    KIND: ClassVar[str]  # how errors name it
    ENTRY: ClassVar[type]

    def to_json(self) -> str:
        """The plan as a JSON document."""
        return json.dumps({"format": self.FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "plan"):
        """Parse a plan written by to_json, or raise ModelLoadError naming `source`."""
        try:
            data = json.loads(text)
            if data.pop("format") != cls.FORMAT:
                raise ValueError(f"unsupported plan format, expected {cls.FORMAT}")
            entries = [cls.ENTRY(**entry) for entry in data.pop("entries")]
            return cls(entries=entries, **data)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ModelLoadError(f"{source} is not a relay_amp {cls.KIND}: {err}") from err

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike):
        """Read a plan saved with save()."""
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as err:
            raise ModelLoadError(f"cannot read {cls.KIND} {path}: {err}") from err
        return cls.from_json(text, str(path))

    def attach(self, mod: tvm.IRModule) -> tvm.IRModule:
        """`mod` with the plan stored as a module attribute (it survives save/load and Sequential)."""
        return mod.with_attr(self.ATTR, self.to_json())

    @classmethod
    def of_module(cls, mod: tvm.IRModule, how_to_get_one: str):
        """The plan stored on `mod`, or ModuleError saying `how_to_get_one`."""
        attrs = mod.attrs
        if attrs is None or cls.ATTR not in attrs:
            raise ModuleError(f"the module carries no {cls.KIND}: {how_to_get_one}")
        return cls.from_json(str(attrs[cls.ATTR]), f"the module's {cls.KIND} attribute")
