"""Conv3dAsConv2d: a channels-last conv3d as one conv2d over its frames, its depth taps stacked as channels.

Video models (torchvision's R3D, MC3, R(2+1)D) and volumetric ones are stacks of conv3d, which no relay_amp kernel
takes: TVM's generic schedule ran torchvision's R3D-18 over 8 frames of 112x112 in 267 ms in fp32 and 414 ms in bf16
on Zen 4. ConvertLayout puts them into NDHWC with the conv2ds (relay_amp.passes.layout). Output frame d of a conv3d
with kd depth taps reads input frames d * stride + t * dilation, t < kd; concatenated along the channels, those kd
frames are one frame of kd x C channels, and the weight's depth taps the same kd x C input channels of a conv2d's
weight. So [N, D, H, W, C] becomes the kd strided frame slices concatenated ([N, D', H, W, kd x C], one pass over kd
copies of the input), a free reshape to [N x D', H, W, kd x C], one NHWC conv2d that runs on the kernels, and a
free reshape back. Depth taps that read only padding are left out, and the frames padded only as far as the taps
kept read (a slice of padding alone, vectorized in bf16, is a shape TVM's bf16 legalization fails on: R3D-18's
stride-2 conv over its last two frames).
"""

import numpy as np
import tvm
from tvm import relax

from ..._ir import rewrite_op_calls, tensor_dtype, tensor_shape
from ...passes.padding_taps import live_taps


def depth_stacked_weight(weight_dhwio: np.ndarray) -> np.ndarray:
    """The HWIO conv2d weight whose input channel t x C + c is the conv3d weight's depth tap t, channel c."""
    taps, rows, cols, ins, outs = weight_dhwio.shape
    return np.ascontiguousarray(weight_dhwio.transpose(1, 2, 0, 3, 4).reshape(rows, cols, taps * ins, outs))


def _as_conv2d(call: relax.Call) -> "relax.Expr | None":
    """The channels-last conv3d `call` over a constant weight as a conv2d over its frames, else None (a grouped
    conv, another layout, a runtime weight or a symbolic shape)."""
    attrs, data, weight = call.attrs, call.args[0], call.args[1]
    shape, out_shape = tensor_shape(data), tensor_shape(call)
    if (str(attrs.data_layout), str(attrs.out_layout)) != ("NDHWC", "NDHWC") or int(attrs.groups) != 1:
        return None
    if not isinstance(weight, tvm.ir.expr.Constant) or shape is None or out_shape is None:
        return None
    dhwio = np.transpose(weight.value.numpy(), [str(attrs.kernel_layout).index(axis) for axis in "DHWIO"])
    front, top, left, _, bottom, right = (int(p) for p in attrs.padding)
    (stride, *strides), (step, *dilation) = ([int(v) for v in attrs.strides], [int(v) for v in attrs.dilation])
    frames = out_shape[1]
    live = live_taps(shape[1], dhwio.shape[0], stride, step, front, frames)
    if live is None:
        return None
    dhwio, front = dhwio[live[0]:live[1] + 1], front - live[0] * step
    ahead = max(0, front)
    behind = max(0, (frames - 1) * stride + (len(dhwio) - 1) * step - front - (shape[1] - 1))
    padded = relax.op.nn.pad(data, [0, 0, ahead, behind, 0, 0, 0, 0, 0, 0]) if ahead or behind else data
    starts = [tap * step - front + ahead for tap in range(len(dhwio))]
    slices = [relax.op.strided_slice(padded, axes=[1], begin=[start], end=[start + (frames - 1) * stride + 1],
                                     strides=[stride]) for start in starts]
    stacked = relax.op.concat(slices, axis=4) if len(slices) > 1 else slices[0]
    flat = relax.op.reshape(stacked, (shape[0] * frames, shape[2], shape[3], shape[4] * len(slices)))
    conv = relax.op.nn.conv2d(flat, relax.const(depth_stacked_weight(dhwio), tensor_dtype(weight)), strides=strides,
                              padding=(top, left, bottom, right), dilation=dilation, data_layout="NHWC",
                              kernel_layout="HWIO", out_dtype=attrs.out_dtype)
    return relax.op.reshape(conv, out_shape)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.Conv3dAsConv2d")
class Conv3dAsConv2d:
    """Every ungrouped NDHWC conv3d over a constant weight as an NHWC conv2d over its frames, depth taps stacked
    as channels."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_op_calls(mod, self.func, {"relax.nn.conv3d": lambda call, _: _as_conv2d(call)})
