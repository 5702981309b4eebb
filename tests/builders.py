"""Small models for tests: Relax modules with one `main` whose single dataflow output is an expression of its
parameters, and an ONNX model on dynamic axes."""

from collections.abc import Callable

import ml_dtypes
import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax


def tensor(name: str, shape: tuple, dtype: str = "float32") -> relax.Var:
    """A tensor parameter of `main`."""
    return relax.Var(name, relax.TensorType(shape, dtype))


def single_output_module(build_body: Callable[..., relax.Expr], *params: relax.Var) -> tvm.IRModule:
    """`main(*params)` returning `build_body(*params)`, bound once as the dataflow block's output."""
    bb = relax.BlockBuilder()
    with bb.function("main", list(params)):
        with bb.dataflow():
            out = bb.emit_output(build_body(*params))
        bb.emit_func_output(out)
    return bb.get()


def relu_module(build: Callable[[relax.BlockBuilder, relax.Var], relax.Expr], shape: tuple) -> tvm.IRModule:
    """`main(x)` of an fp32 `x` of `shape` = relu(build(bb, x)), `build` emitting its own bindings through `bb` (the
    ReLU gives the rewritten ops a reader that is not the function's output)."""
    x = tensor("x", shape)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(build(bb, x)))
        bb.emit_func_output(out)
    return bb.get()


def positions_onnx() -> onnx.ModelProto:
    """x + its position along the sequence, the positions computed from x's shape (Range over Shape), on dynamic
    batch and sequence axes: a transformer export's position ids."""
    scalars = {"zero": np.array(0, "int64"), "one": np.array(1, "int64")}
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["length"], axis=0),
             helper.make_node("Range", ["zero", "length", "one"], ["positions"]),
             helper.make_node("Cast", ["positions"], ["as_float"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["x", "as_float"], ["y"])]
    graph = helper.make_graph(nodes, "positions",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])],
                              [numpy_helper.from_array(v, k) for k, v in scalars.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def mismatched_projection() -> onnx.ModelProto:
    """A MatMul named 'proj' of an 8-wide input by a 5x4 weight: valid to ONNX's checker, refused by TVM's converter."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    weight = numpy_helper.from_array(np.ones((5, 4), "float32"), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], "mismatch", [x], [y],
                              [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def hidden_states(model):
    """A torch module returning a transformers `model`'s last hidden state for token ids (and an attention mask,
    where one is passed): what users export from a transformers model."""
    import torch

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask=None):
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    return Hidden()


def lraspp_logits():
    """torchvision's LR-ASPP segmentation model (random weights, 3 classes) as a torch module returning its logits,
    in eval mode: a model users export whose output is a bilinear resize."""
    import torch
    import torchvision

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
                weights=None, weights_backbone=None, num_classes=3)

        def forward(self, x):
            return self.net(x)["out"]

    return Logits().eval()


def seeded_torchvision_through_onnx(name: str, size: int) -> tuple:
    """torchvision's model `name` with random weights (after torch.manual_seed(0)) through `torchvision_through_onnx`;
    the test is skipped where torch or torchvision is missing."""
    import pytest

    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return torchvision_through_onnx(getattr(torchvision.models, name)(weights=None), size)


def torchvision_through_onnx(model, size: int) -> tuple:
    """A torchvision module (`model`, built after torch.manual_seed(0)) exported to ONNX by the TorchScript exporter
    on a `size`x`size` image and imported: (the imported module, the image as an array, torch's output)."""
    import io

    import torch

    import relay_amp

    model = model.eval()
    x = np.random.default_rng(0).standard_normal((1, 3, size, size)).astype("float32")
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    buffer = io.BytesIO()
    torch.onnx.export(model, (torch.from_numpy(x),), buffer, opset_version=17, dynamo=False)
    return relay_amp.frontend.from_onnx(onnx.load_from_string(buffer.getvalue())), x, expected


def timm_through_onnx(name: str, directory, edit=None) -> tuple:
    """A timm model with random weights and 10 classes (`edit`ed in place first, if given), exported to ONNX by the
    TorchScript exporter on a 64x64 image and imported: (the torch module, the imported module, the image as an
    array, torch's output)."""
    import timm
    import torch

    import relay_amp

    torch.manual_seed(0)
    module = timm.create_model(name, pretrained=False, num_classes=10).eval()
    if edit is not None:
        edit(module)
    x = torch.randn(1, 3, 64, 64)
    torch.onnx.export(module, (x,), directory / f"{name}.onnx", opset_version=17, dynamo=False)
    with torch.no_grad():
        expected = module(x).numpy()
    return module, relay_amp.frontend.from_onnx(directory / f"{name}.onnx"), x.numpy(), expected


def segformer_through_onnx(directory) -> tuple:
    """transformers' SegFormer encoder (two stages of one block, random weights) exported to ONNX by the TorchScript
    exporter on a 32x32 image and imported: (the imported module, the image as an array, torch's last hidden
    state)."""
    import torch
    import transformers

    import relay_amp

    config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                          num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2])
    torch.manual_seed(0)
    model = transformers.SegformerModel(config).eval()

    class LastHiddenState(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, pixels):
            return self.model(pixel_values=pixels).last_hidden_state

    pixels = torch.randn(1, 3, 32, 32)
    torch.onnx.export(LastHiddenState().eval(), (pixels,), directory / "segformer.onnx", opset_version=17,
                      dynamo=False)
    with torch.no_grad():
        expected = model(pixel_values=pixels).last_hidden_state.numpy()
    return relay_amp.frontend.from_onnx(directory / "segformer.onnx"), pixels.numpy(), expected


def experts_through_dynamo_onnx(model_class: str, config, directory) -> tuple:
    """A transformers mixture-of-experts causal LM built from `config` (batched_mm experts, random weights), exported
    by the dynamo ONNX exporter on 16 random tokens and imported: (the imported module, the tokens as an array,
    PyTorch's fp32 logits, its bf16 autocast's logits)."""
    import torch
    import transformers

    import relay_amp

    config._experts_implementation = "batched_mm"
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    logits, ids = Logits().eval(), torch.randint(0, config.vocab_size, (1, 16))
    with torch.no_grad():
        expected = logits(ids).numpy()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = logits(ids).float().numpy()
    path = directory / f"{model_class}.onnx"
    torch.onnx.export(logits, (ids,), str(path), dynamo=True, external_data=False)
    return relay_amp.frontend.from_onnx(str(path)), ids.numpy(), expected, autocast


def expert_layer() -> tvm.IRModule:
    """main(x: 6 tokens x 8, index: 9 routed rows) = a linear layer, then the frontend's form of a mixture of experts'
    layer: its output times every one of 4 experts' weights (8 x 4 * 16), each routed row's 16 outputs taken."""
    rng = np.random.default_rng(0)
    x, index = relax.Var("x", relax.TensorType((6, 8), "float32")), relax.Var("index", relax.TensorType((9,), "int64"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x, index]):
        with builder.dataflow():
            hidden = builder.emit(relax.op.matmul(x, relax.const(rng.standard_normal((8, 8)).astype("float32"))))
            every = builder.emit(relax.op.matmul(hidden, relax.const(rng.standard_normal((8, 64)).astype("float32"))))
            table = builder.emit(relax.op.reshape(every, [24, 16]))
            out = builder.emit_output(relax.op.take(table, index, axis=0))
        builder.emit_func_output(out)
    return builder.get()



def taken_expert_rows(weight: np.ndarray, experts: int, tokens: int, rows: int, stored: "str | None" = None,
                      product_returned: bool = False) -> tvm.IRModule:
    """main(x: tokens x depth, index: rows) = the rows `index` takes out of x times every expert's weight (`weight`:
    depth x experts * columns, in x's dtype), as the frontend writes them: the product in fp32 (cast to `stored`),
    reshaped to one row per token and expert, taken; with `product_returned`, the product is an output too."""
    dtype = "bfloat16" if weight.dtype == ml_dtypes.bfloat16 else str(weight.dtype)
    x = relax.Var("x", relax.TensorType((tokens, weight.shape[0]), dtype))
    index = relax.Var("index", relax.TensorType((rows,), "int64"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x, index]):
        with builder.dataflow():
            product = builder.emit(relax.op.matmul(x, relax.const(weight), out_dtype="float32"))
            if stored is not None:
                product = builder.emit(relax.op.astype(product, stored))
            table = builder.emit(relax.op.reshape(product, [tokens * experts, weight.shape[1] // experts]))
            taken = builder.emit(relax.op.take(table, index, axis=0))
            out = builder.emit_output(relax.Tuple([taken, product]) if product_returned else taken)
        builder.emit_func_output(out)
    return builder.get()


def expert_kernel_call(before: tvm.IRModule, spec, weight: np.ndarray) -> tvm.IRModule:
    """What GroupedExpertMatmuls writes for `before` (a `taken_expert_rows` module): one call of the kernel of
    `spec` (an experts.ExpertSpec) on x, the index and `weight` packed."""
    from relay_amp.backend.cpu import experts

    x, index = before["main"].params
    builder = relax.BlockBuilder()
    with builder.function("main", [x, index]):
        with builder.dataflow():
            kernel = builder.add_func(experts.expert_kernel(spec), "expert_matmul")
            packed = relax.const(experts.packed_weight(weight, spec))
            out_type = relax.TensorType((spec.rows, spec.columns), spec.out_dtype)
            taken = builder.emit(relax.call_tir(kernel, [x, index, packed], out_type))
            out = builder.emit_output(taken)
        builder.emit_func_output(out)
    return builder.get()
