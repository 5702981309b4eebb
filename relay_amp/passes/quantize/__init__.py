"""Post-training int8: observers, the quantization plan, the pass that calibrates and realizes it, and the pass that
realizes a model quantized elsewhere (QDQ)."""

from .plan import QuantEntry, QuantPlan, quant_plan
from .qdq import RealizeQDQ, realize_qdq
from .realize import Quantize, apply_quant_plan, quantize

__all__ = ["QuantEntry", "QuantPlan", "Quantize", "RealizeQDQ", "apply_quant_plan", "quant_plan", "quantize",
           "realize_qdq"]
