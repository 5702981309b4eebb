"""Writes keras_tiny.onnx and keras_tiny.npz beside this file: a small Keras model built from the layers Keras
applications use (MobileNetV2/V3's ReLU6 and hard-swish, EfficientNet's swish and squeeze-excite, NASNet's
zero-pad-and-crop and separable convs), random weights with batch norm statistics measured on random images,
exported by tf2onnx as TensorFlow users export; and TensorFlow's own fp32 and mixed_bfloat16 outputs.

Not run by the tests (they need no TensorFlow). Written with tensorflow-cpu 2.21.0, keras 3.15, tf2onnx 1.17.0:
`pip install tensorflow-cpu tf2onnx && python tests/data/make_keras_tiny.py`. tf2onnx's transpose optimizer
fails on this graph (logged, not raised) and leaves 18 Transposes, as it does on many Keras models.
"""

import os
from pathlib import Path

import numpy as np

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402
from keras import layers  # noqa: E402

OUT = Path(__file__).with_name("keras_tiny")
SHAPE = (1, 32, 32, 3)


def inverted_residual(x):
    """MobileNetV3/EfficientNet's block: expand, hard-swish, depthwise, swish, squeeze-excite, project, add."""
    y = layers.Activation("hard_swish")(layers.BatchNormalization()(layers.Conv2D(32, 1, use_bias=False)(x)))
    y = layers.BatchNormalization()(layers.DepthwiseConv2D(3, padding="same", use_bias=False)(y))
    y = layers.Activation("swish")(y)
    gate = layers.Conv2D(8, 1, activation="relu")(layers.GlobalAveragePooling2D(keepdims=True)(y))
    y = layers.Multiply()([y, layers.Conv2D(32, 1, activation="hard_sigmoid")(gate)])
    return layers.Add()([x, layers.BatchNormalization()(layers.Conv2D(16, 1, use_bias=False)(y))])


def reduction(x):
    """NASNet's: a separable conv beside the zero-padded, cropped, average-pooled input."""
    separable = layers.SeparableConv2D(24, 3, strides=2, padding="same", use_bias=False)(layers.ReLU()(x))
    pooled = layers.Cropping2D(((1, 0), (1, 0)))(layers.ZeroPadding2D(((0, 1), (0, 1)))(x))
    pooled = layers.Conv2D(24, 1)(layers.AveragePooling2D(3, strides=2, padding="same")(pooled))
    return layers.Concatenate()([layers.BatchNormalization()(separable), pooled])


def build() -> keras.Model:
    """The model, in the current dtype policy."""
    image = keras.Input(SHAPE[1:], name="image")
    x = layers.Rescaling(1 / 127.5, offset=-1)(image)
    x = layers.ReLU(6.0)(layers.BatchNormalization()(layers.Conv2D(16, 3, strides=2, padding="same",
                                                                   use_bias=False)(x)))
    x = reduction(inverted_residual(x))
    x = layers.GlobalAveragePooling2D()(layers.MaxPooling2D(3, strides=2, padding="same")(x))
    return keras.Model(image, layers.Dense(10)(x))


def measure_batch_norms(model: keras.Model) -> None:
    """Set every batch norm's moving statistics to those of 8 random images."""
    for layer in model.layers:
        if isinstance(layer, layers.BatchNormalization):
            layer.momentum = 0.0
    model(np.random.default_rng(1).uniform(0, 255, (8, *SHAPE[1:])).astype("float32"), training=True)


def main() -> None:
    """Build, measure, export, and record TensorFlow's outputs."""
    keras.utils.set_random_seed(0)
    model = build()
    measure_batch_norms(model)
    image = np.random.default_rng(0).uniform(0, 255, SHAPE).astype("float32")
    fp32 = model(image, training=False).numpy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    bf16_model = build()
    bf16_model.set_weights(model.get_weights())
    bf16 = np.asarray(bf16_model(image, training=False)).astype("float32")
    keras.mixed_precision.set_global_policy("float32")
    signature = (tf.TensorSpec(SHAPE, tf.float32, name="image"),)
    tf2onnx.convert.from_function(tf.function(lambda t: model(t, training=False)), input_signature=signature,
                                  opset=17, output_path=str(OUT.with_suffix(".onnx")))
    np.savez(OUT.with_suffix(".npz"), image=image, tf_fp32=fp32, tf_mixed_bfloat16=bf16)


if __name__ == "__main__":
    main()
