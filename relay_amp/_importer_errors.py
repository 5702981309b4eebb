"""A failure inside TVM's ONNX or torch.export importer as relay_amp reports it: the node that failed named, on one
line.

TVM's ONNX importer prints the failing op and its inputs to stdout (TVMScript, several lines) and raises the
converter's error, whose text quotes constants as TVMScript metadata references; either importer's BlockBuilder,
left with open blocks, warns on stderr when it is freed. `naming_failed_node` silences the print, names the node
from the importer's frame, closes the builder's blocks and raises one ModelLoadError.
"""

import contextlib
import io
import re

from .errors import ModelLoadError, one_line

IMPORTER_LOOPS = ("_construct_nodes", "_translate_fx_graph")  # TVM's ONNX and torch importers' loops over nodes
METADATA_REFERENCE = re.compile(r'metadata\["[^"]*"\]\[\d+\]')
METADATA_NOTE = re.compile(r"#\s*Metadata omitted\.[^.]*\.")  # "Use show_meta=True in script() method to show it."


@contextlib.contextmanager
def naming_failed_node():
    """Run TVM's ONNX or torch.export importer quietly; its failure while converting a node is a ModelLoadError
    naming the node."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    except Exception as err:  # the converters raise many error types
        frame = _innermost_frame(err, IMPORTER_LOOPS)
        if frame is None or "node" not in frame.f_locals:
            raise
        importer, node = frame.f_locals["self"], frame.f_locals["node"]
        _close_blocks(importer.bb if hasattr(importer, "bb") else importer.block_builder)
        op = node.op_type if hasattr(node, "op_type") else node.target  # an ONNX node's, a torch.fx node's
        raise ModelLoadError(f"node {node.name!r} ({op}): {converter_message(err)}") from err


def converter_message(err: BaseException) -> str:
    """A converter's error on one line, TVMScript's references to constants read as "(a constant)"."""
    return one_line(METADATA_REFERENCE.sub("(a constant)", METADATA_NOTE.sub("", str(err))))


def _innermost_frame(err: BaseException, names: tuple[str, ...]):
    """The innermost frame of `err`'s traceback running a function called one of `names` (a subgraph's node inside
    its If's or Loop's), or None."""
    found, trace = None, err.__traceback__
    while trace is not None:
        found = trace.tb_frame if trace.tb_frame.f_code.co_name in names else found
        trace = trace.tb_next
    return found


def _close_blocks(builder) -> None:
    """End every block an aborted import left open in its BlockBuilder, which would warn on stderr when freed."""
    with contextlib.suppress(Exception):  # TVM raises once no block is left open
        while True:
            builder._end_block()
