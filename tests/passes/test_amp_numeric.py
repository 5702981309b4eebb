"""AMP numerics: converted models compiled on llvm and run on the Relax VM, compared with fp32."""

import numpy as np
import pytest

import relay_amp
from relay_amp import frontend, models

# Relative error = max |amp - fp32| / max |fp32|. Measured on this suite's models: float16 ~1e-3
# (11-bit mantissa, fp32 accumulation), bfloat16 ~7e-3 (8-bit mantissa). Bounds leave ~3x headroom.
REL_TOL = {"float16": 5e-3, "bfloat16": 2e-2}


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got.astype("float64") - expected).max() / np.abs(expected).max())


@pytest.fixture(scope="module")
def resnet_batch():
    # 64 random 32x32 images: float16 is emulated on x86 (no avx512_fp16), so full 224x224 would take minutes
    mod = models.resnet18(batch=64, image_size=32)
    inputs = models.example_inputs(mod, seed=3)
    return mod, inputs, relay_amp.run(mod, inputs)[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_resnet18_top1_agreement_on_64_inputs(resnet_batch, dtype):
    mod, inputs, expected = resnet_batch
    got = relay_amp.run(relay_amp.to_mixed_precision(mod, dtype), inputs)[0]
    agreement = (got.argmax(1) == expected.argmax(1)).mean()
    assert agreement >= 0.95, f"top-1 agreement {agreement:.3f}"
    assert relative_error(got, expected) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bert_encoder_relative_error(dtype):
    mod = models.bert_encoder(seq_len=32)
    inputs = models.example_inputs(mod)
    expected = relay_amp.run(mod, inputs)[0]
    converted = relay_amp.to_mixed_precision(mod, dtype)
    assert relay_amp.list_layers(converted)[0].input_dtypes == (dtype, dtype)
    assert relative_error(relay_amp.run(converted, inputs)[0], expected) < REL_TOL[dtype]


def test_onnx_model_converts_with_every_op_listed():
    from test_frontend import conv_gemm_onnx

    mod = frontend.from_onnx(conv_gemm_onnx())
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype("float32")
    converted = relay_amp.to_mixed_precision(mod, "float16", missing_op_mode="error")
    assert relative_error(relay_amp.run(converted, [x])[0], relay_amp.run(mod, [x])[0]) < REL_TOL["float16"]


def test_torch_model_converts_with_every_op_listed():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 3 * 3, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 4), torch.nn.Softmax(dim=-1),
    ).eval()
    x = torch.randn(2, 3, 8, 8)
    mod = frontend.from_torch(net, [x])
    converted = relay_amp.to_mixed_precision(mod, "bfloat16", missing_op_mode="error")
    got = relay_amp.run(converted, [x.numpy()])[0]
    assert relative_error(got, relay_amp.run(mod, [x.numpy()])[0]) < REL_TOL["bfloat16"]
