"""Conv1dAsConv2d: a channels-last conv1d as a conv2d over a unit height, which the dot-product kernels take.

Audio front ends (wav2vec2, HuBERT, Whisper) are stacks of conv1d. ConvertLayout puts them into NWC with the
conv2ds (relay_amp.passes.layout); [N, W, C] reshaped to [N, 1, W, C] is the same memory, so each one becomes an
NHWC conv2d between two free reshapes and runs on relay_amp's kernels, not on TVM's generic conv1d schedule.
"""

import tvm
from tvm import relax
from tvm.relax import dpl

from ..._ir import tensor_shape


@relax.transform.function_pass(opt_level=0, name="relay_amp.Conv1dAsConv2d")
class Conv1dAsConv2d:
    """Every NWC/WIO conv1d of static shape as an NHWC/HWIO conv2d of height 1 between reshapes."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
        """`func` with its channels-last conv1ds rewritten; the input module is left as it was."""
        data, weight = dpl.wildcard(), dpl.wildcard()

        def rewrite(call: relax.Call, matches: dict) -> relax.Expr:
            return _as_conv2d(call, matches[data], matches[weight]) if _is_channels_last(call) else call

        return dpl.rewrite_call(dpl.is_op("relax.nn.conv1d")(data, weight), rewrite, func)


def _is_channels_last(call: relax.Call) -> bool:
    attrs = call.attrs
    shapes = [tensor_shape(expr) for expr in (*call.args, call)]
    return ((attrs.data_layout, attrs.kernel_layout, attrs.out_layout) == ("NWC", "WIO", "NWC")
            and all(shape is not None for shape in shapes))


def _as_conv2d(call: relax.Call, data: relax.Expr, weight: relax.Expr) -> relax.Expr:
    attrs = call.attrs
    batch, width, channels = tensor_shape(data)
    padding = [int(pad) for pad in attrs.padding]
    conv = relax.op.nn.conv2d(relax.op.reshape(data, (batch, 1, width, channels)),
                              relax.op.reshape(weight, (1, *tensor_shape(weight))),
                              strides=(1, int(attrs.strides[0])), padding=(0, padding[0], 0, padding[1]),
                              dilation=(1, int(attrs.dilation[0])), groups=int(attrs.groups), data_layout="NHWC",
                              kernel_layout="HWIO", out_dtype=attrs.out_dtype)
    return relax.op.reshape(conv, tensor_shape(call))
