"""Quantized ONNX operators rewritten in QDQ form before import, so that realize_qdq compiles them.

ONNX Runtime writes a statically quantized model either as QDQ (QuantizeLinear/DequantizeLinear pairs around
float ops, which TVM imports) or as QOperator (QLinearConv, QLinearMatMul, and Microsoft's QGemm, QLinearAdd,
..., which TVM does not), and a dynamically quantized one as DynamicQuantizeLinear -> MatMulInteger/ConvInteger
-> Cast -> Mul by the product of the two scales. `as_qdq` writes both in the QDQ form:
- a QLinear op becomes its float op over dequantized operands, quantized into its output's codes (whose range
  also does the ReLU or clip ONNX Runtime folded into it: realize_qdq keeps that clamp); an op that moves 8-bit
  codes without arithmetic (MaxPool, Reshape, ...) runs on the dequantized values and quantizes again with the same
  parameters;
- the dynamic pattern becomes the float conv or matmul of dequantize(DynamicQuantizeLinear(x)) and the
  dequantized weight: a QDQ pair whose scale is computed at run time, which realize_qdq makes a dynamic matmul.
Constant weights and biases are dequantized here, with numpy. `constant_dequantizes_folded` does the same for a QDQ
file's DequantizeLinear of a scalar constant: TVM's importer reads some inputs only as constants (a Pad's value, which
ONNX Runtime's quantizer dequantizes too: EfficientNet-B0's same-padding pads).
"""

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ._onnx_graph import tensor_value, writable
from .errors import ModelLoadError


@dataclass(frozen=True)
class _QLinear:
    """Where a QLinear op keeps what its float op needs."""

    float_op: str
    operands: tuple[int, ...] | None  # first input of each (codes, scale, zero point); None: every triplet after
    output: int | None  # the input holding the output's scale (its zero point follows); None: a float output
    bias: int | None = None  # an int32 bias input, in the product of the first two operands' scales
    dropped: tuple[str, ...] = ("channels_last",)  # attributes the float op does not have


QLINEAR_OPS = {
    "QLinearConv": _QLinear("Conv", (0, 3), 6, bias=8),
    "QLinearMatMul": _QLinear("MatMul", (0, 3), 6),
    "QGemm": _QLinear("Gemm", (0, 3), 7, bias=6),
    "QLinearAdd": _QLinear("Add", (0, 3), 6),
    "QLinearMul": _QLinear("Mul", (0, 3), 6),
    "QLinearGlobalAveragePool": _QLinear("GlobalAveragePool", (0,), 3),
    "QLinearAveragePool": _QLinear("AveragePool", (0,), 3),
    "QLinearSigmoid": _QLinear("Sigmoid", (0,), 3),
    "QLinearLeakyRelu": _QLinear("LeakyRelu", (0,), 3),
    "QLinearSoftmax": _QLinear("Softmax", (0,), 3, dropped=("opset",)),
    "QLinearConcat": _QLinear("Concat", None, 0),
}
MOVES = frozenset({"MaxPool", "GlobalMaxPool", "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice",
                   "Gather", "Split", "Identity", "Expand", "Tile", "Resize", "DepthToSpace", "SpaceToDepth"})
INTEGER_OPS = {"MatMulInteger": "MatMul", "ConvInteger": "Conv"}


def _operand_starts(spec: _QLinear, node) -> list[int]:
    if spec.operands is not None:
        return list(spec.operands)
    return list(range(2, len(node.input), 3))


def _has_input(node, index: int | None) -> bool:
    return index is not None and index < len(node.input) and bool(node.input[index])


def _weight_axis(node, operand: int) -> int:
    """The axis a constant operand's per-channel scales run along."""
    if node.op_type in ("QLinearConv", "ConvInteger"):
        return 0
    if node.op_type == "QGemm":
        return 0 if _attributes(node).get("transB", 0) else 1
    return -1


def _attributes(node, dropped: tuple[str, ...] = ()) -> dict:
    """`node`'s attributes by name, as Python values, but for those `dropped`."""
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name not in dropped}


def _dequantized(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, axis: int) -> np.ndarray:
    """Real values of integer codes: (codes - zero) * scale, per-channel scales and zero points along `axis`.

    `axis` is read only where a scale or zero point has several values: ONNX ignores it for per-tensor ones, and
    ONNX Runtime's quantizer writes its per-channel default (1) on weights of rank 1 it quantized per tensor.
    """
    zero = np.zeros(1) if zero is None else zero
    shape = [1] * codes.ndim
    if max(scale.size, zero.size) > 1:
        shape[axis] = -1
    per_axis = (lambda values: values.reshape(shape) if values.size > 1 else values.reshape(()))
    return ((codes.astype(np.float64) - per_axis(zero)) * per_axis(scale)).astype(np.float32)


class _Rewriter:
    """One pass over a graph's nodes, writing the QDQ form."""

    def __init__(self, graph):
        self.constants = {init.name: tensor_value(init) for init in graph.initializer}
        self.params: dict[str, tuple[str, str]] = {}  # a quantized activation -> its scale and zero point
        self.readers = defaultdict(list)
        for node in graph.node:
            for name in node.input:
                self.readers[name].append(node)
        self.producers = {name: node for node in graph.node for name in node.output}
        self.nodes, self.new_constants, self.skipped = [], [], set()
        self.names = itertools.count()

    def fresh(self, name: str, suffix: str) -> str:
        """A tensor name no other tensor has."""
        return f"{name}__{suffix}{next(self.names)}"

    def constant(self, name: str, value: np.ndarray) -> str:
        """A new initializer holding `value`."""
        from onnx import numpy_helper

        name = self.fresh(name, "const")
        self.new_constants.append(numpy_helper.from_array(np.asarray(value), name))
        self.constants[name] = np.asarray(value)
        return name

    def emit(self, op_type: str, inputs: list[str], outputs: list[str], **attributes) -> None:
        """Append a node of the default domain."""
        from onnx import helper

        self.nodes.append(helper.make_node(op_type, inputs, outputs, **attributes))

    def float_operand(self, node, start: int, axis: int) -> str:
        """A float tensor for the (codes, scale, zero point) operand starting at `start`."""
        codes, scale = node.input[start], node.input[start + 1]
        zero = node.input[start + 2] if _has_input(node, start + 2) else ""
        if codes in self.constants and scale in self.constants and (not zero or zero in self.constants):
            values = _dequantized(self.constants[codes], self.constants[scale], self.constants.get(zero), axis)
            return self.constant(codes, values)
        output = self.fresh(codes, "dq")
        per_axis = scale in self.constants and self.constants[scale].size > 1
        self.emit("DequantizeLinear", [codes, scale] + ([zero] if zero else []), [output],
                  **({"axis": axis} if per_axis else {}))
        return output

    def bias(self, node, spec: _QLinear) -> list[str]:
        """The float bias of a QLinearConv/QGemm (int32 codes at the product of its operands' scales), if any."""
        if not _has_input(node, spec.bias):
            return []
        names = node.input[spec.bias], node.input[1], node.input[4]
        if not all(name in self.constants for name in names):
            raise ModelLoadError(f"{node.op_type} node {node.name!r}: its bias and scales must be constants")
        codes, a_scale, b_scale = (self.constants[name] for name in names)
        attributes = _attributes(node)
        alpha_over_beta = attributes.get("alpha", 1.0) / attributes.get("beta", 1.0)
        scale = (a_scale.astype(np.float64) * b_scale * alpha_over_beta).reshape(-1)
        return [self.constant(names[0], (codes.astype(np.float64) * scale).astype(np.float32))]

    def quantize_output(self, value: str, output: str, scale: str, zero: str) -> None:
        """Quantize `value` into `output`, whose parameters its readers then find."""
        self.emit("QuantizeLinear", [value, scale, zero], [output])
        self.params[output] = (scale, zero)

    def qlinear(self, node, spec: _QLinear) -> None:
        """A QLinear op as dequantize, float op, quantize."""
        if _attributes(node).get("channels_last", 0):
            raise ModelLoadError(f"{node.op_type} node {node.name!r}: channels_last=1 is not supported")
        operands = [self.float_operand(node, start, _weight_axis(node, start)) for start in _operand_starts(spec, node)]
        attributes = _attributes(node, spec.dropped)
        quantized = _has_input(node, spec.output)
        result = self.fresh(node.output[0], "float") if quantized else node.output[0]
        self.emit(spec.float_op, operands + self.bias(node, spec), [result], **attributes)
        if quantized:
            self.quantize_output(result, node.output[0], node.input[spec.output], node.input[spec.output + 1])

    def move(self, node) -> None:
        """An op that moves 8-bit codes, run on their real values and quantized again with the same parameters."""
        scale, zero = self.params[node.input[0]]
        data = self.fresh(node.input[0], "dq")
        self.emit("DequantizeLinear", [node.input[0], scale, zero], [data])
        outputs = [self.fresh(name, "float") for name in node.output]
        attributes = _attributes(node)
        self.emit(node.op_type, [data, *node.input[1:]], outputs, **attributes)
        for value, output in zip(outputs, node.output):
            self.emit("QuantizeLinear", [value, scale, zero], [output])
            self.params[output] = (scale, zero)

    def dynamic(self, node) -> bool:
        """DynamicQuantizeLinear -> MatMulInteger/ConvInteger -> Cast -> Mul by the scales' product as the float
        op over a dynamic QDQ pair and the dequantized weight; False where the node is not in that pattern."""
        pattern = self._dynamic_pattern(node)
        if pattern is None:
            return False
        quantizer, weight_scale, cast, scaled = pattern
        data = self.fresh(node.input[0], "dq")
        self.emit("DequantizeLinear", [node.input[0], quantizer.output[1], quantizer.output[2]], [data])
        zero = self.constants.get(node.input[3]) if _has_input(node, 3) else None
        axis = _weight_axis(node, 1)
        weight = self.constant(node.input[1], _dequantized(self.constants[node.input[1]], weight_scale, zero, axis))
        attributes = _attributes(node)
        self.emit(INTEGER_OPS[node.op_type], [data, weight], [scaled.output[0]], **attributes)
        self.skipped.update({id(cast), id(scaled)})
        return True

    def _only_reader(self, name: str, op_type: str):
        readers = self.readers[name]
        return readers[0] if len(readers) == 1 and readers[0].op_type == op_type else None

    def _dynamic_pattern(self, node):
        quantizer = self.producers.get(node.input[0])
        if quantizer is None or quantizer.op_type != "DynamicQuantizeLinear" or node.input[1] not in self.constants:
            return None
        if _has_input(node, 2) and node.input[2] != quantizer.output[2]:
            return None
        cast = self._only_reader(node.output[0], "Cast")
        scaled = cast and self._only_reader(cast.output[0], "Mul")
        if not scaled:
            return None
        product = self.producers.get(next((name for name in scaled.input if name != cast.output[0]), ""))
        if product is None or product.op_type != "Mul" or quantizer.output[1] not in product.input:
            return None
        weight_scale = next((self.constants.get(name) for name in product.input if name != quantizer.output[1]), None)
        return None if weight_scale is None else (quantizer, weight_scale, cast, scaled)

    def visit(self, node) -> None:
        """Write `node` (or what replaces it) to the new node list."""
        if id(node) in self.skipped:
            return
        if node.op_type in QLINEAR_OPS:
            self.qlinear(node, QLINEAR_OPS[node.op_type])
        elif node.op_type in MOVES and node.input and node.input[0] in self.params:
            self.move(node)
        elif not (node.op_type in INTEGER_OPS and self.dynamic(node)):
            self.nodes.append(node)
            if node.op_type == "QuantizeLinear" and len(node.input) == 3:
                self.params[node.output[0]] = (node.input[1], node.input[2])


def _live(nodes: list, outputs: set[str]) -> list:
    """`nodes` without those none of whose outputs anything reads."""
    read = set(outputs)
    kept = []
    for node in reversed(nodes):
        if any(name in read for name in node.output):
            kept.append(node)
            read.update(node.input)
    return kept[::-1]


def _has_quantized_ops(proto) -> bool:
    """Whether a model holds QOperator or integer ops that `as_qdq` rewrites."""
    return any(node.op_type in QLINEAR_OPS or node.op_type in INTEGER_OPS for node in proto.graph.node)


def as_qdq(proto):
    """`proto` (`writable`'s copy) with its QOperator ops and dynamic integer patterns written as QDQ pairs around
    float ops (the model unchanged where it has none)."""
    if not _has_quantized_ops(proto):
        return proto
    rewriter = _Rewriter(proto.graph)
    for node in proto.graph.node:
        rewriter.visit(node)
    rewritten = writable(proto)
    graph = rewritten.graph
    del graph.node[:]
    graph.node.extend(_live(rewriter.nodes, {output.name for output in graph.output}))
    graph.initializer.extend(rewriter.new_constants)
    del graph.value_info[:]  # shapes of the rewritten tensors change type; the importer infers them again
    if not any(node.domain == "com.microsoft" for node in graph.node):
        kept = [opset for opset in rewritten.opset_import if opset.domain != "com.microsoft"]
        del rewritten.opset_import[:]
        rewritten.opset_import.extend(kept)
    return rewritten


def constant_dequantizes_folded(proto):
    """`proto` (`writable`'s copy) whose DequantizeLinear nodes of scalar constants (one code; scale, zero point
    and code all initializers) are float initializers (the model unchanged where it has none). Weights keep theirs:
    realize_qdq reads a weight's int8 codes from its DequantizeLinear."""
    from onnx import numpy_helper

    constants = {init.name: init for init in proto.graph.initializer}
    outputs = {output.name for output in proto.graph.output}
    folded = [node for node in proto.graph.node if node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx")
              and all(name in constants for name in node.input if name) and node.output[0] not in outputs
              and math.prod(constants[node.input[0]].dims) == 1]
    if not folded:
        return proto
    removed = {id(node) for node in folded}
    kept = [node for node in proto.graph.node if id(node) not in removed]
    rewritten = writable(proto)
    for node in folded:
        codes, scale, *zero = (tensor_value(constants[name]) if name else None for name in node.input)
        axis = next((attribute.i for attribute in node.attribute if attribute.name == "axis"), 1)
        values = _dequantized(codes, scale, zero[0] if zero else None, axis)
        rewritten.graph.initializer.append(numpy_helper.from_array(values, node.output[0]))
    del rewritten.graph.node[:]
    rewritten.graph.node.extend(kept)
    return rewritten
