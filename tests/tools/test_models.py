"""Built-in models: deterministic, well-formed, runnable."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import models

from builders import positions_onnx


@pytest.mark.parametrize(
    "name, options, out_shape",
    [
        ("small_cnn", {"batch": 2}, (2, 10)),
        ("resnet18", {"image_size": 32, "classes": 7}, (1, 7)),
        ("bert", {"seq_len": 16, "layers": 2}, (1, 16, 256)),
        ("linear", {"batch": 2, "size": 64}, (2, 64)),
        ("attention_scores", {"heads": 2, "tokens": 5, "head_size": 8}, (2, 5, 5)),
        ("runtime_matmul", {"batch": 2, "size": 16}, (2, 16, 16)),
    ],
)
def test_model_is_deterministic_well_formed_and_runs(name, options, out_shape):
    mod = models.get_model(name, **options)
    relax.analysis.well_formed(mod)
    tvm.ir.assert_structural_equal(mod, models.get_model(name, **options))
    out = relay_amp.run(mod, models.example_inputs(mod))[0]
    assert out.shape == out_shape and np.isfinite(out).all()


def test_bert_has_the_layers_of_a_transformer_encoder():
    mod = models.bert_encoder(seq_len=8)
    ops = {l.op for l in relay_amp.list_layers(mod, ["matmul", "nn.softmax", "nn.layer_norm", "nn.gelu"])}
    assert ops == {"relax.matmul", "relax.nn.softmax", "relax.nn.layer_norm", "relax.nn.gelu"}
    assert relay_amp.count_layers(mod, ["matmul"]) == 4 * 8


def test_example_inputs_match_parameter_types():
    ids, = models.example_inputs(models.bert_encoder(batch=2, seq_len=8))
    assert ids.dtype == np.int64 and ids.shape == (2, 8) and ids.max() < models.INT_INPUT_HIGH


def test_example_inputs_give_integer_masks_all_ones():
    """A decoder computes its positions from its attention mask's sum: random integers put them past its caches."""
    ids = relax.Var("input_ids", relax.TensorType((1, 4), "int64"))
    mask = relax.Var("attention_mask", relax.TensorType((1, 4), "int64"))
    builder = relax.BlockBuilder()
    with builder.function("main", [ids, mask]):
        builder.emit_func_output(relax.op.add(ids, mask))
    ids_value, mask_value = models.example_inputs(builder.get())
    assert (mask_value == 1).all() and ids_value.max() < models.INT_INPUT_HIGH


def test_example_inputs_of_a_dynamic_model_name_the_dim_to_bind():
    mod = relay_amp.frontend.from_onnx(positions_onnx())
    with pytest.raises(relay_amp.OptionError, match=r"input 'x' has symbolic dim 'batch'.*--dim batch=N"):
        models.example_inputs(mod)
    assert models.example_inputs(relay_amp.specialize(mod, {"batch": 2, "seq": 3}))[0].shape == (2, 3)


def test_unknown_model_name_is_an_option_error():
    with pytest.raises(relay_amp.OptionError, match="vgg"):
        models.get_model("vgg")


def test_runtime_matmuls_take_both_operands_as_inputs():
    mod = models.attention_scores(heads=2, tokens=5, head_size=8)
    a, b = models.example_inputs(mod)
    assert a.shape == (2, 5, 8) and b.shape == (2, 8, 5)
    np.testing.assert_allclose(relay_amp.run(mod, [a, b])[0], a @ b, rtol=1e-5, atol=1e-5)
