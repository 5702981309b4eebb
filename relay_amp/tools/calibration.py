"""Calibration data for quantize: random batches shaped like a model's inputs, or batches read from a .npz file."""

import os

import numpy as np
import tvm

from .._ir import get_function
from ..errors import ModelLoadError, OptionError
from ..passes.shapes import static_input_shape
from .models import example_inputs

CALIBRATION_BATCHES = 8


def random_batches(mod: tvm.IRModule, count: int = CALIBRATION_BATCHES, func: str = "main") -> list[list[np.ndarray]]:
    """`count` batches of random inputs for `func` (seeds 1..count: the benchmarks' own inputs use seed 0)."""
    return [example_inputs(mod, seed, func) for seed in range(1, count + 1)]


def load_batches(mod: tvm.IRModule, path: str | os.PathLike, func: str = "main") -> list[list[np.ndarray]]:
    """Batches from a .npz holding, per input of `func` (by name; any name for a one-input model), samples along
    axis 0: split into batches of the model's batch size (the first axis of its input)."""
    try:
        with np.load(path) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read calibration data {path}: {err}") from err
    params = get_function(mod, func).params
    if len(params) == 1 and len(arrays) == 1:
        arrays = {params[0].name: next(iter(arrays.values()))}
    columns = [_split(arrays, param, path) for param in params]
    return [list(batch) for batch in zip(*columns)]


def _split(arrays: dict[str, np.ndarray], param, path) -> list[np.ndarray]:
    name, shape = param.name, static_input_shape(param)
    if name not in arrays:
        raise OptionError(f"calibration data {path} has no array for input {name!r} (it has {sorted(arrays)})")
    samples = arrays[name]
    if samples.shape[1:] != shape[1:] or not samples.shape[0] or samples.shape[0] % shape[0]:
        raise OptionError(f"calibration array {name!r} in {path} is {samples.shape}: it needs a multiple of "
                          f"{shape[0]} samples of {shape[1:]}")
    return np.split(samples.astype(str(param.ty.dtype)), samples.shape[0] // shape[0])
