"""Reading and rewriting an ONNX graph before import: its constant values, the shapes ONNX's shape inference
gives, and nodes replaced by the nodes and constants a rewrite writes."""

import contextlib
import contextvars
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

DEFAULT_DOMAINS = ("", "ai.onnx")  # the names of ONNX's own operator set
SKELETON_VALUES = 4096  # initializers larger than this take part in shape inference by their type alone
COMPUTED_LOCATION = "relay_amp:computed"  # the external-data location of a constant computed when it is read


@dataclass
class _Import:
    """An import: the directory of the model's file ("" for a model given in memory), whether the rewrites change
    the model in place (the importer's own, read from that file), and the constants rewrites compute when read."""
    model_dir: str
    in_place: bool
    computed: dict = field(default_factory=dict)  # name -> a function computing the constant's value
    held: dict = field(default_factory=dict)  # name -> a function giving the constant in a held form (packed int4)


_IMPORT = contextvars.ContextVar("relay_amp_onnx_import", default=None)


@contextlib.contextmanager
def importing_file(model_dir: str):
    """Within it, the rewrites change the model they are given instead of a copy (an importer's own model, read from
    a file in `model_dir`: a model of gigabytes is not copied once per rewrite that applies), `tensor_value` reads
    the weights the file keeps in external data from `model_dir`, and the large constants a rewrite derives are
    computed when read (Writer.computed_const)."""
    with _importing(_Import(model_dir, in_place=True)):
        yield


@contextlib.contextmanager
def importing_model():
    """importing_file() for a model given in memory: the rewrites copy it, and derived constants are computed when
    read."""
    with _importing(_Import("", in_place=False)):
        yield


@contextlib.contextmanager
def _importing(session: _Import):
    token = _IMPORT.set(session)
    try:
        yield
    finally:
        _IMPORT.reset(token)


def writable(proto):
    """The model a rewrite of `proto` changes: `proto` itself within importing_file(), else a copy."""
    session = _IMPORT.get()
    if session is not None and session.in_place:
        return proto
    rewritten = type(proto)()
    rewritten.CopyFrom(proto)
    return rewritten


def tensor_value(tensor) -> np.ndarray:
    """A TensorProto's value as a numpy array: a computed constant's computed now, external data (a file's weights
    left on disk) read from the directory importing_file() names."""
    from onnx import numpy_helper

    session = _IMPORT.get()
    if session is not None and tensor.name in session.computed:
        return session.computed[tensor.name]()
    return numpy_helper.to_array(tensor, base_dir=session.model_dir if session else "")


def held_value(tensor):
    """The held form (a relay_amp.packed_int4.PackedWeight) a rewrite gave the constant `tensor` within an import
    (Writer.computed_const), else None."""
    session = _IMPORT.get()
    hold = session.held.get(tensor.name) if session is not None else None
    return None if hold is None else hold()


def node_label(node) -> str:
    """How errors name a node: its op type and its name (its first output's where it has none)."""
    return f"{node.op_type} node {node.name or node.output[0]!r}"


def named_inputs(node, names) -> dict[str, str]:
    """A node's inputs by their names in its op's signature, "" for those it leaves out."""
    return dict(zip(names, [*node.input, *[""] * len(names)]))


def known_dims(label: str, values: dict, name: str, ranks=(3, 4)) -> tuple[list[int], object]:
    """The dims and numpy dtype of `name` from `values` (inferred_values'), or ModelLoadError where its shape is
    unknown or of another rank than `ranks`."""
    from .errors import ModelLoadError

    dims, dtype = values.get(name, (None, None))
    if dims is None or None in dims or len(dims) not in ranks:
        raise ModelLoadError(f"{label}: {name!r} needs a known shape of rank {' or '.join(map(str, ranks))}, "
                             f"not {dims} (size the inputs' symbolic dims at import)")
    return dims, dtype


def value_info(name: str, dims, dtype):
    """A value info of `name` with `dims` (None where unknown) and numpy `dtype`: an output shape the rewrites
    give shape inference for an op it does not know."""
    import onnx

    return onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims)


def attribute_text(value) -> str:
    """A string attribute's value as text (ONNX holds strings as bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def node_attributes(node) -> dict:
    """A node's attributes by name, as Python values."""
    import onnx

    return {attribute.name: onnx.helper.get_attribute_value(attribute) for attribute in node.attribute}


def constant_values(graph) -> "Constants":
    """The graph's initializers and Constant nodes' tensor values, by name (each converted when first read: an LLM's
    weights are not copied to look one up)."""
    return Constants(graph)


class Constants(Mapping):
    """The tensors of a graph's initializers and Constant nodes by name, as numpy arrays converted on first read."""

    def __init__(self, graph):
        self._tensors = {tensor.name: tensor for tensor in graph.initializer}
        self._tensors.update({node.output[0]: attribute.t for node in graph.node if node.op_type == "Constant"
                              for attribute in node.attribute if attribute.name == "value"})
        self._arrays: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = tensor_value(self._tensors[name])
        return self._arrays[name]

    def __contains__(self, name) -> bool:
        return name in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def dims(self, name: str) -> list[int]:
        """The dims of constant `name`, without converting it."""
        return list(self._tensors[name].dims)

    def dtype(self, name: str) -> np.dtype:
        """The numpy dtype of constant `name`, without converting it."""
        import onnx

        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self._tensors[name].data_type))


def inferred_values(proto, outputs_of: "Callable | None" = None) -> dict[str, tuple[list[int | None], np.dtype]]:
    """The values whose shape ONNX's shape inference knows, and the initializers, by name: (dims, None where
    unknown; numpy dtype). Only the initializers are known where the inference fails (a graph it rejects).
    `outputs_of(nodes, known)` gives the value infos of outputs of ops the inference does not know (ONNX Runtime's),
    from their inputs' shapes: the inference runs again with them until it learns no more."""
    import onnx

    found = {tensor.name: (list(tensor.dims), onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
             for tensor in proto.graph.initializer}
    skeleton = weights_as_inputs(proto)
    while True:
        try:
            inferred = onnx.shape_inference.infer_shapes(skeleton)
        except Exception:  # the inference raises many error types
            return found
        for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            tensor = value.type.tensor_type
            if tensor.HasField("shape"):
                dims = [dim.dim_value if dim.HasField("dim_value") else None for dim in tensor.shape.dim]
                found[value.name] = (dims, onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        learned = [info for info in (outputs_of(skeleton.graph.node, found) if outputs_of else [])
                   if info.name not in found]
        if not learned:
            return found
        skeleton.graph.value_info.extend(learned)


def weights_as_inputs(proto, limit: int = SKELETON_VALUES):
    """A copy of `proto` whose initializers of more than `limit` values, and those whose data is still on disk, are
    typed graph inputs, for shape inference, the checker and TVM's importer: a model of gigabytes of weights is read
    as fast as its graph, and under protobuf's 2 GB."""
    import onnx

    skeleton = onnx.ModelProto(ir_version=proto.ir_version, opset_import=proto.opset_import,
                               functions=proto.functions)
    graph = skeleton.graph
    graph.name = proto.graph.name
    for part in ("node", "input", "output", "value_info"):
        getattr(graph, part).extend(getattr(proto.graph, part))
    inputs = {value.name for value in proto.graph.input}  # files before IR 4 list initializers as inputs too
    read = read_names(proto.graph)
    for tensor in proto.graph.initializer:
        if int(np.prod(tensor.dims)) <= limit and tensor.data_location != onnx.TensorProto.EXTERNAL:
            graph.initializer.append(tensor)
        elif tensor.name not in inputs and tensor.name in read:  # one no node reads is left out
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    return skeleton


def rename_values(graph, names: Mapping[str, str]) -> None:
    """Renames, in place, the values `names` maps wherever `graph` and its subgraphs name them: node inputs and
    outputs, graph inputs, outputs and value infos."""
    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.name = names.get(value.name, value.name)
    for node in graph.node:
        for field in (node.input, node.output):
            field[:] = [names.get(name, name) for name in field]
        for subgraph in subgraphs(node):
            rename_values(subgraph, names)


def subgraphs(node) -> list:
    """The graphs a node's attributes hold (If's branches, Loop's and Scan's bodies)."""
    import onnx

    graphs = []
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            graphs.append(attribute.g)
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            graphs.extend(attribute.graphs)
    return graphs


def read_names(graph) -> set[str]:
    """The names of the values the nodes of `graph` and of its subgraphs (If, Loop, Scan bodies) read."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for subgraph in subgraphs(node):
            names |= read_names(subgraph)
    return names


@dataclass
class Writer:
    """Emits ONNX nodes and constants under fresh names with one prefix."""

    prefix: str
    nodes: list = field(default_factory=list)
    constants: list = field(default_factory=list)
    count: int = 0

    def _name(self) -> str:
        self.count += 1
        return f"{self.prefix}_{self.count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, out: str | None = None, **attrs):
        """A new node of `op_type` over `inputs`: its output's name (`out` if given), or a list of `outputs` names."""
        import onnx

        names = [out or self._name() for _ in range(outputs)]
        self.nodes.append(onnx.helper.make_node(op_type, list(inputs), names, name=self._name(), **attrs))
        return names if outputs > 1 else names[0]

    def const(self, values, dtype="int64") -> str:
        """The name of a new constant (indices, axes, sizes; weights or a zero state in the model's float dtype)."""
        import onnx

        name = self._name()
        self.constants.append(onnx.numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    def computed_const(self, compute: Callable[[], np.ndarray], dims, dtype, held: Callable | None = None) -> str:
        """The name of a new constant of `dims` and numpy `dtype` that `compute()` gives: computed when it is read
        within an import (the importer binding it: a weight a rewrite derives is never held in the model), else
        now. `held()` gives the importer the constant in a form it keeps instead (packed int4 weights)."""
        import onnx

        session = _IMPORT.get()
        if session is None:
            return self.const(compute(), dtype)
        name = self._name()
        tensor = onnx.TensorProto(name=name, dims=dims, data_type=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                                  data_location=onnx.TensorProto.EXTERNAL)
        tensor.external_data.add(key="location", value=COMPUTED_LOCATION)
        session.computed[name] = lambda: np.asarray(compute(), dtype)
        if held is not None:
            session.held[name] = held
        self.constants.append(tensor)
        return name

    def row(self, tensor: str, index: int) -> str:
        """`tensor`'s slice `index` along its first axis, that axis dropped."""
        return self.op("Gather", tensor, self.const(index), axis=0)

    def split(self, tensor: str, sizes: list[int], axis: int) -> list[str]:
        """`tensor` split along `axis` into parts of `sizes`."""
        return self.op("Split", tensor, self.const(sizes), outputs=len(sizes), axis=axis)


def default_opset(proto) -> int:
    """The version of the default (ai.onnx) operator set the model imports; 0 where it imports none."""
    return next((entry.version for entry in proto.opset_import if entry.domain in DEFAULT_DOMAINS), 0)


def rewrite_nodes(proto, op_types: Collection[str], rewrite: Callable,
                  domains: Collection[str] = DEFAULT_DOMAINS) -> object:
    """`proto` (`writable`'s copy) with each node of `op_types` in `domains` (the default one unless given) replaced
    by what `rewrite(node, writer)` writes (nodes and constants of a fresh Writer, the node's outputs under their
    names)."""
    nodes = list(proto.graph.node)
    rewritten = writable(proto)
    del rewritten.graph.node[:]
    for index, node in enumerate(nodes):
        if node.op_type not in op_types or node.domain not in domains:
            rewritten.graph.node.append(node)
            continue
        writer = Writer(f"relay_amp_{node.op_type.lower()}{index}")
        rewrite(node, writer)
        rewritten.graph.node.extend(writer.nodes)
        rewritten.graph.initializer.extend(writer.constants)
    return rewritten
