"""Each backend's choice of convolution layout: CPU builds convert to NHWC by themselves; CUDA builds convert
convolutions that run on tensor cores (tests/backend/cuda/test_pipeline.py) and keep fp32 ones."""

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import models
from relay_amp.backend.cpu import pipeline as cpu_pipeline
from relay_amp.backend.cuda import pipeline as cuda_pipeline
from relay_amp.passes.layers import layer_bindings
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms


@I.ir_module
class TwoConvs:
    @R.function
    def main(x: R.Tensor((1, 4, 8, 8), "float32"), w1: R.Tensor((8, 4, 3, 3), "float32"),
             w2: R.Tensor((8, 8, 1, 1), "float32")) -> R.Tensor((1, 8, 8, 8), "float32"):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1, padding=1)
            r = R.nn.relu(c1)
            gv = R.nn.conv2d(r, w2)
            R.output(gv)
        return gv


def _layouts(passes: list) -> tvm.transform.Pass:
    return tvm.transform.Sequential(passes)


def test_cpu_puts_convs_in_nhwc_and_transposes_only_at_the_edges():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 8, 8), "float32"), w1: R.Tensor((8, 4, 3, 3), "float32"),
                 w2: R.Tensor((8, 8, 1, 1), "float32")) -> R.Tensor((1, 8, 8, 8), "float32"):
            with R.dataflow():
                x_nhwc = R.permute_dims(x, axes=[0, 2, 3, 1])
                w1_hwio = R.permute_dims(w1, axes=[2, 3, 1, 0])
                c1 = R.nn.conv2d(x_nhwc, w1_hwio, padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="HWIO",
                                 out_layout="NHWC")
                r = R.nn.relu(c1)
                w2_hwio = R.permute_dims(w2, axes=[2, 3, 1, 0])
                c2 = R.nn.conv2d(r, w2_hwio, data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC")
                gv = R.permute_dims(c2, axes=[0, 3, 1, 2])
                R.output(gv)
            return gv

    assert_transforms(_layouts(cpu_pipeline.layout_passes("auto")), TwoConvs, Expected)


def test_cpu_layout_choice_leaves_the_layout_config_skip_layers_alone():
    with relay_amp.LayoutConfig(skip_layers=[1]):
        after = _layouts(cpu_pipeline.layout_passes("auto"))(TwoConvs)
    layouts = [(b.value.attrs.data_layout, b.value.attrs.kernel_layout)
               for b in layer_bindings(after, ["nn.conv2d"])]
    assert layouts == [("NHWC", "HWIO"), ("NCHW", "OIHW")]


@pytest.mark.parametrize("pipeline", [cpu_pipeline, cuda_pipeline])
def test_none_keeps_the_models_layouts(pipeline):
    assert pipeline.layout_passes(None) == []


def test_cuda_keeps_fp32_convs_in_the_models_layout_by_default():
    assert_transforms(_layouts(cuda_pipeline.layout_passes("auto")), TwoConvs, TwoConvs)


def test_a_forced_layout_overrides_the_choice():
    after = _layouts(cpu_pipeline.layout_passes("NCHW"))(TwoConvs)
    tvm.ir.assert_structural_equal(after, TwoConvs)


def test_cpu_build_in_its_own_layout_matches_the_models_layout():
    mod = models.small_cnn()
    inputs = models.example_inputs(mod)
    auto = run_executable(relay_amp.build(mod, "cpu"), inputs)[0]
    kept = run_executable(relay_amp.build(mod, "cpu", conv_layout=None), inputs)[0]
    np.testing.assert_allclose(auto, kept, rtol=1e-5, atol=1e-5 * np.abs(kept).max())  # fp32 sums reordered


def test_an_unknown_layout_is_an_option_error():
    with pytest.raises(relay_amp.OptionError, match="NCHW4c"):
        relay_amp.build(models.small_cnn(), "cpu", conv_layout="NCHW4c")
