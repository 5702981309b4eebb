"""Dtype validation and conversion of constant data between dtypes."""

import warnings

import ml_dtypes
import numpy as np
import tvm

from .errors import DTypeError

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
LOW_FLOAT_DTYPES = ("float16", "bfloat16")
MODEL_FLOAT_DTYPES = ("float32", *LOW_FLOAT_DTYPES)  # the float dtypes models compute in (not float64)
_ML_DTYPES = {
    "bfloat16": ml_dtypes.bfloat16,
    "int4": ml_dtypes.int4,
    "uint4": ml_dtypes.uint4,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}


def check_dtype(dtype: str, option: str = "dtype") -> str:
    """Return `dtype` as TVM spells it, or raise DTypeError naming `option`."""
    if not isinstance(dtype, str) or not dtype:
        raise DTypeError(f"{option}: expected a dtype string such as 'float16', got {dtype!r}")
    try:
        parsed = tvm.DataType(dtype)
    except Exception as err:  # TVM raises its own error types for unparsable dtypes
        raise DTypeError(f"{option}: {dtype!r} is not a dtype") from err
    if parsed.lanes != 1:
        raise DTypeError(f"{option}: vector dtype {dtype!r} is not supported")
    return str(parsed)


def check_choice(dtype: str, allowed: tuple[str, ...], option: str) -> str:
    """Validate `dtype` and require it to be one of `allowed`."""
    dtype = check_dtype(dtype, option)
    if dtype not in allowed:
        raise DTypeError(f"{option}: {dtype!r} is not supported here, use one of {list(allowed)}")
    return dtype


def is_float(dtype: str) -> bool:
    """Whether `dtype` is a floating-point dtype (bfloat16 included)."""
    return dtype in FLOAT_DTYPES or dtype.startswith("float8")


def widens_exactly(narrow: str, wide: str) -> bool:
    """Whether both are float dtypes and `narrow` has fewer bytes: a cast from it to `wide` and back is the
    identity."""
    return is_float(narrow) and is_float(wide) and numpy_dtype(narrow).itemsize < numpy_dtype(wide).itemsize


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that stores `dtype` exactly (ml_dtypes for bfloat16, int4, float8)."""
    return np.dtype(_ML_DTYPES.get(dtype, dtype))


def cast_array(array: np.ndarray, dtype: str) -> np.ndarray:
    """Cast `array` to `dtype` the way TVM's astype does (round to nearest even for floats)."""
    target = numpy_dtype(dtype)
    if not is_float(dtype) and is_float(str(array.dtype)):
        array = np.trunc(array.astype(np.float64))
    with np.errstate(over="ignore", invalid="ignore"):
        result = array.astype(target)
    if is_float(dtype) and np.isfinite(array).all() and not np.isfinite(result.astype("float64")).all():
        warnings.warn(f"a constant with max |x| {float(np.abs(array).max()):.3g} overflows {dtype}: "
                      "its cast values become inf", stacklevel=3)
    return result


def is_sub_byte(dtype: str) -> bool:
    """Whether `dtype` packs several values per byte (int4, uint4): TVM 0.27 can neither store nor compile it."""
    return tvm.DataType(dtype).bits < 8


def can_cast_offline(dtype: str) -> bool:
    """Whether a constant can be stored in `dtype` (TVM 0.27 cannot build sub-byte constants)."""
    return not is_sub_byte(dtype)
