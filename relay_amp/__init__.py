"""relay_amp: Relax passes that turn an fp32 model into a faster mixed- or low-precision one."""

from . import amp, amx, digits, frontend, kernels, metrics, models, schedules, targets, tensorcore, transform
from .accuracy import Report, tune_precision
from .bench import benchmark
from .build import build
from .amp import PrecisionPlan, apply_plan, precision_plan, to_mixed_precision
from .casts import eliminate_redundant_casts
from .errors import (
    DTypeError,
    LayerIndexError,
    MissingDependencyError,
    ModelLoadError,
    ModuleError,
    OpListConflictError,
    OptionError,
    RelayAmpError,
    TargetError,
    TuningError,
    UnknownOpError,
)
from .layers import Layer, count_layers, list_layers
from .layout import LayoutConfig
from .ranges import RangeStats, calibrate
from .recast import recast
from .runtime import run
from .serialization import load, save
from .tuning import tune

__all__ = [
    "DTypeError",
    "PrecisionPlan",
    "RangeStats",
    "Report",
    "Layer",
    "LayoutConfig",
    "LayerIndexError",
    "MissingDependencyError",
    "ModelLoadError",
    "ModuleError",
    "OpListConflictError",
    "OptionError",
    "RelayAmpError",
    "TargetError",
    "TuningError",
    "UnknownOpError",
    "amp",
    "amx",
    "apply_plan",
    "benchmark",
    "build",
    "calibrate",
    "count_layers",
    "digits",
    "eliminate_redundant_casts",
    "frontend",
    "kernels",
    "list_layers",
    "load",
    "metrics",
    "models",
    "precision_plan",
    "recast",
    "run",
    "save",
    "schedules",
    "targets",
    "tensorcore",
    "to_mixed_precision",
    "transform",
    "tune",
    "tune_precision",
]
