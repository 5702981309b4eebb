"""The precision plan: which dtype every op call computes in, and why; saved, edited and re-applied."""

from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import tvm
from tabulate import tabulate

from ..stored_plan import StoredPlan

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
class PrecisionPlan(StoredPlan):
    """Per-call dtype decisions of one AMP conversion of one function."""

    FORMAT: ClassVar[int] = PLAN_FORMAT
    ATTR: ClassVar[str] = PLAN_ATTR
    KIND: ClassVar[str] = "precision plan"
    ENTRY: ClassVar[type] = PlanEntry

    target_dtype: str
    func: str = "main"
    entries: list[PlanEntry] = field(default_factory=list)
    casts_inserted: int = 0

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
    return plan.attach(mod)


def precision_plan(mod: tvm.IRModule) -> PrecisionPlan:
    """The precision plan stored on a module converted by to_mixed_precision."""
    return PrecisionPlan.of_module(mod, "convert it with to_mixed_precision first")
