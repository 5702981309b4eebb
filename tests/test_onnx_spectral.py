"""onnx_spectral: ONNX STFT and DFT nodes imported as a strided conv and a matmul by their DFT basis, computing
what ONNX defines."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.onnx_spectral import dfts_as_matmuls, stfts_as_convs

RNG = np.random.default_rng(0)
LENGTH, STEP, FRAME = 400, 40, 64


def _stft_model(signal_shape, window: bool = True, frame_length: bool = False, onesided: int = 1,
                window_input: bool = False):
    """One STFT node over a float signal of `signal_shape`: a Hann window as a constant (or a graph input), and
    the frame length as a constant where asked."""
    initializers = [numpy_helper.from_array(np.array(STEP, "int64"), "step")]
    inputs = [helper.make_tensor_value_info("signal", TensorProto.FLOAT, signal_shape)]
    names = ["signal", "step", "", ""]
    if window_input:
        inputs.append(helper.make_tensor_value_info("window", TensorProto.FLOAT, [FRAME]))
        names[2] = "window"
    elif window:
        initializers.append(numpy_helper.from_array(np.hanning(FRAME).astype("float32"), "window"))
        names[2] = "window"
    if frame_length:
        initializers.append(numpy_helper.from_array(np.array(FRAME, "int64"), "frame_length"))
        names[3] = "frame_length"
    while not names[-1]:  # optional inputs left out at the end; "" holds the place of one left out between
        names.pop()
    node = helper.make_node("STFT", names, ["y"], "stft", onesided=onesided)
    bins = FRAME // 2 + 1 if onesided else FRAME
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [signal_shape[0], 1 + (LENGTH - FRAME) // STEP,
                                                                     bins, 2])
    graph = helper.make_graph([node], "stft", inputs, [output], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("signal_shape", [[2, LENGTH], [2, LENGTH, 1]])
@pytest.mark.parametrize("window, frame_length", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("onesided", [1, 0])
def test_stft_imports_as_a_conv_computing_what_onnx_defines(signal_shape, window, frame_length, onesided):
    model = _stft_model(signal_shape, window, frame_length, onesided)
    signal = RNG.standard_normal(signal_shape).astype("float32")
    reference = _stft_model([2, LENGTH, 1], window, frame_length, onesided)  # the evaluator's signal has 3 axes
    expected = ReferenceEvaluator(reference).run(None, {"signal": signal.reshape(2, LENGTH, 1)})[0]
    rewritten = stfts_as_convs(model)
    assert [node.op_type for node in rewritten.graph.node][1] == "Conv"
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), [signal])[0]
    assert got.shape == expected.shape == (2, 1 + (LENGTH - FRAME) // STEP, FRAME // 2 + 1 if onesided else FRAME, 2)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("build, message", [
    (lambda: _stft_model([2, LENGTH], window_input=True), r"its window \('window'\) is computed at run time"),
    (lambda: _stft_model([2, LENGTH, 2]), r"relay_amp imports the STFT of a real signal .*; its signal has shape \[2, 400, 2\]"),
    (lambda: _stft_model([2, LENGTH], window=False), "neither a window nor a frame length sizes its frames"),
])
def test_stfts_it_cannot_write_as_a_conv_are_refused_naming_the_node(build, message):
    with pytest.raises(ModelLoadError, match=f"STFT node 'stft': {message}"):
        relay_amp.frontend.from_onnx(build())


def test_a_spectrogram_exported_from_torch_stft_matches_pytorch(tmp_path):
    """A magnitude spectrogram as torchaudio computes one (reflect-padded frames, a Hann window shorter than the
    DFT, complex output), through the dynamo exporter: STFT, then ReduceL2 over the real and imaginary parts."""
    torch = pytest.importorskip("torch")

    class Spectrogram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("window", torch.hann_window(100))

        def forward(self, wave):
            spectrum = torch.stft(wave, n_fft=128, hop_length=32, win_length=100, window=self.window, center=True,
                                  return_complex=True)
            return torch.log(spectrum.abs() + 1e-6)

    wave = torch.randn(1, 2000)
    path = tmp_path / "spectrogram.onnx"
    torch.onnx.export(Spectrogram(), (wave,), str(path), dynamo=True, opset_version=18)
    got = relay_amp.run(relay_amp.frontend.from_onnx(path), [wave.numpy()])[0]
    np.testing.assert_allclose(got, Spectrogram()(wave).numpy(), rtol=1e-4, atol=1e-4)


def _dft_model(shape, opset: int = 17, length: int | None = None, axis: int | None = None, **attributes):
    """One DFT node over a float input of `shape` (last axis 1: real, 2: complex); the axis an attribute before
    opset 20, an input from it; the DFT length a constant where given."""
    initializers, names = [], ["x", "", ""]
    if length is not None:
        initializers.append(numpy_helper.from_array(np.array(length, "int64"), "length"))
        names[1] = "length"
    if axis is not None and opset >= 20:
        initializers.append(numpy_helper.from_array(np.array(axis, "int64"), "axis"))
        names[2] = "axis"
    elif axis is not None:
        attributes["axis"] = axis
    while not names[-1]:
        names.pop()
    node = helper.make_node("DFT", names, ["y"], "dft", **attributes)
    graph = helper.make_graph([node], "dft", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    (output,) = ReferenceEvaluator(model).run(None, {"x": np.zeros(shape, "float32")})  # its shape, for the checker
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, output.shape))
    return model


@pytest.mark.parametrize("shape, opset, length, axis, attributes", [
    ([2, 12, 1], 17, None, None, {}),  # real, axis 1 (opset 17's default)
    ([2, 12, 1], 17, None, None, {"onesided": 1}),
    ([2, 3, 12, 2], 17, None, 2, {}),  # complex
    ([2, 3, 12, 2], 17, None, 2, {"inverse": 1}),
    ([2, 12, 1], 17, 16, None, {"onesided": 1}),  # zero-padded to 16 points
    ([2, 12, 2], 17, 8, None, {}),  # truncated to 8
    ([2, 12, 5, 1], 20, None, 1, {}),  # the axis an input
    ([2, 5, 12, 2], 20, None, None, {"inverse": 1}),  # opset 20's default axis: -2
    ([2, 7, 2], 17, 12, None, {"inverse": 1, "onesided": 1}),  # a one-sided spectrum back to 12 real points
])
def test_dft_imports_as_a_matmul_computing_what_onnx_defines(shape, opset, length, axis, attributes):
    model = _dft_model(shape, opset, length, axis, **attributes)
    x = RNG.standard_normal(shape).astype("float32")
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert "MatMul" in [node.op_type for node in dfts_as_matmuls(model).graph.node]
    got = relay_amp.run(relay_amp.frontend.from_onnx(model), [x])[0]
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_a_dft_of_a_computed_length_is_refused_naming_the_node():
    model = _dft_model([2, 12, 1], length=16)
    model.graph.initializer.pop()
    model.graph.input.append(helper.make_tensor_value_info("length", TensorProto.INT64, []))
    with pytest.raises(ModelLoadError, match=r"DFT node 'dft': its dft_length \('length'\) is computed at run time"):
        relay_amp.frontend.from_onnx(model)


def test_torch_fft_functions_through_the_dynamo_exporter_match_pytorch(tmp_path):
    """rfft, irfft and fft2 (FNet's token mixing) export as DFT nodes; the TorchScript exporter has none of them."""
    torch = pytest.importorskip("torch")

    class Spectral(torch.nn.Module):
        def forward(self, x):
            smoothed = torch.fft.irfft(torch.fft.rfft(x, dim=-1) * torch.linspace(1, 0, 17), n=32, dim=-1)
            return smoothed + torch.fft.fft2(x.to(torch.complex64)).real

    x = torch.randn(2, 8, 32)
    path = tmp_path / "spectral.onnx"
    torch.onnx.export(Spectral(), (x,), str(path), dynamo=True, opset_version=18)
    got = relay_amp.run(relay_amp.frontend.from_onnx(path), [x.numpy()])[0]
    expected = Spectral()(x).numpy()
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
