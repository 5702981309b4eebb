"""Pooling windows computed in fewer steps than TVM's loop over every window position.

- GlobalPoolWindows: a pooling window that covers its whole input becomes a mean or max over the spatial axes.
  Models pool globally with windows far larger than the feature map (Hugging Face's EfficientNet:
  `AvgPool2d(kernel_size=1280, ceil_mode=True)` on a 7x7 map), which is legal and computes the same as a
  global pool, but TVM's pooling loops over the whole window: 1280 x 1280 positions per output, two seconds for
  one layer. With no padding and a 1x1 output, the window's valid part is the input itself, so the average is
  the spatial mean and the maximum the spatial max.
- SeparableMaxPools: a k x k max pool is a 1 x k max pool of rows, then a k x 1 max pool of its result (each with
  its own axis's stride and padding): the same maximum in 2k comparisons an output instead of k^2. YOLO's spatial
  pyramid pools (5x5 three times in a row; 5, 9 and 13 side by side in YOLOv3/v4) run at stride 1 over whole
  feature maps.
"""

import tvm
from tvm import relax

from .._ir import rewrite_op_calls, tensor_shape

REDUCTIONS = {"relax.nn.avg_pool2d": relax.op.mean, "relax.nn.max_pool2d": relax.op.max}
MIN_SEPARATED_WINDOW = 25  # k x k windows this large or larger pool rows then columns (5x5: 10 comparisons, not 25)


def _spatial_axes(layout: str) -> list[int]:
    return [layout.index("H"), layout.index("W")]


def _is_global(call: relax.Call) -> bool:
    """Whether the window covers the whole unpadded input and leaves one output position."""
    attrs, in_shape, out_shape = call.attrs, tensor_shape(call.args[0]), tensor_shape(call)
    if in_shape is None or out_shape is None or str(attrs.layout) != str(attrs.out_layout):
        return False
    axes = _spatial_axes(str(attrs.layout))
    sizes = [in_shape[axis] for axis in axes]
    if not all(isinstance(size, int) for size in sizes) or any(int(p) for p in attrs.padding):
        return False
    covered = all(int(window) >= size for window, size in zip(attrs.pool_size, sizes))
    return covered and all(out_shape[axis] == 1 for axis in axes) and all(int(d) == 1 for d in attrs.dilation)


def _as_reduction(call: relax.Call, _) -> "relax.Expr | None":
    """A global pool as a spatial mean or max, None for another pool."""
    if not _is_global(call):
        return None
    return REDUCTIONS[call.op.name](call.args[0], axis=_spatial_axes(str(call.attrs.layout)), keepdims=True)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.GlobalPoolWindows")
class GlobalPoolWindows:
    """Rewrite avg/max pools whose window covers the whole input into spatial mean/max reductions."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_op_calls(mod, self.func, dict.fromkeys(REDUCTIONS, _as_reduction))


def _separated(call: relax.Call, _) -> "relax.Expr | None":
    """A max pool of a large window as a pool of rows then a pool of columns, None for another pool."""
    attrs = call.attrs
    (height, width), (stride_h, stride_w) = [int(v) for v in attrs.pool_size], [int(v) for v in attrs.strides]
    if height * width < MIN_SEPARATED_WINDOW or min(height, width) < 2 or any(int(d) != 1 for d in attrs.dilation):
        return None
    top, left, bottom, right = (int(p) for p in attrs.padding)
    common = {"ceil_mode": bool(attrs.ceil_mode), "layout": str(attrs.layout), "out_layout": str(attrs.layout)}
    rows = relax.op.nn.max_pool2d(call.args[0], (1, width), (1, stride_w), (0, left, 0, right), **common)
    return relax.op.nn.max_pool2d(rows, (height, 1), (stride_h, 1), (top, 0, bottom, 0), **{
        **common, "out_layout": str(attrs.out_layout)})


@tvm.transform.module_pass(opt_level=0, name="relay_amp.SeparableMaxPools")
class SeparableMaxPools:
    """Rewrite max pools of windows of MIN_SEPARATED_WINDOW or more into a pool of rows then one of columns."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return rewrite_op_calls(mod, self.func, {"relax.nn.max_pool2d": _separated})
