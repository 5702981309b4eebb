"""The quantization plan: per layer, its dtype, activation threshold and why; stored on the module, saved, edited
and re-applied."""

from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import tvm
from tabulate import tabulate

from ..stored_plan import StoredPlan

QUANT_PLAN_ATTR = "relay_amp.quant_plan"
# what a layer's activations become: int8 codes with a calibrated threshold (uint8 where they are never
# negative), or int8 with a scale computed per row at run time
STATIC_DTYPES = ("int8", "uint8")
DYNAMIC = "dynamic int8"
QUANTIZED_DTYPES = (*STATIC_DTYPES, DYNAMIC)
SHARED_RANGE = "one range with layers"  # how a reason ends where the layer shares its range (quantize.shared)


def code_levels(dtype: str, bits: int = 8) -> int:
    """Steps above zero of `bits`-bit activation codes of `dtype`: uint8's [0, 2^bits - 1], symmetric int8's
    [-(2^(bits - 1) - 1), 2^(bits - 1) - 1] (8 bits: 255 and 127; 7 bits: 127 and 63)."""
    return 2 ** bits - 1 if dtype == "uint8" else 2 ** (bits - 1) - 1


def zero_point_position(low: float, high: float, bits: int = 8) -> float:
    """Where 0.0 falls among the `bits`-bit uint8 codes that span [low, high] (low < 0 < high): the zero point,
    unrounded."""
    return -low / (high - low) * code_levels("uint8", bits)


@dataclass(frozen=True)
class QuantEntry:
    """One layer (the shared layer index over the plan's ops): its activation dtype, threshold and reason.

    dtype is one of QUANTIZED_DTYPES, or "fallback" for a layer left to the plan's fallback dtype; threshold is
    the |x| that the largest code stands for (0 where the layer is dynamic or not quantized). A uint8 entry with a
    zero point z codes x as z + x / step, so codes below z stand for negative values."""

    index: int
    op: str
    name: str
    dtype: str
    threshold: float
    reason: str
    zero_point: int = 0  # the uint8 code of 0.0 (0: symmetric codes)
    bits: int = 8  # the codes' bits: 7 keeps uint8 codes under 128 (see relay_amp.targets.seven_bit_codes)
    # per channel of the layer's input, its mean in calibration: the layer takes out the mean error its weights'
    # rounding makes (relay_amp.passes.quantize.bias); empty: no correction (and in plans saved before)
    input_means: tuple[float, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "input_means", tuple(self.input_means))  # a JSON plan's list

    @property
    def quantized(self) -> bool:
        """Whether the layer runs in int8."""
        return self.dtype in QUANTIZED_DTYPES

    @property
    def step(self) -> float:
        """The value of one code of a static entry: its threshold over the codes above the zero point."""
        return self.threshold / (code_levels(self.dtype, self.bits) - self.zero_point) if self.threshold > 0 else 1.0


@dataclass
class QuantPlan(StoredPlan):
    """The int8 decisions of one quantization of one function, and the options that made them."""

    FORMAT: ClassVar[int] = 1
    ATTR: ClassVar[str] = QUANT_PLAN_ATTR
    KIND: ClassVar[str] = "quantization plan"
    ENTRY: ClassVar[type] = QuantEntry

    ops: list[str]
    observer: str
    weight_granularity: str
    fallback_dtype: str
    func: str = "main"
    entries: list[QuantEntry] = field(default_factory=list)
    quantized_residuals: bool = False  # residual adds read their uint8 operand's codes (False in plans made before)

    def summary(self) -> str:
        """A readable table: layers per dtype and reason, then the count of int8 layers and of those sharing a
        range."""
        counts = Counter((entry.dtype, entry.reason.split(":")[0]) for entry in self.entries)
        rows = sorted((dtype, reason, n) for (dtype, reason), n in counts.items())
        table = tabulate(rows, headers=("dtype", "reason", "layers"))
        quantized = sum(entry.quantized for entry in self.entries)
        residuals = "uint8 codes" if self.quantized_residuals else "floating point"
        shared = sum(SHARED_RANGE in entry.reason for entry in self.entries)
        narrow = sum(entry.quantized and entry.bits < 8 for entry in self.entries)
        corrected = sum(bool(entry.input_means) for entry in self.entries)
        return (f"{table}\n\n{quantized} of {len(self.entries)} layers in int8 ({self.observer} observer, "
                f"{self.weight_granularity} weights{f'; {narrow} with 7-bit activation codes' if narrow else ''}; "
                f"{corrected} correct their weights' rounding error); "
                f"the rest in {self.fallback_dtype}; residual adds read {residuals}; {shared} layers share a range "
                "with others")


def quant_plan(mod: tvm.IRModule) -> QuantPlan:
    """The quantization plan stored on a module made by quantize or apply_quant_plan."""
    return QuantPlan.of_module(mod, "quantize it with relay_amp.quantize first")
