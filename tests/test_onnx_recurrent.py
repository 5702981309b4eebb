"""onnx_recurrent: ONNX LSTM, GRU and RNN nodes unrolled into the ops they compute, so TVM's importer takes them."""

import math

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import relay_amp
from relay_amp import ModelLoadError
from relay_amp.frontend import simplify_onnx
from relay_amp.onnx_recurrent import recurrences_unrolled
from relay_amp.runtime import run_executable

torch = pytest.importorskip("torch")

RECURRENCES = {  # torch.nn layers whose ONNX export is one LSTM, GRU or RNN node per layer
    "lstm_two_layers": lambda: torch.nn.LSTM(16, 24, num_layers=2),
    "lstm_bidirectional_batch_first": lambda: torch.nn.LSTM(16, 24, batch_first=True, bidirectional=True),
    "lstm_without_bias": lambda: torch.nn.LSTM(16, 24, bias=False),
    "gru_bidirectional": lambda: torch.nn.GRU(16, 24, bidirectional=True),  # linear_before_reset=1
    "gru_two_layers_batch_first": lambda: torch.nn.GRU(16, 24, batch_first=True, num_layers=2),
    "rnn_relu": lambda: torch.nn.RNN(16, 24, nonlinearity="relu"),
    "rnn_tanh_bidirectional": lambda: torch.nn.RNN(16, 24, bidirectional=True, batch_first=True),
}


class _AllOutputs(torch.nn.Module):
    """A recurrence's output sequence, plus its final hidden (and cell) state summed in, so every output is read."""

    def __init__(self, recurrence):
        super().__init__()
        self.recurrence = recurrence

    def forward(self, x):
        sequence, final = self.recurrence(x)
        states = final if isinstance(final, tuple) else (final,)
        return sequence + sum(state.sum() for state in states)


def _exported(tmp_path, module, x):
    path = tmp_path / "recurrent.onnx"
    with torch.no_grad():
        torch.onnx.export(module, (torch.from_numpy(x),), str(path), opset_version=17, dynamo=False)
    return path


@pytest.mark.parametrize("case", sorted(RECURRENCES))
def test_an_exported_recurrence_imports_and_computes_what_torch_does(case, tmp_path):
    """Built for the CPU in fp32 (its MatMuls on the kernels: the same products, summed in another order)."""
    torch.manual_seed(0)
    module = _AllOutputs(RECURRENCES[case]()).eval()
    x = np.random.default_rng(0).standard_normal((7, 3, 16)).astype("float32")
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    proto = onnx.load(_exported(tmp_path, module, x))
    assert any(node.op_type in ("LSTM", "GRU", "RNN") for node in proto.graph.node)
    got = run_executable(relay_amp.build(relay_amp.frontend.from_onnx(proto)), [x])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def _lstm_graph(**attrs) -> onnx.ModelProto:
    """One forward LSTM over a [5, 2, 4] input with 3 hidden units, its weights as initializers."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype("float32"), name)
               for name, shape in (("W", (1, 12, 4)), ("R", (1, 12, 3)))]
    inputs = ["x", "W", "R", *attrs.pop("extra_inputs", [])]
    node = helper.make_node("LSTM", inputs, ["y"], hidden_size=3, **attrs)
    graph = helper.make_graph([node], "lstm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_unrolled_graph_projects_every_step_at_once_and_leaves_the_input_model_alone():
    proto = _lstm_graph()
    unrolled = recurrences_unrolled(proto)
    ops = [node.op_type for node in unrolled.graph.node]
    assert "LSTM" not in ops and [node.op_type for node in proto.graph.node] == ["LSTM"]
    assert ops.count("MatMul") == 1 + 5  # the input projection, then one recurrent product per step
    plain = helper.make_model(helper.make_graph([], "empty", [], []))
    assert recurrences_unrolled(plain) is plain


@pytest.mark.parametrize("attrs, named", [
    ({"clip": 1.0}, "clip"),
    ({"input_forget": 1}, "input_forget"),
    ({"activations": ["HardSigmoid", "Tanh", "Tanh"]}, "HardSigmoid"),
    ({"extra_inputs": ["", "lengths"]}, "sequence_lens"),
])
def test_what_the_unrolling_does_not_compute_is_a_model_load_error_naming_it(attrs, named):
    with pytest.raises(ModelLoadError, match=named):
        recurrences_unrolled(_lstm_graph(**attrs))


def test_an_old_opset_is_refused_with_the_version_to_export_at():
    proto = _lstm_graph()
    proto.opset_import[0].version = 11
    with pytest.raises(ModelLoadError, match="opset 13"):
        recurrences_unrolled(proto)


class _PaddedToFrames(torch.nn.Module):
    """EnCodec's pattern: the signal padded to whole frames, the pad computed from its length in float arithmetic
    (math.ceil of a quotient), which ONNX's shape inference cannot follow, then framed by a strided conv and read
    by an LSTM."""

    def __init__(self):
        super().__init__()
        self.frames = torch.nn.Conv1d(1, 8, kernel_size=4, stride=4)
        self.lstm = torch.nn.LSTM(8, 6)

    def forward(self, x):
        length = x.shape[-1]
        frames = (length - 4) / 4 + 1
        padded = torch.nn.functional.pad(x, (0, int(math.ceil(frames)) * 4 - 4 - (length - 4)))
        sequence, _ = self.lstm(self.frames(padded).permute(2, 0, 1))
        return sequence


def test_a_recurrence_whose_length_only_simplification_finds_imports(tmp_path):
    """The import unrolls the graph with its constant subgraphs folded, where the recurrence's input dims are known."""
    torch.manual_seed(0)
    module = _PaddedToFrames().eval()
    x = np.random.default_rng(0).standard_normal((1, 1, 30)).astype("float32")
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    proto = onnx.load(_exported(tmp_path, module, x))
    with pytest.raises(ModelLoadError, match="sequence length and batch are not static"):
        recurrences_unrolled(proto)  # ONNX's inference alone leaves them unknown
    assert "LSTM" not in [node.op_type for node in recurrences_unrolled(simplify_onnx(proto)).graph.node]
    got = run_executable(relay_amp.build(relay_amp.frontend.from_onnx(proto)), [x])[0]
    assert got.shape == expected.shape == (8, 1, 6)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_a_bidirectional_grus_outputs_are_written_run_by_run_in_vectors(tmp_path):
    """PyTorch's export of a bidirectional GRU (not the LSTM this was found on) joins the directions' outputs and
    flattens them to [steps, batch, 2 * hidden]: the function writing them reads each direction's run of the row in a
    vector loop of its own (relay_amp.backend.cpu.schedules._input_segments), none lane by lane, and the build
    matches PyTorch."""
    import re

    from pass_checks import prepared_module

    from relay_amp.backend.cpu.pipeline import untuned_schedule

    torch.manual_seed(0)
    module = torch.nn.GRU(16, 32, bidirectional=True).eval()
    x = np.random.default_rng(0).standard_normal((6, 4, 16)).astype("float32")
    with torch.no_grad():
        expected = module(torch.from_numpy(x))[0].numpy()
    imported = relay_amp.frontend.from_onnx(onnx.load(_exported(tmp_path, module, x)))
    target = relay_amp.targets.get_target("cpu")
    written = [func for _, func in prepared_module(imported).functions_items() if isinstance(func, tvm.tirx.PrimFunc)
               and [int(d) for d in func.params[-1].shape] == [6, 4, 64]]
    assert len(written) == 1
    text = untuned_schedule(written[0].with_attr("global_symbol", "main"), target).mod.script()
    innermost = re.findall(r"for \w+ in ([\w.]+)\(.*\n\s*with T.sblock\(\"\w+(?<!_partition)(?<!_common)\"", text)
    assert len(innermost) == 2 and all(loop == "T.vectorized" for loop in innermost), text
    got = run_executable(relay_amp.build(imported), [x])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_an_unrolled_recurrences_steps_read_their_input_rows_in_place(tmp_path):
    """PyTorch's export of an RNN (not the LSTM this was found on): each unrolled step reads its row of the input
    projection computed for all steps as a view (relay_amp.backend.views.ContiguousTakesAsViews), not a copy made
    by a take function of its own, and the build matches PyTorch."""
    from pass_checks import prepared_module

    torch.manual_seed(0)
    module = torch.nn.RNN(16, 32).eval()
    x = np.random.default_rng(0).standard_normal((9, 4, 16)).astype("float32")
    with torch.no_grad():
        expected = module(torch.from_numpy(x))[0].numpy()
    imported = relay_amp.frontend.from_onnx(onnx.load(_exported(tmp_path, module, x)))
    prepared = prepared_module(imported)
    assert not [gv.name_hint for gv in prepared.get_global_vars() if "take" in gv.name_hint]
    assert prepared["main"].script().count("R.memory.view(") == 9
    got = run_executable(relay_amp.build(imported), [x])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
