"""onnx_spectral: ONNX STFT nodes imported as a strided conv by their DFT basis, computing what ONNX defines."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.onnx_spectral import stfts_as_convs

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
