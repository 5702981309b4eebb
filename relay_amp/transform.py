"""The relay_amp passes as tvm.transform.Pass objects, for use inside tvm.transform.Sequential."""

from .amp import ToMixedPrecision
from .casts import EliminateRedundantCasts
from .dispatch import UseDotKernels
from .fastmath import FastMath
from .layout import ConvertLayout
from .recast import Recast

__all__ = ["ConvertLayout", "EliminateRedundantCasts", "FastMath", "Recast", "ToMixedPrecision", "UseDotKernels"]
