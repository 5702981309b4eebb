"""DenseExpertMatmuls: a matmul of expert weights gathered per row (transformers' batched_mm experts) becomes one
matmul by every expert's weight and a gather of each row's own outputs, where the rows are at least the experts."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp.transform import DenseExpertMatmuls

from builders import experts_through_dynamo_onnx
from pass_checks import assert_transforms

RNG = np.random.default_rng(0)
EXPERTS, OUT, DEPTH = 3, 5, 4
STACK = RNG.standard_normal((EXPERTS, OUT, DEPTH)).astype("float32")  # (E, N, K): the weight multiplies from the left


def _module(rows: int, body) -> tvm.IRModule:
    """main(x: rows x DEPTH, index: rows x 1 int64) = body(bb, x, index)."""
    x = relax.Var("x", relax.TensorType((rows, DEPTH), "float32"))
    index = relax.Var("index", relax.TensorType((rows, 1), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, index]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, x, index))
        bb.emit_func_output(out)
    return bb.get()


def _gathered_columns(bb, x, index):
    """Each row's expert weight gathered (GatherND, as the dynamo exporter writes it), times the row as a column."""
    rows = int(x.ty.shape[0])
    weights = bb.emit(relax.op.gather_nd(relax.const(STACK), index))
    column = bb.emit(relax.op.expand_dims(x, 2))
    return bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(weights, column)), [rows, OUT]))


def _gathered_rows(bb, x, index):
    """The row (1 x DEPTH) times its expert's transposed weight (DEPTH x OUT), gathered by take along the experts."""
    rows = int(x.ty.shape[0])
    flat = bb.emit(relax.op.reshape(index, [rows]))
    weights = bb.emit(relax.op.take(relax.const(STACK.transpose(0, 2, 1).copy()), flat, axis=0))
    row = bb.emit(relax.op.expand_dims(x, 1))
    return bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(row, weights)), [rows, OUT]))


def _every_expert(index_rows, vector_axis: int, last_shape):
    """What the pass writes: the rows reshaped to (rows, DEPTH), times every weight (DEPTH, E * OUT), and row s's
    OUT outputs of its own expert taken out of the (rows * E, OUT) products, at s * E + its expert."""
    def body(bb, x, index):
        rows = int(x.ty.shape[0])
        flat = index_rows(bb, index, rows)
        vector = bb.emit(relax.op.expand_dims(x, vector_axis))
        weights = relax.const(STACK.transpose(2, 0, 1).reshape(DEPTH, EXPERTS * OUT))
        every = bb.emit(relax.op.matmul(relax.op.reshape(vector, [rows, DEPTH]), weights))
        own = relax.op.add(relax.const(np.arange(rows) * EXPERTS, "int64"),
                           relax.op.astype(relax.op.reshape(flat, [rows]), "int64"))
        picked = bb.emit(relax.op.take(relax.op.reshape(every, [rows * EXPERTS, OUT]), own, axis=0))
        return bb.emit(relax.op.reshape(bb.emit(relax.op.reshape(picked, last_shape(rows))), [rows, OUT]))
    return body


def test_gathered_weights_times_columns_become_one_matmul_by_every_expert():
    """GatherND's rows times columns: the matmul by the (K, E * N) stack of every weight, the gather of each row's
    N outputs, and the column's shape back; the gather of weights is gone."""
    expected = _every_expert(lambda bb, index, rows: index, 2, lambda rows: [rows, OUT, 1])
    assert_transforms(DenseExpertMatmuls(), _module(4, _gathered_columns), _module(4, expected))


def test_rows_times_gathered_weights_become_one_matmul_by_every_expert():
    """A take of whole weights from the left of the rows (the transposed experts' form)."""
    expected = _every_expert(lambda bb, index, rows: bb.emit(relax.op.reshape(index, [rows])), 1,
                             lambda rows: [rows, 1, OUT])
    assert_transforms(DenseExpertMatmuls(), _module(4, _gathered_rows), _module(4, expected))


def test_fewer_rows_than_experts_keep_their_gathered_weights():
    """A decode step's two rows of three experts: the gather reads fewer weights than the dense form would."""
    before = _module(2, _gathered_columns)
    assert DenseExpertMatmuls()(before).same_as(before)


def _repeated_tokens(bb, x, index):
    """Each of the 3 tokens routed to 2 experts: its row repeated twice in turn (expand_dims, broadcast_to, reshape,
    as the batched_mm experts export it), each copy times its expert's gathered weight."""
    rows = int(x.ty.shape[0])
    tokens = bb.emit(relax.op.strided_slice(x, [0], [0], [rows // 2]))
    repeated = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(tokens, 1)), [rows // 2, 2, DEPTH]))
    column = bb.emit(relax.op.expand_dims(bb.emit(relax.op.reshape(repeated, [rows, DEPTH])), 2))
    weights = bb.emit(relax.op.gather_nd(relax.const(STACK), index))
    return bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(weights, column)), [rows, OUT]))


def test_a_token_repeated_per_routed_expert_is_multiplied_by_the_weights_once():
    """Rows that repeat each token for its two experts: every weight multiplies the 3 tokens, not the 6 rows, and
    each row reads its token's outputs (row s at (s // 2) * E + its expert)."""
    after = DenseExpertMatmuls()(_module(6, _repeated_tokens))
    relax.analysis.well_formed(after)
    text = after["main"].script()
    assert "R.gather_nd(" not in text
    assert 'R.Tensor((3, 15), dtype="float32") = R.matmul(' in text


def test_a_function_the_module_lacks_is_named_in_the_error():
    """A module without that function (nor any gather): a ModuleError naming the functions it has."""
    with pytest.raises(relay_amp.errors.ModuleError, match="no Relax function 'decode'.*'main'"):
        DenseExpertMatmuls("decode")(_module(2, lambda bb, x, index: bb.emit(relax.op.add(x, x))))


@pytest.mark.parametrize("body", [_gathered_columns, _gathered_rows, _repeated_tokens],
                         ids=["columns", "rows", "repeated-tokens"])
def test_every_expert_at_once_computes_what_the_gathered_weights_did(body):
    """Built and run: the rows' outputs of the dense form equal the gathered form's, in fp32 (within 1e-5) and bf16
    (within 2e-2 of the largest output), each row reading its own expert."""
    rows = 8
    mod = _module(rows, body)
    x = RNG.standard_normal((rows, DEPTH)).astype("float32")
    index = RNG.integers(0, EXPERTS, (rows, 1)).astype("int64")
    read = np.repeat(x[:rows // 2], 2, axis=0) if body is _repeated_tokens else x
    expected = np.einsum("snk,sk->sn", STACK[index[:, 0]], read)
    dense = DenseExpertMatmuls()(mod)
    relax.analysis.well_formed(dense)
    got = relay_amp.run(dense, [x, index])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    halved = relay_amp.run(relay_amp.to_mixed_precision(dense, "bfloat16"), [x, index])[0]
    assert np.abs(halved - expected).max() <= 2e-2 * np.abs(expected).max()


def test_an_olmoe_export_multiplies_its_rows_by_every_expert_and_matches_pytorch(tmp_path):
    """OLMoE (transformers, 2 layers, 8 experts, top 2, 16 tokens; batched_mm experts, the dynamo ONNX exporter) is
    imported with no gather of expert weights, its up projections over the 16 tokens and its down projections over
    the 32 routed rows, and its logits match PyTorch's within 1e-5 of the largest."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.OlmoeConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                                      num_experts_per_tok=2, max_position_embeddings=64)
    imported, ids, expected, _ = experts_through_dynamo_onnx("OlmoeForCausalLM", config, tmp_path)
    text = imported["main"].script()
    assert "R.gather_nd(" not in text
    assert text.count('R.Tensor((16, 512), dtype="float32") = R.matmul(') == 2  # up: 16 tokens by 8 experts' 64
    assert text.count('R.Tensor((32, 512), dtype="float32") = R.matmul(') == 2  # down: 32 routed rows by 8 experts
    got = relay_amp.run(imported, [ids])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
