"""ONNX's STFT and DFT (which TVM's Relax importer lacks) written as products with their DFT basis before import.

`torch.stft` in a model (an audio model that computes its own spectrogram: torchaudio's Spectrogram and
MelSpectrogram, keyword spotters, voice activity detectors) exports as one STFT node, and `torch.fft`'s functions
(rfft, fft2, irfft: FNet's token mixing, spectral convolutions) as DFT nodes through the dynamo exporter, so such
models did not import. A DFT of known length is a product with a constant matrix of cos and sin terms:
- STFT (constant frame step, window and frame length): one Conv1d over the signal, stride the frame step, whose
  2 x bins output channels hold each frame's real and imaginary parts times the window, reshaped and transposed
  into STFT's [batch, frames, bins, 2];
- DFT: the transformed axis and the real/imaginary axis moved last and joined, one MatMul by the basis (real
  input: N x 2 bins; complex: 2N x 2 bins), then split and moved back. `dft_length` pads or truncates through the
  basis; `inverse` takes the conjugate basis over the length; `onesided` keeps the first length // 2 + 1 bins,
  and with `inverse` takes them back to a real signal (irfft).
The products then run on relay_amp's kernels like any other conv or matmul.
"""

import numpy as np

from ._onnx_graph import (Writer, constant_values, default_opset, inferred_values, node_attributes, node_label,
                          rewrite_nodes)
from .errors import ModelLoadError

STFT_INPUTS = ("signal", "frame_step", "window", "frame_length")
DFT_AXIS_AS_INPUT = 20  # the opset from which DFT takes its axis as an input (default -2), not an attribute (1)


def stfts_as_convs(proto):
    """`proto` with each STFT node of a real signal and constant parameters as a Conv by its DFT basis (a copy;
    `proto` is unchanged), or ModelLoadError naming a node it cannot write so."""
    if not any(node.op_type == "STFT" for node in proto.graph.node):
        return proto
    constants, values = constant_values(proto.graph), inferred_values(proto)
    return rewrite_nodes(proto, {"STFT"}, lambda node, writer: _stft(node, writer, constants, values))


def _stft(node, writer: Writer, constants: dict, values: dict) -> None:
    label = node_label(node)
    named = dict(zip(STFT_INPUTS, [*node.input, "", "", ""]))
    parameters = {name: _constant(label, name, named[name], constants) for name in STFT_INPUTS[1:]}
    window, frame_length = parameters["window"], parameters["frame_length"]
    if window is None and frame_length is None:
        raise ModelLoadError(f"{label}: neither a window nor a frame length sizes its frames")
    size = len(window) if frame_length is None else int(frame_length)
    dims, dtype = values.get(named["signal"], (None, np.dtype("float32")))
    bins = size // 2 + 1 if node_attributes(node).get("onesided", 1) else size
    basis = dft_basis(size, size, bins, parts=1, inverse=False).T * (np.ones(size) if window is None else window)
    framed = _as_one_channel(label, writer, named["signal"], dims)
    spectrum = writer.op("Conv", framed, writer.const(basis[:, None, :], dtype),
                         strides=[int(parameters["frame_step"])])
    parts = writer.op("Reshape", spectrum, writer.const([0, 2, bins, -1]))
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


def dft_basis(size: int, length: int, bins: int, parts: int, inverse: bool) -> np.ndarray:
    """The matrix [parts x size, 2 x bins] taking a signal's real parts (then, with parts 2, its imaginary parts) to
    its DFT's real then imaginary parts over `length` points: samples past `length` weigh 0, missing ones are 0;
    the inverse conjugates and divides by `length`."""
    sample = np.arange(size)[:, None]
    phase = 2 * np.pi * sample * np.arange(bins)[None, :] / length
    sign, scale = (1.0, 1.0 / length) if inverse else (-1.0, 1.0)
    cos, sin = np.cos(phase) * (sample < length), sign * np.sin(phase) * (sample < length)
    rows = [np.concatenate([cos, sin], axis=1)]  # from real parts: Re += x cos, Im += sign x sin
    if parts == 2:
        rows.append(np.concatenate([-sin, cos], axis=1))  # from imaginary parts: Re -= sign y sin, Im += y cos
    return scale * np.concatenate(rows)


def real_inverse_basis(size: int, length: int) -> np.ndarray:
    """The matrix [2 x size, length] taking the first `size` bins of a one-sided spectrum (real parts, then
    imaginary parts) to the real signal of `length` points whose spectrum it is (the inverse of a one-sided DFT:
    bins between 0 and length / 2 stand for their conjugate mirror too, so they count twice)."""
    bin_index = np.arange(size)[:, None]
    phase = 2 * np.pi * bin_index * np.arange(length)[None, :] / length
    twice = np.where((bin_index == 0) | (2 * bin_index == length), 1.0, 2.0) * (bin_index <= length // 2)
    return np.concatenate([twice * np.cos(phase), -twice * np.sin(phase)]) / length


def _as_one_channel(label: str, writer: Writer, signal: str, dims: "list | None") -> str:
    """The signal as one conv channel, [batch, 1, length], from [batch, length] or [batch, length, 1]."""
    if dims is not None and len(dims) == 2:
        return writer.op("Unsqueeze", signal, writer.const([1]))
    if dims is not None and len(dims) == 3 and dims[2] == 1:
        return writer.op("Transpose", signal, perm=[0, 2, 1])
    raise ModelLoadError(f"{label}: relay_amp imports the STFT of a real signal of known rank ([batch, length] or "
                         f"[batch, length, 1]); its signal has shape {dims}")


def dfts_as_matmuls(proto):
    """`proto` with each DFT node of known shape and constant length as a MatMul by its basis (a copy; `proto` is
    unchanged), or ModelLoadError naming a node it cannot write so."""
    if not any(node.op_type == "DFT" for node in proto.graph.node):
        return proto
    constants, values = constant_values(proto.graph), inferred_values(proto)
    opset = default_opset(proto)
    return rewrite_nodes(proto, {"DFT"}, lambda node, writer: _dft(node, writer, constants, values, opset))


def _dft(node, writer: Writer, constants: dict, values: dict, opset: int) -> None:
    label = node_label(node)
    attributes, inputs = node_attributes(node), [*node.input, "", ""]
    dims, dtype = values.get(inputs[0], (None, None))
    if dims is None or None in dims or dims[-1] not in (1, 2):
        raise ModelLoadError(f"{label}: relay_amp imports the DFT of a tensor of known shape ending in 1 (real) or 2 "
                             f"(complex); its input has shape {dims}")
    axis = _dft_axis(label, attributes, inputs[2], constants, opset) % len(dims)
    size = dims[axis]
    length = size if not inputs[1] else int(_constant(label, "dft_length", inputs[1], constants))
    onesided, inverse = bool(attributes.get("onesided", 0)), bool(attributes.get("inverse", 0))
    if onesided and inverse:  # a one-sided spectrum back to a real signal (irfft)
        if dims[-1] != 2:
            raise ModelLoadError(f"{label}: the inverse of a one-sided spectrum needs complex input (shape {dims})")
        basis, parts, points = real_inverse_basis(size, length), 1, length
    else:
        points = length // 2 + 1 if onesided else length
        basis, parts = dft_basis(size, length, points, dims[-1], inverse), 2
    perm = [a for a in range(len(dims)) if a not in (axis, len(dims) - 1)] + [len(dims) - 1, axis]
    kept = [0] * (len(dims) - 2)  # Reshape's 0: the axis as it is
    joined = writer.op("Reshape", writer.op("Transpose", inputs[0], perm=perm), writer.const([*kept, -1]))
    product = writer.op("MatMul", joined, writer.const(basis, dtype))
    split = writer.op("Reshape", product, writer.const([*kept, parts, points]))
    writer.op("Transpose", split, perm=[int(a) for a in np.argsort(perm)], out=node.output[0])


def _dft_axis(label: str, attributes: dict, axis_input: str, constants: dict, opset: int) -> int:
    """The axis a DFT transforms: an attribute (default 1) before opset 20, then a constant input (default -2)."""
    if opset < DFT_AXIS_AS_INPUT:
        return int(attributes.get("axis", 1))
    return -2 if not axis_input else int(_constant(label, "axis", axis_input, constants))
