"""ONNX's recurrent operators (LSTM, GRU, RNN) unrolled into the ops they compute, step by step, before import.

TVM's Relax importer has no LSTM, GRU or RNN, so a model exported from torch.nn.LSTM or nn.GRU (a speech or
time-series model, a CRNN's text decoder) did not import at all. `recurrences_unrolled` writes each such node as the
ONNX ops of its definition over a sequence of static length: every step's input projection as one MatMul (which runs
on relay_amp's kernels), then per step and direction the recurrent MatMul, the gates and the state update, and the
outputs stacked in ONNX's layouts (Y: [seq, directions, batch, hidden], Y_h and Y_c: [directions, batch, hidden];
batch first with `layout=1`). Weights, biases and initial states are sliced per direction with ONNX ops, which the
import folds with the file's other constants. `sequence_lens`, LSTM peepholes, `clip`, `input_forget` and
activations other than Sigmoid, Tanh and Relu are refused with a ModelLoadError naming the node.
"""

from dataclasses import dataclass

import numpy as np

from ._onnx_graph import (Writer, attribute_text, default_opset, inferred_values, node_attributes, node_label,
                          rewrite_nodes)
from .errors import ModelLoadError

RECURRENT_OPS = ("LSTM", "GRU", "RNN")
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
ACTIVATIONS = ("Sigmoid", "Tanh", "Relu")
REFUSED_INPUTS = {"sequence_lens": 4, "peepholes": 7}  # inputs the unrolling does not compute, by position
MIN_OPSET = 13  # Split and Unsqueeze take their sizes and axes as inputs


@dataclass(frozen=True)
class _Recurrence:
    """One recurrent node as the unrolling reads it."""

    node: object
    hidden: int
    steps: int
    batch: int
    dtype: np.dtype
    reverses: list  # per direction: whether it runs backwards in time
    activations: list  # per direction: ONNX's activation names (f, g[, h])
    batch_first: bool
    linear_before_reset: bool

    @property
    def kind(self) -> str:
        """LSTM, GRU or RNN."""
        return self.node.op_type

    def operand(self, position: int) -> str | None:
        """The node's input at `position`, None where it is left out."""
        inputs = self.node.input
        return inputs[position] if len(inputs) > position and inputs[position] else None


def recurrences_unrolled(proto):
    """`proto` with its LSTM, GRU and RNN nodes written as the ops they compute (a copy; `proto` is unchanged).
    The import unrolls a graph whose constant subgraphs onnxscript has folded: its shapes then include those
    ONNX's shape inference alone leaves unknown (an exporter's pads computed from the input's length in float
    arithmetic: EnCodec's), and the optimizer's rewrite rules are not tried at each of the unrolled steps' ops."""
    recurrent = [node for node in proto.graph.node if node.op_type in RECURRENT_OPS]
    if not recurrent:
        return proto
    opset = default_opset(proto)
    if opset < MIN_OPSET:
        raise ModelLoadError(f"relay_amp unrolls LSTM, GRU and RNN in ONNX opset {MIN_OPSET} and later; "
                             f"this file is opset {opset} (export it again with a newer opset)")
    values = inferred_values(proto)
    return rewrite_nodes(proto, RECURRENT_OPS, lambda node, writer: _unroll(_recurrence(node, values), writer))


def _recurrence(node, values: dict) -> _Recurrence:
    """What `node` computes, or ModelLoadError where the unrolling does not compute it."""
    attrs = node_attributes(node)
    label = node_label(node)
    refused = [name for name, position in REFUSED_INPUTS.items() if len(node.input) > position
               and node.input[position] and (node.op_type == "LSTM" or name == "sequence_lens")]
    refused += [name for name in ("clip", "input_forget") if attrs.get(name)]
    if refused:
        raise ModelLoadError(f"{label}: relay_amp does not unroll a recurrence with {', '.join(refused)}")
    batch_first = bool(attrs.get("layout", 0))
    dims, dtype = values.get(node.input[0], ([], None))
    steps, batch = (dims[1::-1] if batch_first else dims[:2]) if len(dims) == 3 else (None, None)
    if not steps or not batch:
        raise ModelLoadError(f"{label}: its input's sequence length and batch are not static (size the file's "
                             "symbolic dims at import: dims=...)")
    direction = attribute_text(attrs.get("direction", "forward"))
    reverses = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[direction]
    names = [attribute_text(name) for name in attrs.get("activations", [])]
    per_direction = len(DEFAULT_ACTIVATIONS[node.op_type])
    activations = [names[i * per_direction:(i + 1) * per_direction] if names else DEFAULT_ACTIVATIONS[node.op_type]
                   for i in range(len(reverses))]
    unknown = sorted({name for group in activations for name in group} - set(ACTIVATIONS))
    if unknown:
        raise ModelLoadError(f"{label}: relay_amp unrolls {list(ACTIVATIONS)} activations, not {unknown}")
    return _Recurrence(node, int(attrs["hidden_size"]), steps, batch, dtype, reverses, activations, batch_first,
                       bool(attrs.get("linear_before_reset", 0)))


def _unroll(rec: _Recurrence, w: Writer) -> None:
    """Write `rec`'s node into `w` as ops, under the node's own output names."""
    sequence = w.op("Transpose", rec.node.input[0], perm=[1, 0, 2]) if rec.batch_first else rec.node.input[0]
    stacks = ([], [], [])  # per direction: hidden states over time, final hidden state, final cell state
    for d, reverse in enumerate(rec.reverses):
        states, state, cell = _direction(rec, w, sequence, d, reverse)
        stacks[0].append(w.op("Unsqueeze", w.op("Concat", *states, axis=0), w.const([1])))
        stacks[1].append(w.op("Unsqueeze", state, w.const([0])))
        if cell is not None:
            stacks[2].append(w.op("Unsqueeze", cell, w.const([0])))
    batch_first_orders = ([2, 0, 1, 3], [1, 0, 2], [1, 0, 2])
    for name, parts, order, axis in zip(rec.node.output, stacks, batch_first_orders, (1, 0, 0)):
        if name:
            stacked = w.op("Concat", *parts, axis=axis)
            if rec.batch_first:
                w.op("Transpose", stacked, perm=order, out=name)
            else:
                w.op("Identity", stacked, out=name)


def _direction(rec: _Recurrence, w: Writer, sequence: str, d: int, reverse: bool):
    """One direction's hidden states (each [1, batch, hidden]) in time order, and its final hidden and cell
    state (None but for LSTM)."""
    weight = w.op("Transpose", w.row(rec.node.input[1], d), perm=[1, 0])  # [input, gates x hidden]
    recurrent = w.op("Transpose", w.row(rec.node.input[2], d), perm=[1, 0])  # [hidden, gates x hidden]
    input_bias, reset_bias = _biases(rec, w, d)
    projected = w.op("MatMul", sequence, weight)  # every step's input projection at once
    if input_bias:
        projected = w.op("Add", projected, input_bias)
    state, cell = (_initial(rec, w, position, d) for position in (5, 6))
    step_of = {"LSTM": _lstm_step, "GRU": _gru_step, "RNN": _rnn_step}[rec.kind]
    states = {}
    for step in reversed(range(rec.steps)) if reverse else range(rec.steps):
        state, cell = step_of(w, w.row(projected, step), state, cell, recurrent, reset_bias, rec, d)
        states[step] = w.op("Unsqueeze", state, w.const([0]))
    return [states[step] for step in range(rec.steps)], state, cell if rec.kind == "LSTM" else None


def _biases(rec: _Recurrence, w: Writer, d: int) -> tuple[str | None, str | None]:
    """The bias added to every step's input projection (the input and recurrent biases summed), and a GRU's
    recurrent candidate bias where `linear_before_reset` applies the reset gate after it (else None)."""
    bias = rec.operand(3)
    if bias is None:
        return None, None
    size = GATES[rec.kind] * rec.hidden
    input_bias, recurrent_bias = w.split(w.row(bias, d), [size, size], axis=0)
    if not (rec.kind == "GRU" and rec.linear_before_reset):
        return w.op("Add", input_bias, recurrent_bias), None
    gates_in, candidate_in = w.split(input_bias, [2 * rec.hidden, rec.hidden], axis=0)
    gates_recurrent, candidate_recurrent = w.split(recurrent_bias, [2 * rec.hidden, rec.hidden], axis=0)
    return w.op("Concat", w.op("Add", gates_in, gates_recurrent), candidate_in, axis=0), candidate_recurrent


def _initial(rec: _Recurrence, w: Writer, position: int, d: int) -> str:
    """Direction `d`'s initial hidden (position 5) or cell (6) state: the node's input, else zeros."""
    given = rec.operand(position)
    return w.row(given, d) if given else w.const(np.zeros((rec.batch, rec.hidden)), rec.dtype)


def _lstm_step(w: Writer, x: str, state: str, cell: str, recurrent: str, _, rec: _Recurrence, d: int):
    f, g, h = rec.activations[d]
    gates = w.op("Add", x, w.op("MatMul", state, recurrent))
    inputs, outputs, forgets, candidates = w.split(gates, [rec.hidden] * 4, axis=1)
    cell = w.op("Add", w.op("Mul", w.op(f, forgets), cell), w.op("Mul", w.op(f, inputs), w.op(g, candidates)))
    return w.op("Mul", w.op(f, outputs), w.op(h, cell)), cell


def _gru_step(w: Writer, x: str, state: str, _, recurrent: str, reset_bias: str | None, rec: _Recurrence, d: int):
    f, g = rec.activations[d]
    x_update, x_reset, x_candidate = w.split(x, [rec.hidden] * 3, axis=1)
    gates_weight, candidate_weight = w.split(recurrent, [2 * rec.hidden, rec.hidden], axis=1)
    h_update, h_reset = w.split(w.op("MatMul", state, gates_weight), [rec.hidden] * 2, axis=1)
    update = w.op(f, w.op("Add", x_update, h_update))
    reset = w.op(f, w.op("Add", x_reset, h_reset))
    if rec.linear_before_reset:
        recurrent_candidate = w.op("MatMul", state, candidate_weight)
        if reset_bias:
            recurrent_candidate = w.op("Add", recurrent_candidate, reset_bias)
        recurrent_candidate = w.op("Mul", reset, recurrent_candidate)
    else:
        recurrent_candidate = w.op("MatMul", w.op("Mul", reset, state), candidate_weight)
    candidate = w.op(g, w.op("Add", x_candidate, recurrent_candidate))
    return w.op("Add", candidate, w.op("Mul", update, w.op("Sub", state, candidate))), None


def _rnn_step(w: Writer, x: str, state: str, _, recurrent: str, __, rec: _Recurrence, d: int):
    return w.op(rec.activations[d][0], w.op("Add", x, w.op("MatMul", state, recurrent))), None
