"""SplitsAsSlices: a split read only part by part becomes one strided slice per part, so fusion moves each part's
slice into the function that reads it."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import targets
from relay_amp.compile.build import build
from relay_amp.passes.splits import SplitsAsSlices, splits_as_slices
from relay_amp.runtime import run_executable

from builders import timm_through_onnx
from pass_checks import assert_transforms, prepared_function_names


@I.ir_module
class QueryKeyValue:
    @R.function
    def main(x: R.Tensor((1, 8, 48), "float32")) -> R.Tensor((1, 4, 8, 8), "float32"):
        with R.dataflow():
            parts = R.split(x, [16, 32], axis=2)
            q = R.permute_dims(R.reshape(parts[0], (1, 8, 2, 8)), [0, 2, 1, 3])
            k = R.permute_dims(R.reshape(parts[1], (1, 8, 2, 8)), [0, 2, 3, 1])
            v = R.multiply(parts[2], R.const(0.5, "float32"))
            scores = R.matmul(q, k)
            out = R.concat([scores, R.permute_dims(R.reshape(v, (1, 8, 2, 8)), [0, 2, 1, 3])], axis=1)
            R.output(out)
        return out


@I.ir_module
class QueryKeyValueSliced:
    @R.function
    def main(x: R.Tensor((1, 8, 48), "float32")) -> R.Tensor((1, 4, 8, 8), "float32"):
        with R.dataflow():
            q = R.permute_dims(R.reshape(R.strided_slice(x, axes=[2], begin=[0], end=[16]), (1, 8, 2, 8)),
                               [0, 2, 1, 3])
            k = R.permute_dims(R.reshape(R.strided_slice(x, axes=[2], begin=[16], end=[32]), (1, 8, 2, 8)),
                               [0, 2, 3, 1])
            v = R.multiply(R.strided_slice(x, axes=[2], begin=[32], end=[48]), R.const(0.5, "float32"))
            scores = R.matmul(q, k)
            out = R.concat([scores, R.permute_dims(R.reshape(v, (1, 8, 2, 8)), [0, 2, 1, 3])], axis=1)
            R.output(out)
        return out


def test_each_part_of_a_split_is_a_slice_of_its_input():
    assert_transforms(SplitsAsSlices(), QueryKeyValue, QueryKeyValueSliced)


@I.ir_module
class HalvesOfASlice:
    @R.function
    def main(x: R.Tensor((1, 4, 4, 32), "float32")) -> R.Tensor((1, 4, 4, 12), "float32"):
        with R.dataflow():
            kept = R.strided_slice(x, axes=[3], begin=[0], end=[24])
            halves = R.split(kept, 2, axis=3)
            out = R.multiply(halves[0], R.sigmoid(halves[1]))
            R.output(out)
        return out


@I.ir_module
class HalvesOfTheSource:
    @R.function
    def main(x: R.Tensor((1, 4, 4, 32), "float32")) -> R.Tensor((1, 4, 4, 12), "float32"):
        with R.dataflow():
            out = R.multiply(R.strided_slice(x, axes=[3], begin=[0], end=[12]),
                             R.sigmoid(R.strided_slice(x, axes=[3], begin=[12], end=[24])))
            R.output(out)
        return out


def test_parts_of_a_slice_along_the_split_axis_slice_its_source_once():
    """A kernel result's padding channels sliced off, then split in equal sections (a GLU's halves)."""
    assert_transforms(SplitsAsSlices(), HalvesOfASlice, HalvesOfTheSource)


@I.ir_module
class SplitOfARowSlice:
    @R.function
    def main(x: R.Tensor((1, 6, 32), "float32")) -> R.Tensor((1, 4, 16), "float32"):
        with R.dataflow():
            rows = R.strided_slice(x, axes=[1], begin=[1], end=[5])
            halves = R.split(rows, 2, axis=2)
            out = R.add(halves[0], halves[1])
            R.output(out)
        return out


@I.ir_module
class SplitOfARowSliceAsSlices:
    @R.function
    def main(x: R.Tensor((1, 6, 32), "float32")) -> R.Tensor((1, 4, 16), "float32"):
        with R.dataflow():
            rows = R.strided_slice(x, axes=[1], begin=[1], end=[5])
            out = R.add(R.strided_slice(rows, axes=[2], begin=[0], end=[16]),
                        R.strided_slice(rows, axes=[2], begin=[16], end=[32]))
            R.output(out)
        return out


def test_a_slice_along_another_axis_stays_the_parts_source():
    assert_transforms(SplitsAsSlices(), SplitOfARowSlice, SplitOfARowSliceAsSlices)


@I.ir_module
class SplitReadWhole:
    @R.function
    def main(x: R.Tensor((1, 8, 48), "float32")) -> R.Tensor((1, 8, 48), "float32"):
        with R.dataflow():
            parts = R.split(x, 3, axis=2)
            first = R.multiply(parts[0], R.const(2.0, "float32"))
            out = R.concat((first, parts[1], parts[2]), axis=2)
            flipped = R.concat(parts, axis=2)
            total = R.add(out, flipped)
            R.output(total)
        return total


def test_a_split_read_as_a_whole_stays():
    assert_transforms(SplitsAsSlices(), SplitReadWhole, SplitReadWhole)


def test_the_functional_form_leaves_a_module_without_splits_as_it_is():
    assert splits_as_slices(HalvesOfTheSource).same_as(HalvesOfTheSource)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-6), ("bfloat16", 1e-2)])
def test_an_attention_split_builds_without_a_split_function_and_matches_the_generic_build(dtype, tolerance):
    """The query/key/value split through the host's CPU pipeline (fp32, and bf16 after AMP): no function splits
    a tensor, and the output is the generic build's within bf16's rounding (exact in fp32)."""
    mod = QueryKeyValue if dtype == "float32" else relay_amp.to_mixed_precision(QueryKeyValue, dtype)
    assert not [name for name in prepared_function_names(mod) if "split" in name]
    data = np.random.default_rng(0).standard_normal((1, 8, 48)).astype("float32")
    got = run_executable(build(mod, targets.host_preset()), [data])[0].astype("float64")
    expected = relay_amp.run(QueryKeyValue, [data])[0].astype("float64")
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def test_a_timm_edgenext_builds_without_a_split_function(tmp_path):
    """timm's EdgeNeXt-XX-S (its SDTA blocks split channels into convolved parts added in a chain, and its
    attention's query, key and value into heads), a model this was not written on: no function of its build
    splits a tensor, and it matches PyTorch's fp32."""
    pytest.importorskip("timm")
    _, imported, x, expected = timm_through_onnx("edgenext_xx_small", tmp_path)
    assert "R.split(" in imported.script()
    assert not [name for name in prepared_function_names(imported) if "split" in name]
    built = run_executable(build(imported, targets.host_preset()), [x])[0]
    np.testing.assert_allclose(built, expected, atol=1e-5 * np.abs(expected).max())


def test_a_function_the_module_lacks_is_a_module_error_naming_it():
    from relay_amp.errors import ModuleError

    with pytest.raises(ModuleError, match="'decode'"):
        splits_as_slices(QueryKeyValue, "decode")
