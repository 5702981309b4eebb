"""transformers' ONNX export of its grouped expert matmul as one matmul by every expert's weight and a gather.

transformers' own ONNX exporter (`transformers.exporters.exporter_onnx`) writes the matmul of its default
mixture-of-experts implementation (`grouped_mm`: the routed rows sorted by expert, each expert's end row counted)
as one MatMul per expert of the rows a Range between two ends gathers, its bias added, and the products
concatenated: row counts known only at run time, whose shapes TVM's build failed on ("CodeGenVM cannot emit this
Relax operator directly"). `grouped_matmuls_dense` writes it as the rows times every expert's weight side by side,
(K, E * N), and each row's own expert's N outputs gathered, that expert counted from the ends at or before the row:
the dense form relay_amp._expert_matmuls writes, whose taken products alone the CPU backend computes.
"""

from dataclasses import dataclass

import numpy as np

from ._onnx_graph import Writer, constant_values, inferred_values, rewrite_nodes

INT64 = 7  # onnx.TensorProto.INT64


@dataclass(frozen=True)
class _Group:
    """One expert's part of the concatenation: its rows' Range bounds, its weight and its bias (or None)."""
    rows: str
    start: str
    end: str
    weight: str
    bias: "str | None"


def grouped_matmuls_dense(proto):
    """`proto` (`writable`'s copy, where it has a Range) with each concatenation of per-expert matmuls of
    consecutive row ranges of one tensor (transformers' grouped expert matmul) in the dense form."""
    if not any(node.op_type == "Range" for node in proto.graph.node):
        return proto
    producers = {output: node for node in proto.graph.node for output in node.output}
    constants = constant_values(proto.graph)
    found = {node.output[0]: groups for node in proto.graph.node
             if node.op_type == "Concat" and (groups := _groups(node, producers, constants))}
    if not found:  # Ranges of positions alone: no shape inference
        return proto
    values = inferred_values(proto)

    def dense(node, writer: Writer) -> None:
        groups = found.get(node.output[0])
        rows = values.get(groups[0].rows, ([None],))[0][0] if groups else None
        if rows is None:
            writer.nodes.append(node)
            return
        _write_dense(node.output[0], groups, rows, writer)

    return rewrite_nodes(proto, ["Concat"], dense)


def _groups(node, producers: dict, constants) -> "list[_Group] | None":
    """The experts' parts of the Concat `node` along axis 0, in order, where each is a matmul of one tensor's rows
    from the previous part's end (0 first) to its own, by step 1; else None."""
    axis = next((attribute.i for attribute in node.attribute if attribute.name == "axis"), None)
    groups = [_group(name, producers, constants) for name in node.input] if axis == 0 else [None]
    if len(groups) < 2 or None in groups or len({group.rows for group in groups}) != 1:
        return None
    if len({group.bias is None for group in groups}) != 1:  # a bias to every expert's outputs or to none
        return None
    first = groups[0].start
    if first not in constants or np.asarray(constants[first]).size != 1 or int(constants[first].reshape(-1)[0]):
        return None
    if any(group.start != previous.end for previous, group in zip(groups, groups[1:])):
        return None
    return groups


def _group(name: str, producers: dict, constants) -> "_Group | None":
    """One expert's part: MatMul(Gather(rows, Range(start, end, 1), axis=0), weight), a bias added or not."""
    node, bias = producers.get(name), None
    if node is not None and node.op_type == "Add":
        product, bias = node.input if _op_type(producers, node.input[0]) == "MatMul" else node.input[::-1]
        node = producers.get(product)
    if node is None or node.op_type != "MatMul":
        return None
    gather = producers.get(node.input[0])
    if gather is None or gather.op_type != "Gather" or any(
            attribute.name == "axis" and attribute.i != 0 for attribute in gather.attribute):
        return None
    ranged = producers.get(gather.input[1])
    if ranged is None or ranged.op_type != "Range" or ranged.input[2] not in constants:
        return None
    if np.asarray(constants[ranged.input[2]]).reshape(-1).tolist() != [1]:
        return None
    return _Group(gather.input[0], ranged.input[0], ranged.input[1], node.input[1], bias)


def _op_type(producers: dict, name: str) -> "str | None":
    """The op type of the node computing `name`, or None for a graph input or an initializer."""
    node = producers.get(name)
    return None if node is None else node.op_type


def _write_dense(output: str, groups: "list[_Group]", rows: int, writer: Writer) -> None:
    """`output` as the rows times every expert's weight, each row's own expert's outputs gathered (plus its bias)."""
    experts, axis0 = len(groups), writer.const([0])
    every = writer.op("MatMul", groups[0].rows, writer.op("Concat", *(group.weight for group in groups), axis=1))
    products = writer.op("Reshape", every, writer.const([rows * experts, -1]))
    ends = writer.op("Concat", *(writer.op("Unsqueeze", group.end, axis0) for group in groups), axis=0)
    ended = writer.op("LessOrEqual", writer.op("Unsqueeze", writer.op("Cast", ends, to=INT64), axis0),
                      writer.const(np.arange(rows)[:, None]))
    counted = writer.op("ReduceSum", writer.op("Cast", ended, to=INT64), writer.const([1]), keepdims=0)
    expert = writer.op("Min", counted, writer.const(experts - 1))  # rows past the last end: no expert's rows
    own = writer.op("Add", writer.const(np.arange(rows) * experts), expert)
    if groups[0].bias is None:
        writer.op("Gather", products, own, axis=0, out=output)
        return
    biases = writer.op("Concat", *(writer.op("Unsqueeze", group.bias, axis0) for group in groups), axis=0)
    writer.op("Add", writer.op("Gather", products, own, axis=0), writer.op("Gather", biases, expert, axis=0),
              out=output)
