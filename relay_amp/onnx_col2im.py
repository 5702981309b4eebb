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

from typing import NamedTuple

import numpy as np

from ._onnx_graph import (Writer, constant_values, inferred_values, known_dims, named_inputs, node_attributes,
                          node_label, rewrite_nodes)
from .errors import ModelLoadError

COL2IM_INPUTS = ("input", "image_shape", "block_shape")


class Fold(NamedTuple):
    """A Col2Im's geometry, one entry per spatial axis: the image's sizes, the block's, the strides and dilations,
    the pads (all begins, then all ends) and how many blocks fit along each axis."""

    image: list
    block: list
    strides: list
    dilations: list
    pads: list
    counts: list

    @property
    def begins(self) -> list:
        """The pads before each axis."""
        return self.pads[:len(self.image)]

    @property
    def ends(self) -> list:
        """The pads after each axis."""
        return self.pads[len(self.image):]


def col2ims_as_onnx(proto):
    """`proto` with each Col2Im node of constant image and block shapes written as moves or a ConvTranspose (a
    copy; `proto` is unchanged), or ModelLoadError naming a node it cannot write so."""
    if not any(node.op_type == "Col2Im" for node in proto.graph.node):
        return proto
    constants, values = constant_values(proto.graph), inferred_values(proto)
    return rewrite_nodes(proto, {"Col2Im"}, lambda node, writer: _col2im(node, writer, constants, values))


def _col2im(node, writer: Writer, constants: dict, values: dict) -> None:
    named = named_inputs(node, COL2IM_INPUTS)
    fold = _fold(node, *(_shape(node_label(node), name, named[name], constants) for name in COL2IM_INPUTS[1:]))
    if fold.strides == fold.block and fold.dilations == [1] * len(fold.image):
        _as_moves(writer, named["input"], node.output[0], fold)
    else:
        _as_conv_transpose(writer, node, _channels(node_label(node), values, named["input"], fold.block), fold, values)


def _fold(node, image: list, block: list) -> Fold:
    label, attributes, spatial = node_label(node), node_attributes(node), len(image)
    if len(block) != spatial:
        raise ModelLoadError(f"{label}: image_shape {image} and block_shape {block} differ in rank")
    strides = list(attributes.get("strides", [1] * spatial))
    dilations = list(attributes.get("dilations", [1] * spatial))
    pads = list(attributes.get("pads", [0] * 2 * spatial))
    counts = [_block_count(label, *sizes) for sizes in zip(image, block, strides, dilations, pads, pads[spatial:])]
    return Fold(image, block, strides, dilations, pads, counts)


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
    dims, _ = known_dims(label, values, name, ranks=(3,))
    positions = int(np.prod(block))
    if dims[1] % positions:
        raise ModelLoadError(f"{label}: its input's {dims[1]} values a block are not a whole number of channels "
                             f"of {positions} positions")
    return dims[1] // positions


def _as_moves(writer: Writer, blocks: str, output: str, fold: Fold) -> None:
    """Tiling blocks moved into place: the image they cover, then cut to the padded image's window."""
    spatial = len(fold.image)
    split = writer.op("Reshape", blocks, writer.const([0, -1, *fold.block, *fold.counts]))
    interleaved = [axis for pair in zip(range(2 + spatial, 2 + 2 * spatial), range(2, 2 + spatial)) for axis in pair]
    moved = writer.op("Transpose", split, perm=[0, 1, *interleaved])
    covered = [count * size for count, size in zip(fold.counts, fold.block)]
    tiled = writer.op("Reshape", moved, writer.const([0, 0, *covered]))
    ends = [min(begin + size, reach) for begin, size, reach in zip(fold.begins, fold.image, covered)]
    missing = [begin + size - end for begin, size, end in zip(fold.begins, fold.image, ends)]
    if not any(missing):
        _window(writer, tiled, fold.begins, ends, covered, out=output)
        return
    window = _window(writer, tiled, fold.begins, ends, covered)
    writer.op("Pad", window, writer.const([0, 0] + [0] * spatial + [0, 0] + missing), out=output)


def _window(writer: Writer, tiled: str, begins: list, ends: list, covered: list, out: "str | None" = None) -> str:
    """`tiled` cut to [begins, ends) on its spatial axes (itself, renamed by an Identity, where that is all)."""
    if begins == [0] * len(begins) and ends == covered:
        return writer.op("Identity", tiled, out=out)
    axes = list(range(2, 2 + len(begins)))
    return writer.op("Slice", tiled, writer.const(begins), writer.const(ends), writer.const(axes), out=out)


def _as_conv_transpose(writer: Writer, node, channels: int, fold: Fold, values: dict) -> None:
    """Overlapping or dilated blocks added into the image by a ConvTranspose, one group per channel."""
    positions = int(np.prod(fold.block))
    laid_out = writer.op("Reshape", node.input[0], writer.const([0, 0, *fold.counts]))
    picks = np.tile(np.eye(positions).reshape(positions, 1, *fold.block), (channels, 1, *[1] * len(fold.block)))
    _, dtype = values.get(node.input[0], (None, None))
    reached = [stride * (count - 1) + dilation * (size - 1) + 1
               for stride, count, dilation, size in zip(fold.strides, fold.counts, fold.dilations, fold.block)]
    beyond = [size + begin + end - reach
              for size, begin, end, reach in zip(fold.image, fold.begins, fold.ends, reached)]
    writer.op("ConvTranspose", laid_out, writer.const(picks, dtype or "float32"), out=node.output[0],
              group=channels, strides=fold.strides, dilations=fold.dilations, pads=fold.pads,
              output_padding=beyond, kernel_shape=fold.block)
