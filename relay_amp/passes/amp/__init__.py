"""Automatic mixed precision: op lists, the conversion pass, and the precision plan."""

from .convert import ToMixedPrecision, apply_plan, to_mixed_precision
from .lists import OpLists, default_lists
from .plan import PlanEntry, PrecisionPlan, precision_plan

__all__ = [
    "OpLists",
    "PlanEntry",
    "PrecisionPlan",
    "ToMixedPrecision",
    "apply_plan",
    "default_lists",
    "precision_plan",
    "to_mixed_precision",
]
