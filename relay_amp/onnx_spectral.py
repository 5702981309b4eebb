"""ONNX's STFT (which TVM's Relax importer lacks) written as a strided conv by its windowed DFT basis before import.

`torch.stft` in a model (an audio model that computes its own spectrogram: torchaudio's Spectrogram and
MelSpectrogram, keyword spotters, voice activity detectors) exports as one STFT node, so such a model did not import.
With constant frame step, window and frame length, each frame's DFT is a dot product of the frame with a row of
cos and -sin times the window: one Conv1d over the signal, stride the frame step, whose 2 x bins output channels
hold the real and imaginary parts, reshaped and transposed into STFT's [batch, frames, bins, 2]. The conv then
runs on relay_amp's kernels like any other.
"""

import numpy as np

from ._onnx_graph import Writer, constant_values, inferred_values, rewrite_nodes
from .errors import ModelLoadError

STFT_INPUTS = ("signal", "frame_step", "window", "frame_length")


def stfts_as_convs(proto):
    """`proto` with each STFT node of a real signal and constant parameters as a Conv by its DFT basis (a copy;
    `proto` is unchanged), or ModelLoadError naming a node it cannot write so."""
    if not any(node.op_type == "STFT" for node in proto.graph.node):
        return proto
    constants, values = constant_values(proto.graph), inferred_values(proto)
    return rewrite_nodes(proto, {"STFT"}, lambda node, writer: _stft(node, writer, constants, values))


def _stft(node, writer: Writer, constants: dict, values: dict) -> None:
    label = f"STFT node {node.name or node.output[0]!r}"
    named = dict(zip(STFT_INPUTS, [*node.input, "", "", ""]))
    parameters = {name: _constant(label, name, named[name], constants) for name in STFT_INPUTS[1:]}
    window, frame_length = parameters["window"], parameters["frame_length"]
    if window is None and frame_length is None:
        raise ModelLoadError(f"{label}: neither a window nor a frame length sizes its frames")
    size = len(window) if frame_length is None else int(frame_length)
    dims, dtype = values.get(named["signal"], (None, np.dtype("float32")))
    basis = _dft_basis(np.ones(size) if window is None else window, _onesided(node))
    framed = _as_one_channel(label, writer, named["signal"], dims)
    spectrum = writer.op("Conv", framed, writer.const(basis, dtype), strides=[int(parameters["frame_step"])])
    parts = writer.op("Reshape", spectrum, writer.const([0, 2, basis.shape[0] // 2, -1]))
    writer.op("Transpose", parts, perm=[0, 3, 2, 1], out=node.output[0])


def _constant(label: str, name: str, value_name: str, constants: dict) -> "np.ndarray | None":
    """The constant value of an STFT input (None where it is left out), or ModelLoadError where it is computed."""
    if not value_name:
        if name == "frame_step":
            raise ModelLoadError(f"{label}: it has no frame step")
        return None
    if value_name not in constants:
        raise ModelLoadError(f"{label}: its {name} ({value_name!r}) is computed at run time; relay_amp imports "
                             "constant ones only")
    return constants[value_name]


def _onesided(node) -> bool:
    return all(attribute.i for attribute in node.attribute if attribute.name == "onesided")


def _dft_basis(window: np.ndarray, onesided: bool) -> np.ndarray:
    """Conv weights [2 x bins, 1, frame length]: window times cos, then window times -sin, of each bin's phase."""
    size = len(window)
    bins = size // 2 + 1 if onesided else size
    phase = 2 * np.pi * np.outer(np.arange(bins), np.arange(size)) / size
    return (np.concatenate([np.cos(phase), -np.sin(phase)]) * window)[:, None, :]


def _as_one_channel(label: str, writer: Writer, signal: str, dims: "list | None") -> str:
    """The signal as one conv channel, [batch, 1, length], from [batch, length] or [batch, length, 1]."""
    if dims is not None and len(dims) == 2:
        return writer.op("Unsqueeze", signal, writer.const([1]))
    if dims is not None and len(dims) == 3 and dims[2] == 1:
        return writer.op("Transpose", signal, perm=[0, 2, 1])
    raise ModelLoadError(f"{label}: relay_amp imports the STFT of a real signal of known rank ([batch, length] or "
                         f"[batch, length, 1]); its signal has shape {dims}")
