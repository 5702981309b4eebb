"""A model exported the way TensorFlow users export: Keras layers through tf2onnx (tests/data/make_keras_tiny.py
wrote the file and TensorFlow's outputs). Its convolutions are NCHW Conv nodes between the exporter's Transposes
of NHWC tensors, its activations spelled as tf2onnx writes them."""

from pathlib import Path

import numpy as np
import pytest

import relay_amp
from relay_amp.runtime import run_executable

from pass_checks import prepared_function_names

DATA = Path(__file__).parent / "data" / "keras_tiny"
FP32_TOLERANCE = 2e-5  # relative to the largest output: fp32 sums in another order, fast-math polynomials
BF16_FLOOR = 1e-2  # bf16 AMP may be this far off, or as far off as TensorFlow's own mixed_bfloat16 (x1.5)
DOT_CONVS = 8  # the model's convs and dense layer, less its two depthwise convs


@pytest.fixture(scope="module")
def keras_tiny():
    """The imported module and the arrays the generator saved (image, tf_fp32, tf_mixed_bfloat16)."""
    return relay_amp.frontend.from_onnx(DATA.with_suffix(".onnx")), np.load(DATA.with_suffix(".npz"))


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got.astype("float64") - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tf2onnx_export_matches_tensorflow(keras_tiny, dtype):
    mod, arrays = keras_tiny
    expected = arrays["tf_fp32"]
    tolerance = FP32_TOLERANCE
    if dtype != "float32":
        mod = relay_amp.to_mixed_precision(mod, dtype)
        tolerance = max(BF16_FLOOR, 1.5 * _relative_error(arrays["tf_mixed_bfloat16"], expected))
    got = run_executable(relay_amp.build(mod, relay_amp.targets.host_preset()), [arrays["image"]])[0]
    assert _relative_error(got, expected) <= tolerance


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tf2onnx_export_runs_channels_last_on_the_kernels_without_transposes(keras_tiny, dtype):
    """The exporter's 18 Transposes cancel against the CPU build's NHWC layout, or are views: before, 7 functions
    still transposed (identity permutations ConvertLayout left, squeeze-excite gates of one pixel), and the
    activations they stood before ran apart from the kernels' epilogues."""
    mod, _ = keras_tiny
    names = prepared_function_names(mod if dtype == "float32" else relay_amp.to_mixed_precision(mod, dtype))
    assert not [name for name in names if "transpose" in name]
    assert sum("dot_kernel" in name for name in names) == DOT_CONVS
