"""ONNX Runtime's mixture-of-experts ops, MoE and QMoE (com.microsoft), written as ONNX ops before import.

ONNX Runtime GenAI's model builder writes each mixture-of-experts layer as one MoE node (QMoE where the expert
weights are int4 or int8): the tokens, the router's logits, each expert's first projection (E, N, H) and second
(E, H, I), biases optional. Its gpt-oss and LFM2-MoE files were checked here; Qwen3.5-MoE's and Phi-3.5-MoE's it
writes for CUDA only (Phi-3.5-MoE's sparse mixer is refused), and Gemma 4's MoE was not tried. TVM's importer has
neither op, so such files failed to import. `moe_ops_as_onnx` writes each as the ops it computes, in the form
transformers' `batched_mm` experts export to (relay_amp._expert_matmuls): each token's k routed rows gather their
expert's weight out of the stack and multiply by it, so relay_amp's import and CPU backend compute only the routed
rows' products, grouped by expert, as they do for models exported from PyTorch:
- routing as ONNX Runtime's CPU kernel does it: a softmax of the logits over all experts, the top k, and with
  `normalize_routing_weights` each divided by their sum;
- the first projection (+ its bias) and the activation: relu, gelu (tanh's approximation), silu, identity, or
  swiglu: G = min(g, limit), L = clamp(l, -limit, limit), G sigmoid(alpha G) (L + beta), with g and l interleaved
  in the projection's outputs (swiglu_fusion 1), concatenated (2), or g from the first projection and l from the
  third (0);
- the second projection (+ its bias), times the routing weight, summed over each token's k experts.
QMoE's int4 and int8 weights are (code - zero point) x scale, per output channel or per block along the depth, the
zero point 2^(bits - 1) unless given. Symmetric 4-bit codes that MatMulNBits' would hold packed (onnx_nbits.packable:
GenAI's int4 files, blocks of 32) stay packed through import: each projection is written in the dense form the
import gives a prompt's experts (the rows times every expert's weight, one (depth, experts x outputs) weight held
packed, and a take of each row's own expert's outputs), which the CPU backend computes only for the routed rows, on
the codes for `int4w`, else on the weights its DenseWeights computes at build time. A LFM2-MoE-style GenAI int4
file (174 MiB): the imported module's constants 989 -> 179 MiB, import 5.0-8.5 -> 3.6-3.9 s. Other codes are
dequantized to the model's float dtype at import (the module holds every expert in floats). (ONNX Runtime 1.32's
CPU QMoE normalizes the routing weights whether `normalize_routing_weights` is set or not; this follows the
attribute, as its MoE does.)
"""

import numpy as np

from ._onnx_graph import (Writer, attribute_text, constant_values, named_inputs, node_attributes, node_label,
                          rewrite_nodes)
from .errors import ModelLoadError
from .onnx_nbits import dequantized, held_packed, packable, unpacked
from .packed_int4 import PackedWeight

CONTRIB = "com.microsoft"
MOE_INPUTS = ("input", "router_probs", "fc1_experts_weights", "fc1_experts_bias", "fc2_experts_weights",
              "fc2_experts_bias", "fc3_experts_weights", "fc3_experts_bias")
QMOE_INPUTS = ("input", "router_probs", "fc1_experts_weights", "fc1_scales", "fc1_experts_bias",
               "fc2_experts_weights", "fc2_scales", "fc2_experts_bias", "fc3_experts_weights", "fc3_scales",
               "fc3_experts_bias", "fc1_zero_points", "fc2_zero_points", "fc3_zero_points", "router_weights")
ACTIVATIONS = ("relu", "gelu", "silu", "identity", "swiglu")
WEIGHT_BITS = (4, 8)  # QMoE's integer codes that ONNX Runtime's CPU kernel takes
GELU_TANH = (0.7978845608, 0.044715)  # sqrt(2 / pi) and the cube's coefficient of GELU's tanh approximation
INTERLEAVED, CONCATENATED = 1, 2  # swiglu_fusion: g and l of each output in turn, or all g then all l


def moe_ops_as_onnx(proto):
    """`proto` with each MoE and QMoE node written as ONNX ops (a copy; `proto` is unchanged), or ModelLoadError
    naming a node whose options it does not write."""
    if not any(node.op_type in ("MoE", "QMoE") and node.domain == CONTRIB for node in proto.graph.node):
        return proto
    constants = constant_values(proto.graph)
    return rewrite_nodes(proto, ["MoE", "QMoE"], lambda node, writer: _moe(node, writer, constants), [CONTRIB])


def _moe(node, writer: Writer, constants: dict) -> None:
    label, attributes = node_label(node), node_attributes(node)
    named = named_inputs(node, QMOE_INPUTS if node.op_type == "QMoE" else MOE_INPUTS)
    _check(label, node.op_type, attributes, named, constants)
    experts = _Experts(node, writer, named, constants, attributes)
    hidden = experts.dims("fc2")[1]
    tokens = writer.op("Reshape", named["input"], writer.const([-1, hidden]))
    weights, index = _routing(writer, named["router_probs"], experts.count, attributes)
    top_k = int(attributes.get("k", 1))
    rows = writer.op("Reshape", writer.op("Expand", writer.op("Unsqueeze", tokens, writer.const([1])),
                                          writer.const([1, top_k, 1])), writer.const([-1, hidden, 1]))
    first = _activated(writer, experts, rows, index, attributes)
    second = experts.product("fc2", writer.op("Unsqueeze", first, writer.const([2])), index)
    weighted = writer.op("Mul", second, writer.op("Reshape", weights, writer.const([-1, 1])))
    summed = writer.op("ReduceSum", writer.op("Reshape", weighted, writer.const([-1, top_k, hidden])),
                       writer.const([1]), keepdims=0)
    writer.op("Reshape", summed, writer.op("Shape", named["input"]), out=node.output[0])


def _check(label: str, op_type: str, attributes: dict, named: dict, constants) -> None:
    """ModelLoadError naming what of the node relay_amp does not write."""
    refused = [name for name in ("use_sparse_mixer", "swiglu_limit_after_activation") if attributes.get(name, 0)]
    activation = attribute_text(attributes.get("activation_type", "relu"))
    refused += [f"activation_type {activation!r}"] if activation not in ACTIVATIONS else []
    refused += ["a third projection without swiglu_fusion 0"] if named["fc3_experts_weights"] and not (
        activation == "swiglu" and attributes.get("swiglu_fusion", 0) == 0) else []
    refused += ["swiglu_fusion 0 without a third projection"] if activation == "swiglu" and not (
        named["fc3_experts_weights"] or attributes.get("swiglu_fusion", 0)) else []
    refused += ["router_weights"] if named.get("router_weights") else []
    if op_type == "QMoE":
        refused += _quantized_refusals(attributes)
    missing = [f"{name} {value!r}" for name, value in named.items()
               if ("experts" in name or "scales" in name or "zero" in name) and value and value not in constants]
    refused += [f"non-constant {', '.join(missing)}"] if missing else []
    if refused:
        raise ModelLoadError(f"{label}: relay_amp does not write an ONNX Runtime MoE with {', '.join(refused)}")


def _quantized_refusals(attributes: dict) -> list[str]:
    """What of a QMoE node's quantization relay_amp does not dequantize."""
    quant_type = attribute_text(attributes.get("quant_type", "int"))
    refused = [f"quant_type {quant_type!r}"] if quant_type != "int" else []
    bits = [attributes.get(name, attributes.get("expert_weight_bits", 4)) for name in
            ("expert_weight_bits", "fc1_expert_weight_bits", "fc2_expert_weight_bits", "fc3_expert_weight_bits")]
    refused += [f"{bit}-bit weights" for bit in sorted(set(bits)) if bit not in WEIGHT_BITS]
    refused += ["weights_prepacked 1"] if attributes.get("weights_prepacked", 0) == 1 else []
    return refused


def _routing(writer: Writer, logits: str, experts: int, attributes: dict) -> tuple[str, str]:
    """Each token's k routing weights and experts, flattened: a softmax over all the experts, the top k, each divided
    by their sum where `normalize_routing_weights`."""
    scores = writer.op("Softmax", writer.op("Reshape", logits, writer.const([-1, experts])), axis=-1)
    values, index = writer.op("TopK", scores, writer.const([int(attributes.get("k", 1))]), outputs=2, axis=-1)
    if attributes.get("normalize_routing_weights", 0):
        values = writer.op("Div", values, writer.op("ReduceSum", values, writer.const([1]), keepdims=1))
    return values, writer.op("Reshape", index, writer.const([-1]))


def _activated(writer: Writer, experts: "_Experts", rows: str, index: str, attributes: dict) -> str:
    """The activation of each routed row's first projection: (rows, I)."""
    activation = attribute_text(attributes.get("activation_type", "relu"))
    first = experts.product("fc1", rows, index)
    if activation == "swiglu":
        return _swiglu(writer, experts, first, rows, index, attributes)
    if activation == "relu":
        return writer.op("Relu", first)
    if activation == "silu":
        return writer.op("Mul", first, writer.op("Sigmoid", first))
    if activation == "gelu":
        return _gelu_tanh(writer, first, experts.dtype)
    return first


def _gelu_tanh(writer: Writer, x: str, dtype) -> str:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as ONNX Runtime's MoE computes GELU."""
    root, cube = GELU_TANH
    inner = writer.op("Mul", writer.op("Add", x, writer.op("Mul", writer.op("Mul", writer.op("Mul", x, x), x),
                                                           writer.const(cube, dtype))), writer.const(root, dtype))
    half = writer.op("Mul", x, writer.const(0.5, dtype))
    return writer.op("Mul", half, writer.op("Add", writer.op("Tanh", inner), writer.const(1.0, dtype)))


def _swiglu(writer: Writer, experts: "_Experts", first: str, rows: str, index: str, attributes: dict) -> str:
    """G sigmoid(alpha G) (L + beta), G and L the gate and linear parts clamped to the limit."""
    fusion, width = attributes.get("swiglu_fusion", 0), experts.dims("fc2")[2]
    if fusion == INTERLEAVED:
        pairs = writer.op("Reshape", first, writer.const([-1, width, 2]))
        gate, linear = (writer.op("Gather", pairs, writer.const(part), axis=2) for part in (0, 1))
    elif fusion == CONCATENATED:
        gate, linear = writer.split(first, [width, width], axis=1)
    else:
        gate, linear = first, experts.product("fc3", rows, index)
    limit = attributes.get("swiglu_limit")
    if limit is not None and np.isfinite(limit):
        gate = writer.op("Min", gate, writer.const(limit, experts.dtype))
        linear = writer.op("Clip", linear, writer.const(-limit, experts.dtype), writer.const(limit, experts.dtype))
    alpha, beta = attributes.get("activation_alpha", 1.0), attributes.get("activation_beta", 0.0)
    scaled = writer.op("Mul", gate, writer.const(alpha, experts.dtype)) if alpha != 1.0 else gate
    swish = writer.op("Mul", gate, writer.op("Sigmoid", scaled))
    shifted = writer.op("Add", linear, writer.const(beta, experts.dtype)) if beta != 0.0 else linear
    return writer.op("Mul", swish, shifted)


class _Experts:
    """A MoE node's expert weights and biases, and the products of routed rows by their experts' weights: a gather
    from each projection's stack (QMoE's dequantized as the importer reads it), or a take from the product by every
    expert's weight held packed."""

    def __init__(self, node, writer: Writer, named: dict, constants, attributes: dict):
        self.writer, self.named, self.constants, self.attributes = writer, named, constants, attributes
        self.quantized = node.op_type == "QMoE"
        self.count = constants.dims(named["fc1_experts_weights"])[0]
        self.dtype = constants.dtype(named["fc1_scales" if self.quantized else "fc1_experts_weights"])

    def dims(self, projection: str) -> list[int]:
        """The (experts, outputs, depth) of `projection`'s weight stack (QMoE's codes unpacked)."""
        experts, outputs, packed = self.constants.dims(self.named[f"{projection}_experts_weights"])
        return [experts, outputs, packed * 8 // self._bits(projection) if self.quantized else packed]

    def _bits(self, projection: str) -> int:
        return self.attributes.get(f"{projection}_expert_weight_bits", self.attributes.get("expert_weight_bits", 4))

    def _part(self, projection: str, part: str) -> np.ndarray:
        """The constant `projection`'s `part` names ("experts_weights": QMoE's packed codes, "scales", ...)."""
        return self.constants[self.named[f"{projection}_{part}"]]

    def _layout(self, projection: str) -> dict:
        """The MatMulNBits attributes of one expert's `projection` codes (blocks of the whole depth per channel)."""
        experts, outputs, depth = self.dims(projection)
        scales = self._part(projection, "scales")
        return {"bits": self._bits(projection), "K": depth, "N": outputs,
                "block_size": depth // scales.shape[2] if scales.ndim == 3 else depth}

    def _packable(self, projection: str) -> bool:
        """Whether `projection`'s codes are held packed through import: onnx_nbits.packable's per expert, and
        symmetric (the middle code; the int4 expert kernel reads no zero points)."""
        return (self.quantized and packable(self._layout(projection), self.dtype)
                and not self.named[f"{projection}_zero_points"])

    def _points(self, projection: str, expert: int) -> "np.ndarray | None":
        """`expert`'s zero points of `projection` as onnx_nbits reads a MatMulNBits node's: packed per block, or
        (per channel, where QMoE packs them along the outputs) unpacked to floats; None for the middle code."""
        if not self.named[f"{projection}_zero_points"]:
            return None
        points, scales = self._part(projection, "zero_points"), self._part(projection, "scales")
        if scales.ndim == 3:
            return points[expert]
        return unpacked(points[expert], self._bits(projection))[:self.dims(projection)[1]].astype("float32")

    def _stack(self, projection: str) -> str:
        """`projection`'s weight stack (experts, outputs, depth) as a value of the model's float dtype (QMoE's
        (code - zero point) x scale, each expert's dequantized as a MatMulNBits weight of the same codes)."""
        name = self.named[f"{projection}_experts_weights"]
        if not self.quantized:
            return name
        codes, scales = self._part(projection, "experts_weights"), self._part(projection, "scales")
        layout = self._layout(projection)
        return self.writer.computed_const(lambda: np.stack([
            dequantized(codes[expert], scales[expert], self._points(projection, expert), layout)
            for expert in range(self.count)]).astype(self.dtype), self.dims(projection), self.dtype)

    def _held(self, projection: str) -> PackedWeight:
        """A packable `projection`'s codes as one packed (depth, experts x outputs) weight, each expert's outputs
        after the previous expert's (relay_amp.packed_int4's 16-column blocks, one expert's after another)."""
        codes, scales = self._part(projection, "experts_weights"), self._part(projection, "scales")
        parts = [held_packed(codes[expert], scales[expert], None, self._layout(projection))
                 for expert in range(self.count)]
        return PackedWeight(np.concatenate([part.packed for part in parts]),
                            np.concatenate([part.scales for part in parts], axis=1))

    def product(self, projection: str, rows: str, index: str) -> str:
        """Each routed row (rows, depth, 1) times its expert's `projection` weight, plus its bias: (rows, outputs)."""
        outputs = self.dims(projection)[1]
        if self._packable(projection):
            product = self._taken_from_every_expert(projection, rows, index)
        else:
            gathered = self.writer.op("Gather", self._stack(projection), index, axis=0)
            product = self.writer.op("Reshape", self.writer.op("MatMul", gathered, rows),
                                     self.writer.const([-1, outputs]))
        bias = self.named[f"{projection}_experts_bias"]
        return self.writer.op("Add", product, self.writer.op("Gather", bias, index, axis=0)) if bias else product

    def _taken_from_every_expert(self, projection: str, rows: str, index: str) -> str:
        """The dense form of the routed rows' products (relay_amp._expert_matmuls): the rows times every expert's
        weight, held packed, (rows, experts x outputs), and each row's own expert's outputs taken."""
        writer, (experts, outputs, depth) = self.writer, self.dims(projection)
        weight = writer.computed_const(lambda: self._held(projection).dense(), [depth, experts * outputs],
                                       self.dtype, held=lambda: self._held(projection))
        every = writer.op("MatMul", writer.op("Reshape", rows, writer.const([-1, depth])), weight)
        count = writer.op("Squeeze", writer.op("Shape", index), writer.const([0]))
        first_rows = writer.op("Mul", writer.op("Range", writer.const(0), count, writer.const(1)),
                               writer.const(experts))
        return writer.op("Gather", writer.op("Reshape", every, writer.const([-1, outputs])),
                         writer.op("Add", first_rows, index), axis=0)
