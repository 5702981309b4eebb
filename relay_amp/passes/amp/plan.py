"""The precision plan: which dtype every op call computes in, and why; saved, edited and re-applied."""

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field

import tvm
from tabulate import tabulate

from ...errors import ModelLoadError, ModuleError
from ...serialization import atomic_write_text

PLAN_ATTR = "relay_amp.precision_plan"
PLAN_FORMAT = 1


@dataclass(frozen=True)
class PlanEntry:
    """One op call: its position among the function's op calls, its op and name, dtype and reason."""

    index: int
    op: str
    name: str
    dtype: str
    reason: str


@dataclass
class PrecisionPlan:
    """Per-call dtype decisions of one AMP conversion of one function."""

    target_dtype: str
    func: str = "main"
    entries: list[PlanEntry] = field(default_factory=list)
    casts_inserted: int = 0

    def to_json(self) -> str:
        """The plan as a JSON document."""
        return json.dumps({"format": PLAN_FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> "PrecisionPlan":
        """Parse a plan written by to_json, or raise ModelLoadError naming `source`."""
        try:
            data = json.loads(text)
            if data.pop("format") != PLAN_FORMAT:
                raise ValueError(f"unsupported plan format, expected {PLAN_FORMAT}")
            entries = [PlanEntry(**entry) for entry in data.pop("entries")]
            return cls(entries=entries, **data)
        except (ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{source} is not a relay_amp precision plan: {err}") from err

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PrecisionPlan":
        """Read a plan saved with save()."""
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as err:
            raise ModelLoadError(f"cannot read precision plan {path}: {err}") from err
        return cls.from_json(text, str(path))

    def summary(self) -> str:
        """A readable table: the calls per dtype and reason, and the casts inserted."""
        counts = Counter((entry.dtype, entry.reason.split(":")[0]) for entry in self.entries)
        rows = sorted((dtype, reason, n) for (dtype, reason), n in counts.items())
        table = tabulate(rows, headers=("dtype", "reason", "calls"))
        per_dtype = Counter(entry.dtype for entry in self.entries)
        totals = ", ".join(f"{n} {dtype}" for dtype, n in sorted(per_dtype.items()))
        return f"{table}\n\n{len(self.entries)} op calls ({totals}); {self.casts_inserted} casts inserted"


def attach_plan(mod: tvm.IRModule, plan: PrecisionPlan) -> tvm.IRModule:
    """`mod` with the plan stored as a module attribute (it survives save/load and Sequential)."""
    return mod.with_attr(PLAN_ATTR, plan.to_json())


def precision_plan(mod: tvm.IRModule) -> PrecisionPlan:
    """The precision plan stored on a module converted by to_mixed_precision."""
    attrs = mod.attrs
    if attrs is None or PLAN_ATTR not in attrs:
        raise ModuleError("the module carries no precision plan: convert it with to_mixed_precision first")
    return PrecisionPlan.from_json(str(attrs[PLAN_ATTR]), "the module's plan attribute")
