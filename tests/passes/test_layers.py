"""The shared layer index: list_layers, count_layers and index resolution."""

import pytest
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp import models
from relay_amp.passes.layers import resolve_layers


@I.ir_module
class Residual:
    """conv -> (conv, conv in parallel) -> add -> matmul: three convs, two of them side by side."""

    @R.function
    def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((4, 4, 3, 3), "float32"),
             m: R.Tensor((8, 2), "float32")) -> R.Tensor((1, 4, 8, 2), "float32"):
        with R.dataflow():
            stem = R.nn.conv2d(x, w, padding=1)
            left = R.nn.conv2d(stem, w, padding=1)
            right = R.nn.conv2d(stem, w, padding=1)
            merged = R.add(left, right)
            gv = R.matmul(merged, m)
            R.output(gv)
        return gv


def test_list_layers_numbers_calls_in_binding_order():
    layers = relay_amp.list_layers(Residual)
    assert [(l.index, l.op, l.name) for l in layers] == [
        (0, "relax.nn.conv2d", "stem"),
        (1, "relax.nn.conv2d", "left"),
        (2, "relax.nn.conv2d", "right"),
        (3, "relax.matmul", "gv"),
    ]
    assert layers[3].input_shapes == ((1, 4, 8, 8), (8, 2))
    assert layers[3].input_dtypes == ("float32", "float32")
    assert (layers[3].output_shape, layers[3].output_dtype) == ((1, 4, 8, 2), "float32")


def test_list_layers_accepts_short_op_names():
    assert relay_amp.list_layers(Residual, ["nn.conv2d"]) == relay_amp.list_layers(Residual, ["relax.nn.conv2d"])


def test_count_layers_total_and_depth_on_residual_graph():
    assert relay_amp.count_layers(Residual, ["nn.conv2d"]) == 3
    assert relay_amp.count_layers(Residual, ["nn.conv2d"], depth=True) == 2
    assert relay_amp.count_layers(Residual, ["nn.conv2d", "matmul"], depth=True) == 3
    assert relay_amp.count_layers(Residual, ["nn.relu"]) == 0


def test_resnet18_counts_18_deep_as_in_tvm():
    mod = models.resnet18(image_size=32)
    assert relay_amp.count_layers(mod, ["nn.conv2d", "matmul"], depth=True) == 18
    assert relay_amp.count_layers(mod, ["nn.conv2d"]) == 20


def test_resolve_layers_by_index_negative_index_and_name():
    layers = relay_amp.list_layers(Residual)
    assert resolve_layers(layers, [0, -1, "right"]) == {0, 2, 3}
    assert resolve_layers(layers, None) == set()


@pytest.mark.parametrize(
    "selector, fragment",
    [(4, r"valid: -4\.\.3"), (-5, "out of range"), ("nope", "no layer is named 'nope'"), (1.5, "1.5")],
)
def test_resolve_layers_rejects_unknown_selectors(selector, fragment):
    with pytest.raises(relay_amp.LayerIndexError, match=fragment):
        resolve_layers(relay_amp.list_layers(Residual), [selector])


def test_list_layers_errors_name_the_problem():
    with pytest.raises(relay_amp.UnknownOpError, match="conv9d"):
        relay_amp.list_layers(Residual, ["nn.conv9d"])
    with pytest.raises(relay_amp.ModuleError, match="'forward'"):
        relay_amp.list_layers(Residual, func="forward")
    with pytest.raises(relay_amp.ModuleError, match="IRModule"):
        relay_amp.list_layers("not a module")
