"""The exception hierarchy of relay_amp: every error a user can cause derives from RelayAmpError.

Each class is registered with tvm_ffi, so an error raised inside a pass run by TVM's pass
infrastructure reaches the caller as the same class instead of a bare RuntimeError.
"""

from tvm_ffi.error import register_error


def _registered(cls: type) -> type:
    return register_error(f"relay_amp.{cls.__name__}", cls)


@_registered
class RelayAmpError(Exception):
    """Base class of every error raised by relay_amp on bad input."""


@_registered
class UnknownOpError(RelayAmpError, ValueError):
    """An operator name that is not a registered Relax op."""


@_registered
class OpListConflictError(RelayAmpError, ValueError):
    """An operator named in more than one precision list."""


@_registered
class LayerIndexError(RelayAmpError, IndexError):
    """A layer index or layer name that does not select a layer of the module."""


@_registered
class DTypeError(RelayAmpError, ValueError):
    """A dtype that is malformed or not supported where it was given."""


@_registered
class ModuleError(RelayAmpError, ValueError):
    """A module that lacks the function or structure a pass needs."""


@_registered
class OptionError(RelayAmpError, ValueError):
    """An option value outside the accepted set."""


@_registered
class ModelLoadError(RelayAmpError):
    """A model or module file that cannot be read or parsed."""


@_registered
class MissingDependencyError(RelayAmpError, ImportError):
    """An optional dependency needed for the requested feature is not installed."""


@_registered
class TargetError(RelayAmpError, ValueError):
    """A target preset that is unknown or that this host cannot run."""


@_registered
class TuningError(RelayAmpError):
    """Autotuning that produced no usable record, or a tuning log that is corrupt or does not match."""


def one_line(message: object) -> str:
    """`message` as one line: its runs of whitespace, line breaks included, as single spaces."""
    return " ".join(str(message).split())
