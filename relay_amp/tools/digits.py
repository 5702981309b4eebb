"""A small CNN trained on scikit-learn's handwritten digits (8x8), shipped as ONNX with its held-out split.

`python -m relay_amp.tools.digits` retrains it deterministically and rewrites the two files in
relay_amp/data/ (needs the `train` extra: scikit-learn and torch).
"""

from pathlib import Path

import numpy as np
import tvm

from ..frontend import from_onnx

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
MODEL_FILE = DATA_DIR / "digits_cnn.onnx"
TEST_FILE = DATA_DIR / "digits_test.npz"
PIXEL_MAX = 16.0  # scikit-learn's digits are 4-bit intensities
SEED = 0


def load_model(batch: int = 50) -> tvm.IRModule:
    """The trained digits CNN as a Relax module taking (batch, 1, 8, 8) float32 images."""
    return from_onnx(MODEL_FILE, shape_dict={"image": [batch, 1, 8, 8]})


def load_overflowing_model(batch: int = 50, scale: float = 1e5) -> tvm.IRModule:
    """The digits CNN with conv2 scaled by `scale` and a multiply by 1/scale after it.

    Exact in fp32, but conv2's outputs exceed float16's range (65504): the layer an accuracy
    search or the range guard must keep in fp32 (layer 1 of list_layers).
    """
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(MODEL_FILE)
    for init in model.graph.initializer:
        if init.name in ("conv2.w", "conv2.b"):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(scale), init.name))
    model.graph.initializer.append(numpy_helper.from_array(np.array(1.0 / scale, "float32"), "unscale"))
    relu = next(node for node in model.graph.node if list(node.input) == ["c2"])
    relu.input[0] = "c2_unscaled"
    position = list(model.graph.node).index(relu)
    model.graph.node.insert(position, helper.make_node("Mul", ["c2", "unscale"], ["c2_unscaled"]))
    return from_onnx(model, shape_dict={"image": [batch, 1, 8, 8]})


def load_outlier_model(batch: int = 50, channel: int = 0, scale: float = 1e3) -> tvm.IRModule:
    """The digits CNN with conv1's output `channel` scaled by `scale` and conv2's weights on it by 1/scale.

    Exact in fp32 (ReLU commutes with a positive scale), but conv2 reads one channel `scale` times larger than
    the rest, the outlier that makes per-tensor int8 activations round every other channel to zero: the layer
    an int8 accuracy search must keep out of int8 (layer 1 of list_layers).
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(MODEL_FILE)
    factors = {"conv1.w": (scale, 0), "conv1.b": (scale, 0), "conv2.w": (1.0 / scale, 1)}
    for init in model.graph.initializer:
        if init.name in factors:
            factor, axis = factors[init.name]
            values = numpy_helper.to_array(init).copy()
            values[(slice(None),) * axis + (channel,)] *= np.float32(factor)
            init.CopyFrom(numpy_helper.from_array(values, init.name))
    return from_onnx(model, shape_dict={"image": [batch, 1, 8, 8]})


def load_test_split() -> tuple[np.ndarray, np.ndarray]:
    """The held-out test images, (N, 1, 8, 8) float32 in [0, 1], and their int64 labels."""
    with np.load(TEST_FILE) as data:
        return (data["images"].astype("float32") / PIXEL_MAX)[:, None], data["labels"].astype("int64")


def batches(images: np.ndarray, labels: np.ndarray, size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split into full batches of `size` (a remainder is dropped: the module has a static batch)."""
    count = len(images) // size
    return [(images[i * size:(i + 1) * size], labels[i * size:(i + 1) * size]) for i in range(count)]


def _train(epochs: int = 60):
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=0.25, random_state=SEED, stratify=digits.target)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3, padding=1),
        torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(256, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )
    images = torch.tensor(x_train[:, None] / PIXEL_MAX, dtype=torch.float32)
    targets = torch.tensor(y_train)
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(epochs):
        for start in range(0, len(images), 64):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(images[start:start + 64]), targets[start:start + 64])
            loss.backward()
            optimizer.step()
    weights = [p.detach().numpy() for p in net.parameters()]
    return weights, x_test.astype("uint8"), y_test.astype("uint8")


def _to_onnx(weights: list[np.ndarray]):
    from onnx import TensorProto, helper, numpy_helper

    names = ["conv1.w", "conv1.b", "conv2.w", "conv2.b", "fc1.w", "fc1.b", "fc2.w", "fc2.b"]
    nodes = [
        helper.make_node("Conv", ["image", "conv1.w", "conv1.b"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "conv2.w", "conv2.b"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("Gemm", ["f", "fc1.w", "fc1.b"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("Gemm", ["hr", "fc2.w", "fc2.b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "digits_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(w.astype("float32"), n) for n, w in zip(names, weights)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="relay_amp.digits")


def main() -> None:
    """Retrain the classifier and rewrite relay_amp/data/ (model and held-out split), atomically."""
    import io
    import os

    from ..runtime import compile_module, run_executable
    from ..serialization import atomic_write_bytes

    weights, test_images, test_labels = _train()
    atomic_write_bytes(MODEL_FILE, _to_onnx(weights).SerializeToString())
    buffer = io.BytesIO()
    np.savez_compressed(buffer, images=test_images, labels=test_labels)
    atomic_write_bytes(TEST_FILE, buffer.getvalue())
    images, labels = load_test_split()
    executable = compile_module(load_model())
    logits = np.concatenate([run_executable(executable, [x])[0] for x, _ in batches(images, labels, 50)])
    print(f"wrote {MODEL_FILE.name} and {TEST_FILE.name} to {os.path.relpath(DATA_DIR)}; "
          f"fp32 test accuracy {(logits.argmax(1) == labels[:len(logits)]).mean():.4f}")


if __name__ == "__main__":
    main()
