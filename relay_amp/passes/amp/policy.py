"""AMP policy: the op lists for one conversion, built from defaults and per-call overrides."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tvm import relax

from ...errors import OpListConflictError, OptionError, UnknownOpError
from ...ops import canonical_ops
from .lists import CATEGORIES, OpLists, default_lists

MISSING_OP_MODES = ("follow", "fp32", "error")
USER_LIST_REASON = "listed by the caller"


@dataclass(frozen=True)
class Condition:
    """Keep calls of `op` in fp32 when attribute `attr` takes one of `values`."""

    op: str
    attr: str
    values: tuple

    def matches(self, call: relax.Call) -> bool:
        """Whether `call` is a call of this op whose attribute has one of the values."""
        if call.op.name != self.op or call.attrs is None or not hasattr(call.attrs, self.attr):
            return False
        value = getattr(call.attrs, self.attr)
        return any(_same_value(value, wanted) for wanted in self.values)


def _same_value(value, wanted) -> bool:
    if isinstance(wanted, bool) or isinstance(value, bool):
        return bool(value) == wanted
    if isinstance(wanted, (int, float)):
        return float(value) == wanted
    return str(value) == str(wanted)


def build_lists(target_dtype: str, overrides: dict[str, Iterable[str] | None]) -> OpLists:
    """Default lists for `target_dtype` with each given category replaced by the caller's ops."""
    given = {cat: canonical_ops(ops) for cat, ops in overrides.items() if ops is not None}
    _check_no_overlap(given)
    moved = {op for ops in given.values() for op in ops}
    defaults = default_lists(target_dtype)
    lists = {}
    for category in CATEGORIES:
        if category in given:
            lists[category] = {op: USER_LIST_REASON for op in given[category]}
        else:
            kept = getattr(defaults, category).items()
            lists[category] = {op: why for op, why in kept if op not in moved}
    return OpLists(**lists)


def _check_no_overlap(given: dict[str, Sequence[str]]) -> None:
    owner: dict[str, str] = {}
    for category, ops in given.items():
        for op in ops:
            if op in owner:
                raise OpListConflictError(f"op {op!r} is in both {owner[op]}_ops and {category}_ops")
            owner[op] = category


def build_conditions(entries: Iterable | None) -> tuple[Condition, ...]:
    """Validate (op, attr, [values]) triples and resolve their op names."""
    conditions = []
    for entry in entries or ():
        if not (isinstance(entry, (tuple, list)) and len(entry) == 3 and isinstance(entry[1], str)):
            raise OptionError(f"conditional_fp32_ops entries are (op, attr, [values]) triples, got {entry!r}")
        op, attr, values = entry
        (full,) = canonical_ops([op])
        values = tuple(values) if isinstance(values, (list, tuple, set)) else (values,)
        conditions.append(Condition(full, attr, values))
    return tuple(conditions)


def check_missing_op_mode(mode: str) -> str:
    """Validate missing_op_mode."""
    if mode not in MISSING_OP_MODES:
        raise OptionError(f"missing_op_mode must be one of {list(MISSING_OP_MODES)}, got {mode!r}")
    return mode


def unlisted_op_error(op: str) -> UnknownOpError:
    """The error for an op that no list names when missing_op_mode is 'error'."""
    return UnknownOpError(f"op {op!r} is in no AMP list and missing_op_mode='error'")
