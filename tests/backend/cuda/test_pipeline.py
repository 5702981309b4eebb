"""pipeline: the CUDA build's choice of convolution layout (TensorCoreLayout), checked without a GPU."""

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import models, targets
from relay_amp.backend.cuda.pipeline import TensorCoreLayout, prepare_passes
from relay_amp.compile.build import build
from relay_amp.passes.layout import convert_layout
from relay_amp.runtime import run

from pass_checks import assert_transforms

TOLERANCE = 1e-2  # float16 sums of 144 products added in another order (0.3% seen)


@I.ir_module
class Float16Conv:
    @R.function
    def main(x: R.Tensor((1, 16, 8, 8), "float16"),
             w: R.Tensor((32, 16, 3, 3), "float16")) -> R.Tensor((1, 32, 8, 8), "float16"):
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=[1, 1, 1, 1], out_dtype="float16")
            z = R.nn.relu(y)
            R.output(z)
        return z


@I.ir_module
class Float16ConvNHWC:
    @R.function
    def main(x: R.Tensor((1, 16, 8, 8), "float16"),
             w: R.Tensor((32, 16, 3, 3), "float16")) -> R.Tensor((1, 32, 8, 8), "float16"):
        with R.dataflow():
            lv = R.permute_dims(x, axes=[0, 2, 3, 1])
            lv1 = R.permute_dims(w, axes=[0, 2, 3, 1])
            y = R.nn.conv2d(lv, lv1, padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="OHWI",
                            out_layout="NHWC", out_dtype="float16")
            lv2 = R.nn.relu(y)
            z = R.permute_dims(lv2, axes=[0, 3, 1, 2])
            R.output(z)
        return z


@I.ir_module
class Float32Conv:
    @R.function
    def main(x: R.Tensor((1, 16, 8, 8), "float32"),
             w: R.Tensor((32, 16, 3, 3), "float32")) -> R.Tensor((1, 32, 8, 8), "float32"):
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
            R.output(y)
        return y


def test_a_float16_nchw_conv_goes_to_nhwc_transposed_at_the_edges():
    assert_transforms(TensorCoreLayout(), Float16Conv, Float16ConvNHWC)


def test_the_nhwc_conv_computes_what_the_nchw_one_does():
    rng = np.random.default_rng(0)
    inputs = [rng.normal(size=(1, 16, 8, 8)).astype("float16"), rng.normal(size=(32, 16, 3, 3)).astype("float16")]
    expected = run(Float16Conv, inputs)[0].astype("float32")
    got = run(TensorCoreLayout()(Float16Conv), inputs)[0].astype("float32")
    assert np.max(np.abs(got - expected)) <= TOLERANCE * np.max(np.abs(expected))


def test_fp32_convs_and_convs_laid_out_on_purpose_keep_their_layout():
    tvm.ir.assert_structural_equal(TensorCoreLayout()(Float32Conv), Float32Conv)  # no tensor core takes fp32
    hwnc = convert_layout(relay_amp.to_mixed_precision(models.resnet18_conv(batch=16, channels=64, image_size=14),
                                                       "float16"), {"relax.nn.conv2d": ["HWNC"]})
    tvm.ir.assert_structural_equal(TensorCoreLayout()(hwnc), hwnc)  # the seed workflow's HWNC stays


@pytest.mark.parametrize("conv_layout, expected", [("auto", (1, 14, 14, 32)), (None, (1, 32, 14, 14))])
def test_a_cuda_build_feeds_calibrated_int8_convs_images_laid_out_by_conv_layout(conv_layout, expected):
    mod = models.resnet18_conv(batch=1, channels=32, image_size=14)
    calibration = [np.random.default_rng(1).normal(size=(1, 32, 14, 14)).astype("float32")]
    quantized = relay_amp.quantize(mod, calibration, activation_dtype="int8")
    target = targets.get_target("cuda-tensorcore")
    with target:
        prepared = prepare_passes(target, conv_layout=conv_layout)(quantized)
    convs = [func for gvar, func in prepared.functions_items() if "conv2d" in gvar.name_hint]
    assert [tuple(map(int, func.params[0].ty.shape)) for func in convs] == [expected]


def test_a_cuda_build_replays_its_kernels_as_a_cuda_graph():
    executable = build(relay_amp.to_mixed_precision(models.bert_encoder(), "float16"), "cuda-tensorcore")
    assert "vm.builtin.cuda_graph.run_or_capture" in executable.as_text()
