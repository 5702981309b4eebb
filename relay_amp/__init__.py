"""relay_amp: Relax passes that turn an fp32 model into a faster mixed- or low-precision one."""

from . import frontend, models, transform
from .errors import (
    DTypeError,
    LayerIndexError,
    MissingDependencyError,
    ModelLoadError,
    ModuleError,
    OpListConflictError,
    OptionError,
    RelayAmpError,
    UnknownOpError,
)
from .layers import Layer, count_layers, list_layers
from .recast import recast
from .runtime import run

__all__ = [
    "DTypeError",
    "Layer",
    "LayerIndexError",
    "MissingDependencyError",
    "ModelLoadError",
    "ModuleError",
    "OpListConflictError",
    "OptionError",
    "RelayAmpError",
    "UnknownOpError",
    "count_layers",
    "frontend",
    "list_layers",
    "models",
    "recast",
    "run",
    "transform",
]
