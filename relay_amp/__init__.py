"""relay_amp: Relax passes that turn an fp32 model into a faster mixed- or low-precision one."""

from . import frontend, targets, transform
from .compile.build import build, compile_ptx, cuda_source, export_library
from .compile.tuning import tune
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
from .passes import amp
from .passes.amp import PrecisionPlan, apply_plan, precision_plan, to_mixed_precision
from .passes.casts import eliminate_redundant_casts
from .passes.moves import hoist_over_moves
from .passes.layers import Layer, count_layers, list_layers
from .passes.layout import LayoutConfig
from .passes.quantize import QuantPlan, apply_quant_plan, quant_plan, quantize, realize_qdq
from .passes.ranges import RangeStats, calibrate
from .passes.recast import recast
from .passes.shapes import specialize, symbolic_dims
from .passes.weight_only import quantize_weights
from .runtime import configure_threads, run
from .serialization import load, save
from .tools import digits, metrics, models
from .tools.accuracy import Report, tune_precision
from .tools.bench import benchmark

configure_threads()  # one thread per physical core, unless TVM_NUM_THREADS or OMP_NUM_THREADS says otherwise

__all__ = [
    "DTypeError",
    "PrecisionPlan",
    "QuantPlan",
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
    "apply_plan",
    "apply_quant_plan",
    "benchmark",
    "build",
    "calibrate",
    "compile_ptx",
    "configure_threads",
    "count_layers",
    "cuda_source",
    "digits",
    "eliminate_redundant_casts",
    "export_library",
    "frontend",
    "hoist_over_moves",
    "list_layers",
    "load",
    "metrics",
    "models",
    "precision_plan",
    "quant_plan",
    "quantize",
    "quantize_weights",
    "realize_qdq",
    "recast",
    "run",
    "save",
    "specialize",
    "symbolic_dims",
    "targets",
    "to_mixed_precision",
    "transform",
    "tune",
    "tune_precision",
]
