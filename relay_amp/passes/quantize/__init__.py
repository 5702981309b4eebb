"""Calibrated post-training int8: observers, the quantization plan, and the pass that realizes it."""

from .plan import QuantEntry, QuantPlan, quant_plan
from .realize import Quantize, apply_quant_plan, quantize

__all__ = ["QuantEntry", "QuantPlan", "Quantize", "apply_quant_plan", "quant_plan", "quantize"]
