"""ONNX's Col2Im (which TVM's Relax importer lacks) written before import as the moves or the transposed conv it
computes.

`torch.nn.functional.fold` (`nn.Fold`: patches put back into an image) exports as one Col2Im node through the
dynamo exporter (the TorchScript exporter fails on it), so models that fold patches did not import: Hugging Face's
MobileViTV2 folds every transformer stage's patches back into its feature map. Col2Im's input holds, for each of
the L blocks, C x prod(block) values (channel-major, the block's positions row-major); each is added to the image
at its block's position.
- Blocks that tile the image (strides equal to the block, no dilation: MobileViT's patches) are moves: a Reshape to
  [N, C, *block, *blocks], a Transpose interleaving each block axis with its count, a Reshape to the covered
  image, and a Slice and Pad for the pads and any rows no block reaches.
- Any other Col2Im (overlapping or dilated blocks) is a ConvTranspose of the blocks laid out as an image, one
  group per channel, whose weight picks each block position's value: it adds the overlapping values as Col2Im
  does. `output_padding` gives the rows past the last whole block.
"""

import numpy as np

from ._onnx_graph import (Writer, constant_values, inferred_values, named_inputs, node_attributes, node_label,
                          rewrite_nodes)
from .errors import ModelLoadError

COL2IM_INPUTS = ("input", "image_shape", "block_shape")


def col2ims_as_onnx(proto):
    """`proto` with each Col2Im node of constant image and block shapes written as moves or a ConvTranspose (a
    copy; `proto` is unchanged), or ModelLoadError naming a node it cannot write so."""
    if not any(node.op_type == "Col2Im" for node in proto.graph.node):
        return proto
    constants, values = constant_values(proto.graph), inferred_values(proto)
    return rewrite_nodes(proto, {"Col2Im"}, lambda node, writer: _col2im(node, writer, constants, values))


def _col2im(node, writer: Writer, constants: dict, values: dict) -> None:
    label = node_label(node)
    named = named_inputs(node, COL2IM_INPUTS)
    image, block = (_shape(label, name, named[name], constants) for name in COL2IM_INPUTS[1:])
    if len(image) != len(block):
        raise ModelLoadError(f"{label}: image_shape {image} and block_shape {block} differ in rank")
    attributes = node_attributes(node)
    spatial = len(image)
    strides = list(attributes.get("strides", [1] * spatial))
    dilations = list(attributes.get("dilations", [1] * spatial))
    pads = list(attributes.get("pads", [0] * 2 * spatial))
    counts = [_block_count(label, *sizes) for sizes in zip(image, block, strides, dilations, pads, pads[spatial:])]
    if strides == block and dilations == [1] * spatial:
        _as_moves(writer, named["input"], node.output[0], image, block, counts, pads)
    else:
        channels = _channels(label, values, named["input"], block)
        _as_conv_transpose(writer, node, channels, image, block, counts, strides, dilations, pads, values)


def _shape(label: str, name: str, value_name: str, constants: dict) -> list[int]:
    if not value_name or value_name not in constants:
        raise ModelLoadError(f"{label}: its {name} must be a constant (it is computed in the graph)")
    return [int(size) for size in np.asarray(constants[value_name]).reshape(-1)]


def _block_count(label: str, size: int, block: int, stride: int, dilation: int, begin: int, end: int) -> int:
    """How many blocks fit along one image axis of `size` padded by `begin` and `end`."""
    span = dilation * (block - 1) + 1
    if size + begin + end < span:
        raise ModelLoadError(f"{label}: a block spanning {span} does not fit in an image axis of {size} "
                             f"padded by {begin} and {end}")
    return (size + begin + end - span) // stride + 1


def _channels(label: str, values: dict, name: str, block: list[int]) -> int:
    dims, _ = values.get(name, (None, None))
    positions = int(np.prod(block))
    if dims is None or len(dims) != 3 or dims[1] is None or dims[1] % positions:
        raise ModelLoadError(f"{label}: its input needs a known [N, C x {positions}, L] shape, not {dims}")
    return dims[1] // positions


def _as_moves(writer: Writer, blocks: str, output: str, image: list, block: list, counts: list, pads: list) -> None:
    """Tiling blocks moved into place: the image they cover, then cut to the padded image's window."""
    spatial = len(image)
    split = writer.op("Reshape", blocks, writer.const([0, -1, *block, *counts]))
    interleaved = [axis for pair in zip(range(2 + spatial, 2 + 2 * spatial), range(2, 2 + spatial)) for axis in pair]
    moved = writer.op("Transpose", split, perm=[0, 1, *interleaved])
    covered = [count * size for count, size in zip(counts, block)]
    tiled = writer.op("Reshape", moved, writer.const([0, 0, *covered]))
    begins, sizes = pads[:spatial], image
    ends = [min(begin + size, reach) for begin, size, reach in zip(begins, sizes, covered)]
    missing = [begin + size - end for begin, size, end in zip(begins, sizes, ends)]
    if not any(missing):
        _window(writer, tiled, begins, ends, covered, out=output)
        return
    window = _window(writer, tiled, begins, ends, covered)
    writer.op("Pad", window, writer.const([0, 0] + [0] * spatial + [0, 0] + missing), out=output)


def _window(writer: Writer, tiled: str, begins: list, ends: list, covered: list, out: "str | None" = None) -> str:
    """`tiled` cut to [begins, ends) on its spatial axes (itself, renamed by an Identity, where that is all)."""
    if begins == [0] * len(begins) and ends == covered:
        return writer.op("Identity", tiled, out=out)
    axes = list(range(2, 2 + len(begins)))
    return writer.op("Slice", tiled, writer.const(begins), writer.const(ends), writer.const(axes), out=out)


def _as_conv_transpose(writer: Writer, node, channels: int, image: list, block: list, counts: list, strides: list,
                       dilations: list, pads: list, values: dict) -> None:
    """Overlapping or dilated blocks added into the image by a ConvTranspose, one group per channel."""
    spatial, positions = len(image), int(np.prod(block))
    laid_out = writer.op("Reshape", node.input[0], writer.const([0, 0, *counts]))
    picks = np.tile(np.eye(positions).reshape(positions, 1, *block), (channels, 1, *[1] * spatial))
    _, dtype = values.get(node.input[0], (None, np.dtype("float32")))
    reached = [stride * (count - 1) + dilation * (size - 1) + 1
               for stride, count, dilation, size in zip(strides, counts, dilations, block)]
    beyond = [size + begin + end - reach for size, begin, end, reach in zip(image, pads, pads[spatial:], reached)]
    writer.op("ConvTranspose", laid_out, writer.const(picks, dtype or "float32"), out=node.output[0],
              group=channels, strides=strides, dilations=dilations, pads=pads, output_padding=beyond,
              kernel_shape=block)
