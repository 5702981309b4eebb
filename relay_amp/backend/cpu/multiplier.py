"""RepeatMultiplierInputs: a depthwise conv with a channel multiplier as a depthwise conv of repeated channels.

A grouped conv with one input channel per group and m > 1 output channels per group (a channel multiplier:
FastViT's and MobileOne's downsampling convs, Keras' `depth_multiplier`) reads input channel o // m for output
channel o. The generic schedule vectorizes over output channels, so each vector of inputs became a gather: a 7x7
conv from 64x64x48 to 32x32x96 took 0.61 ms in fp32 and 0.88 in bf16, where a plain 7x7 depthwise conv over
32x32x96 (the same products) takes 0.05. With the input's channels repeated m times (a copy in one pass), it is
a plain depthwise conv with the same weight, whose vectors load contiguous channels.
"""

import tvm
from tvm import relax
from tvm.relax import dpl

from ..._ir import tensor_shape, with_attr


@relax.transform.function_pass(opt_level=0, name="relay_amp.RepeatMultiplierInputs")
class RepeatMultiplierInputs:
    """Every conv2d with one input channel per group and several output channels per group as a depthwise conv2d
    of its input with each channel repeated."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
        """`func` with its channel-multiplier convs rewritten; the input module is left as it was."""
        data, weight = dpl.wildcard(), dpl.wildcard()

        def rewrite(call: relax.Call, matches: dict) -> relax.Expr:
            multiplier = _channel_multiplier(call)
            if multiplier is None:
                return call
            axis = str(call.attrs.data_layout).index("C")
            repeated = relax.op.repeat(matches[data], multiplier, axis=axis)
            return relax.Call(call.op, [repeated, matches[weight]],
                              with_attr(call.attrs, groups=int(call.attrs.groups) * multiplier))

        return dpl.rewrite_call(dpl.is_op("relax.nn.conv2d")(data, weight), rewrite, func)


def _channel_multiplier(call: relax.Call) -> "int | None":
    """m where `call` is a conv2d of static shape with one input channel per group and m > 1 outputs per group."""
    attrs, data_shape, out_shape = call.attrs, tensor_shape(call.args[0]), tensor_shape(call)
    if data_shape is None or out_shape is None:
        return None
    channels = data_shape[str(attrs.data_layout).index("C")]
    outputs = out_shape[str(attrs.out_layout).index("C")]
    groups = int(attrs.groups)
    if groups == 1 or channels != groups or outputs % groups or outputs == groups:
        return None
    return outputs // groups
