"""Deterministic built-in models for examples, tests and benchmarks, built with Relax's BlockBuilder."""

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op as R

from .._ir import get_function
from ..errors import OptionError
from ..passes.shapes import static_input_shape

INT_INPUT_HIGH = 100  # integer inputs (token ids) are drawn from [0, INT_INPUT_HIGH)


class _Weights:
    """Emits ops whose parameters are random constants drawn from one seeded generator."""

    def __init__(self, builder: relax.BlockBuilder, seed: int):
        self.bb = builder
        self.rng = np.random.default_rng(seed)

    def const(self, shape: tuple, scale: float, offset: float = 0.0) -> relax.Expr:
        values = offset + scale * self.rng.standard_normal(shape)
        return relax.const(values.astype("float32"))

    def conv(self, x, cin: int, cout: int, kernel: int, stride: int = 1, bias: bool = False):
        weight = self.const((cout, cin, kernel, kernel), np.sqrt(2.0 / (cin * kernel * kernel)))
        y = self.bb.emit(R.nn.conv2d(x, weight, strides=stride, padding=kernel // 2))
        if bias:
            y = self.bb.emit(R.add(y, self.const((1, cout, 1, 1), 0.1)))
        return y

    def batch_norm(self, x, channels: int):
        gamma = self.const((channels,), 0.1, 1.0)
        beta = self.const((channels,), 0.1)
        mean = self.const((channels,), 0.1)
        var = relax.const(self.rng.uniform(0.5, 1.5, channels).astype("float32"))
        bn = self.bb.emit(R.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=False))
        return self.bb.emit(relax.TupleGetItem(bn, 0))

    def dense(self, x, fin: int, fout: int):
        y = self.bb.emit(R.matmul(x, self.const((fin, fout), np.sqrt(1.0 / fin))))
        return self.bb.emit(R.add(y, self.const((fout,), 0.02)))

    def layer_norm(self, x, width: int):
        gamma, beta = self.const((width,), 0.05, 1.0), self.const((width,), 0.05)
        return self.bb.emit(R.nn.layer_norm(x, gamma, beta, axes=[-1]))


def _classifier_head(net: _Weights, x, channels: int, classes: int):
    pooled = net.bb.emit(R.nn.adaptive_avg_pool2d(x, output_size=1))
    flat = net.bb.emit(R.reshape(pooled, (-1, channels)))
    return net.dense(flat, channels, classes)


def small_cnn(batch: int = 1, image_size: int = 16, classes: int = 10, seed: int = 0) -> tvm.IRModule:
    """A two-conv CNN (conv, bias, batch norm, relu, max pool, residual add, dense) on NCHW images."""
    bb = relax.BlockBuilder()
    x = relax.Var("data", relax.TensorType((batch, 3, image_size, image_size), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            net = _Weights(bb, seed)
            y = bb.emit(R.nn.relu(net.conv(x, 3, 8, 3, bias=True)))
            y = bb.emit(R.nn.max_pool2d(y, pool_size=2, strides=2))
            z = bb.emit(R.nn.relu(net.batch_norm(net.conv(y, 8, 8, 3), 8)))
            y = bb.emit(R.add(y, z))
            out = bb.emit_output(_classifier_head(net, y, 8, classes))
        bb.emit_func_output(out)
    return bb.get()


def _basic_block(net: _Weights, x, cin: int, cout: int, stride: int):
    y = net.bb.emit(R.nn.relu(net.batch_norm(net.conv(x, cin, cout, 3, stride), cout)))
    y = net.batch_norm(net.conv(y, cout, cout, 3), cout)
    shortcut = x
    if stride != 1 or cin != cout:
        shortcut = net.batch_norm(net.conv(x, cin, cout, 1, stride), cout)
    return net.bb.emit(R.nn.relu(net.bb.emit(R.add(y, shortcut))))


def resnet18(batch: int = 1, image_size: int = 224, classes: int = 1000, seed: int = 0) -> tvm.IRModule:
    """ResNet-18 (He et al.) with random weights: 20 conv2d, batch norm, residual adds, one dense."""
    bb = relax.BlockBuilder()
    x = relax.Var("data", relax.TensorType((batch, 3, image_size, image_size), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            net = _Weights(bb, seed)
            y = bb.emit(R.nn.relu(net.batch_norm(net.conv(x, 3, 64, 7, 2), 64)))
            y = bb.emit(R.nn.max_pool2d(y, pool_size=3, strides=2, padding=1))
            cin = 64
            for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                y = _basic_block(net, y, cin, cout, stride)
                y = _basic_block(net, y, cout, cout, 1)
                cin = cout
            out = bb.emit_output(_classifier_head(net, y, 512, classes))
        bb.emit_func_output(out)
    return bb.get()


def _attention(net: _Weights, h, batch: int, seq: int, hidden: int, heads: int):
    bb, head_dim = net.bb, hidden // heads

    def heads_first(t):
        t = bb.emit(R.reshape(t, (batch, seq, heads, head_dim)))
        return bb.emit(R.permute_dims(t, [0, 2, 1, 3]))

    q, k, v = (heads_first(net.dense(h, hidden, hidden)) for _ in range(3))
    scores = bb.emit(R.matmul(q, bb.emit(R.permute_dims(k, [0, 1, 3, 2]))))
    scores = bb.emit(R.multiply(scores, relax.const(1.0 / np.sqrt(head_dim), "float32")))
    context = bb.emit(R.matmul(bb.emit(R.nn.softmax(scores, axis=-1)), v))
    context = bb.emit(R.permute_dims(context, [0, 2, 1, 3]))
    return net.dense(bb.emit(R.reshape(context, (batch, seq, hidden))), hidden, hidden)


def bert_encoder(batch: int = 1, seq_len: int = 128, hidden: int = 256, heads: int = 4, layers: int = 4,
                 vocab: int = 1000, seed: int = 0) -> tvm.IRModule:
    """A BERT-style encoder: token and position embeddings, then attention + GELU FFN blocks with layer norm."""
    bb = relax.BlockBuilder()
    ids = relax.Var("input_ids", relax.TensorType((batch, seq_len), "int64"))
    with bb.function("main", [ids]):
        with bb.dataflow():
            net = _Weights(bb, seed)
            h = bb.emit(R.take(net.const((vocab, hidden), 0.5), ids, axis=0))
            h = net.layer_norm(bb.emit(R.add(h, net.const((seq_len, hidden), 0.5))), hidden)
            for _ in range(layers):
                h = net.layer_norm(bb.emit(R.add(h, _attention(net, h, batch, seq_len, hidden, heads))), hidden)
                ffn = bb.emit(R.nn.gelu(net.dense(h, hidden, 4 * hidden)))
                h = net.layer_norm(bb.emit(R.add(h, net.dense(ffn, 4 * hidden, hidden))), hidden)
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()


def _projection(rows: int, size: int, seed: int) -> tvm.IRModule:
    """main(x: rows x size) = x @ W, W a constant size x size weight."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, size), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            net = _Weights(bb, seed)
            out = bb.emit_output(R.matmul(x, net.const((size, size), np.sqrt(1.0 / size))))
        bb.emit_func_output(out)
    return bb.get()


def matmul(batch: int = 1, size: int = 1024, seed: int = 0) -> tvm.IRModule:
    """One (batch*size) x size x size matmul against a constant weight: the kernel-level benchmark."""
    return _projection(batch * size, size, seed)


def linear(batch: int = 1, size: int = 4096, seed: int = 0) -> tvm.IRModule:
    """One batch x size by size x size projection against a constant weight: a transformer layer at decode time
    (batch-1 rows), where reading the weight sets the speed."""
    return _projection(batch, size, seed)


def _runtime_matmul(batch: int, rows: int, depth: int, columns: int) -> tvm.IRModule:
    """main(a: batch x rows x depth, b: batch x depth x columns) = a @ b, both operands runtime tensors."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((batch, rows, depth), "float32"))
    b = relax.Var("b", relax.TensorType((batch, depth, columns), "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(R.matmul(a, b))
        bb.emit_func_output(out)
    return bb.get()


def attention_scores(batch: int = 1, heads: int = 12, tokens: int = 197, head_size: int = 64) -> tvm.IRModule:
    """Attention's Q.K^T as a matmul of two runtime tensors: (batch*heads) x tokens x head_size by (batch*heads) x
    head_size x tokens (ViT-B/16's shape by default)."""
    return _runtime_matmul(batch * heads, tokens, head_size, tokens)


def runtime_matmul(batch: int = 1, size: int = 1024) -> tvm.IRModule:
    """One batch x size x size by batch x size x size matmul whose operands are both runtime tensors."""
    return _runtime_matmul(batch, size, size, size)


def resnet18_conv(batch: int = 1, channels: int = 128, image_size: int = 28, seed: int = 0) -> tvm.IRModule:
    """One 3x3 conv layer of ResNet-18's second stage (128 channels at 28x28) with its ReLU."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, channels, image_size, image_size), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            net = _Weights(bb, seed)
            out = bb.emit_output(R.nn.relu(net.conv(x, channels, channels, 3)))
        bb.emit_func_output(out)
    return bb.get()


MODELS: dict[str, Callable[..., tvm.IRModule]] = {
    "small_cnn": small_cnn,
    "resnet18": resnet18,
    "resnet18_conv": resnet18_conv,
    "bert": bert_encoder,
    "matmul": matmul,
    "linear": linear,
    "attention_scores": attention_scores,
    "runtime_matmul": runtime_matmul,
}


def get_model(name: str, **options) -> tvm.IRModule:
    """Build the built-in model `name` (see MODELS) with keyword options such as batch."""
    if name not in MODELS:
        raise OptionError(f"unknown built-in model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](**options)


def example_inputs(mod: tvm.IRModule, seed: int = 0, func: str = "main") -> list[np.ndarray]:
    """Random inputs for every parameter of `func`: normal floats, integers in [0, INT_INPUT_HIGH), integer masks
    (a parameter named *mask*: attention masks, from which decoders compute positions) all ones."""
    rng = np.random.default_rng(seed)
    inputs = []
    for param in get_function(mod, func).params:
        shape = static_input_shape(param)
        dtype = str(param.ty.dtype)
        integral = dtype.startswith("int") or dtype.startswith("uint")
        if integral and "mask" in param.name.lower():
            inputs.append(np.ones(shape, dtype))
        elif integral:
            inputs.append(rng.integers(0, INT_INPUT_HIGH, shape).astype(dtype))
        else:
            inputs.append(rng.standard_normal(shape).astype(dtype))
    return inputs
