"""ONNX Runtime's contrib operators that its transformer optimizer writes, written as ONNX ops before import.

Files optimized by `onnxruntime.transformers.optimizer` (or Optimum's ORTOptimizer) fuse each residual add and
layer norm into a SkipLayerNormalization, RMS norms into (Skip)SimplifiedLayerNormalization, and scaled or
transposed matmuls into FusedMatMul. TVM's importer has no converter for most of these, and its
SkipLayerNormalization needs a beta and a bias and has no fourth output: the residual sum a pre-norm model (GPT-2,
LLaMA) reads, so such files failed to import. `contrib_ops_as_onnx` writes them as the ops an exporter would have
written (norms spelled out, which relay_amp's import folds into one layer norm), every output included:
- SkipLayerNormalization: sum = input + skip (+ bias); its layer norm with gamma (and beta); mean and inverse
  standard deviation; the sum (output 3);
- SkipSimplifiedLayerNormalization and SimplifiedLayerNormalization: the same with an RMS norm; LayerNormalization
  in files before opset 17 (ONNX Runtime's own, in ONNX's domain), spelled out;
- FusedMatMul: alpha times A (transposed) times B (transposed); BiasAdd: x + bias + skip; QuickGelu:
  x sigmoid(alpha x).
"""

from ._onnx_graph import Writer, default_opset, inferred_values, rewrite_nodes
from .errors import ModelLoadError

CONTRIB = "com.microsoft"
SKIP_NORMS = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")
OPS = (*SKIP_NORMS, "SimplifiedLayerNormalization", "FusedMatMul", "BiasAdd", "QuickGelu")
DOMAINS = (CONTRIB, "", "ai.onnx")  # ONNX Runtime registers SimplifiedLayerNormalization in ONNX's own domain
AXES_AS_INPUT = 18  # the opset from which ReduceMean takes its axes as an input
LAYER_NORM_OPSET = 17  # ONNX's LayerNormalization; before it, ONNX Runtime's own in ONNX's domain
QUICK_GELU_ALPHA = 1.702


def contrib_ops_as_onnx(proto):
    """`proto` with ONNX Runtime's fused norm, matmul and activation ops written as ONNX ops (a copy; `proto` is
    unchanged), or ModelLoadError naming a node whose options it does not write."""
    opset = default_opset(proto)
    ops = OPS if opset >= LAYER_NORM_OPSET else (*OPS, "LayerNormalization")
    if not any(node.op_type in ops and node.domain in DOMAINS for node in proto.graph.node):
        return proto
    values = inferred_values(proto)
    return rewrite_nodes(proto, ops, lambda node, writer: _rewrite(node, writer, opset, values), DOMAINS)


def _rewrite(node, writer: Writer, opset: int, values: dict) -> None:
    import onnx

    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    label = f"{node.op_type} node {node.name or node.output[0]!r}"
    inputs = [*node.input, "", "", ""]
    dims, dtype = values.get(inputs[0], (None, "float32"))
    norm = _Norm(writer, opset, dtype)
    if node.op_type in SKIP_NORMS:
        _skip_norm(node, norm, attributes, inputs)
    elif node.op_type in ("SimplifiedLayerNormalization", "LayerNormalization"):
        _check_last_axis(label, attributes, dims)
        centred, outputs = node.op_type == "LayerNormalization", [*node.output, "", ""]
        beta = inputs[2] if centred else ""
        named = outputs[:3] if centred else [outputs[0], "", outputs[1]]  # (Y, mean, inverse) or (Y, inverse)
        norm.write(inputs[0], inputs[1], beta, attributes.get("epsilon", 1e-5), centred, named)
    elif node.op_type == "FusedMatMul":
        _fused_matmul(label, node, writer, attributes, inputs, values)
    elif node.op_type == "BiasAdd":
        writer.op("Add", writer.op("Add", inputs[0], inputs[1]), inputs[2], out=node.output[0])
    else:
        scaled = writer.op("Mul", inputs[0], writer.const(attributes.get("alpha", QUICK_GELU_ALPHA), dtype))
        writer.op("Mul", inputs[0], writer.op("Sigmoid", scaled), out=node.output[0])


def _skip_norm(node, norm: "_Norm", attributes: dict, inputs: list) -> None:
    """input + skip (+ bias), normalized: a layer norm (gamma, beta) or an RMS norm (gamma)."""
    centred = node.op_type == "SkipLayerNormalization"
    beta, bias = (inputs[3], inputs[4]) if centred else ("", inputs[3])
    total = norm.writer.op("Add", inputs[0], inputs[1])
    if bias:
        total = norm.writer.op("Add", total, bias)
    outputs = [*node.output, "", "", ""]
    if outputs[3]:
        norm.writer.op("Identity", total, out=outputs[3])
    norm.write(total, inputs[2], beta, attributes.get("epsilon", 1e-12 if centred else 1e-5), centred, outputs[:3])


class _Norm:
    """Writes layer and RMS norms over the last axis as exporters spell them out, in the model's float dtype."""

    def __init__(self, writer: Writer, opset: int, dtype):
        self.writer, self.opset, self.dtype = writer, opset, dtype

    def write(self, x: str, gamma: str, beta: str, epsilon: float, centred: bool, outputs) -> None:
        """A layer norm (`centred`) or RMS norm of `x`; outputs: the result, the mean (a layer norm's) and the
        inverse standard deviation, each where named."""
        op = self.writer.op
        mean = self._mean(x) if centred else ""
        deviation = op("Sub", x, mean) if centred else x
        variance = self._mean(op("Mul", deviation, deviation))
        root = op("Sqrt", op("Add", variance, self.writer.const(epsilon, self.dtype)))
        scaled = op("Mul", op("Div", deviation, root), gamma)
        if beta:
            op("Add", scaled, beta, out=outputs[0])
        else:
            op("Identity", scaled, out=outputs[0])
        if centred and outputs[1]:
            op("Identity", mean, out=outputs[1])
        if outputs[2]:
            op("Reciprocal", root, out=outputs[2])

    def _mean(self, x: str) -> str:
        if self.opset >= AXES_AS_INPUT:
            return self.writer.op("ReduceMean", x, self.writer.const([-1]), keepdims=1)
        return self.writer.op("ReduceMean", x, axes=[-1], keepdims=1)


def _check_last_axis(label: str, attributes: dict, dims) -> None:
    axis = attributes.get("axis", -1)
    if axis != -1 and axis != len(dims or []) - 1:
        raise ModelLoadError(f"{label}: relay_amp writes a norm over the last axis only, not from axis {axis}")


def _fused_matmul(label: str, node, writer: Writer, attributes: dict, inputs: list, values: dict) -> None:
    if attributes.get("transBatchA", 0) or attributes.get("transBatchB", 0):
        raise ModelLoadError(f"{label}: relay_amp does not write a FusedMatMul with transBatchA or transBatchB")
    operands = []
    for name, flag in ((inputs[0], "transA"), (inputs[1], "transB")):
        rank = len(values.get(name, ([],))[0])
        if attributes.get(flag, 0) and rank < 2:
            raise ModelLoadError(f"{label}: {flag} of {name!r}, whose rank is not known")
        swapped = [*range(rank - 2), rank - 1, rank - 2]
        operands.append(writer.op("Transpose", name, perm=swapped) if attributes.get(flag, 0) else name)
    product = writer.op("MatMul", *operands)
    dtype = values.get(inputs[0], (None, "float32"))[1]
    writer.op("Mul", product, writer.const(attributes.get("alpha", 1.0), dtype), out=node.output[0])
