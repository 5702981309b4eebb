"""The relay_amp passes as tvm.transform.Pass objects, for use inside tvm.transform.Sequential."""

from .recast import Recast

__all__ = ["Recast"]
