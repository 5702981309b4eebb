"""Default AMP op lists for float16 and bfloat16: every entry maps an op to the reason it is there.

Categories (as in MXNet AMP):
- target: always computed in the low-precision dtype (the ops that tensor cores and bf16 dot products speed up);
- fp32: always computed in float32 (range or accuracy would suffer);
- widest: computed in the widest float dtype among their non-constant inputs;
- follow: dtype-neutral, computed in low precision as soon as one non-constant input is low.
"""

from dataclasses import dataclass, field

from ...dtypes import LOW_FLOAT_DTYPES, check_choice

CATEGORIES = ("target", "fp32", "widest", "follow")

_GEMM = "a GEMM/convolution: the op low precision exists to speed up, accumulated in accumulation_dtype"
_TARGET = {
    "relax.nn.conv1d": _GEMM,
    "relax.nn.conv2d": _GEMM,
    "relax.nn.conv3d": _GEMM,
    "relax.nn.conv1d_transpose": _GEMM,
    "relax.nn.conv2d_transpose": _GEMM,
    "relax.nn.conv3d_transpose": _GEMM,
    "relax.matmul": _GEMM,
    "relax.einsum": _GEMM,
    "relax.outer": "an outer product: a rank-1 GEMM",
    "relax.nn.attention": "fused attention: two GEMMs with an internal fp32 softmax",
    "relax.nn.attention_bias": "fused attention: two GEMMs with an internal fp32 softmax",
}

_FP32_COMMON = {
    "relax.nn.softmax": "normalizes exponentials: low precision skews small probabilities (PyTorch autocast keeps it fp32)",
    "relax.nn.log_softmax": "a log of a sum of exponentials: loses precision in low precision",
    "relax.nn.layer_norm": "mean/variance statistics over a row: keeping them fp32 cuts BERT error ~20x (shared/PEERS.md)",
    "relax.nn.group_norm": "mean/variance statistics over groups need fp32",
    "relax.nn.instance_norm": "mean/variance statistics over a plane need fp32",
    "relax.nn.rms_norm": "a root-mean-square statistic: the sum of squares needs fp32",
    "relax.variance": "a sum of squared deviations: cancellation needs fp32",
    "relax.std": "a square root of a variance: cancellation needs fp32",
    "relax.power": "arbitrary exponents overflow or underflow a short mantissa",
    "relax.nn.cross_entropy_with_logits": "a loss: a log of small probabilities",
    "relax.nn.nll_loss": "a loss: accumulated over the batch",
    "relax.cumsum": "a running sum: error grows with length",
    "relax.cumprod": "a running product: error grows with length",
    "relax.prod": "a product: error and range grow with length",
    "relax.arange": "its end value may exceed float16's range and its steps lose precision (as in Relay)",
    "relax.image.grid_sample": "sampling positions in [-1, 1]: a bfloat16 one is off by up to 1/256 of the map's "
    "size (0.4 px on a 200-px map), its bilinear weights with it (PyTorch autocast keeps grid_sampler fp32)",
    "relax.image.affine_grid": "computes sampling positions (see grid_sample)",
    "relax.vision.roi_align": "box corners: a bfloat16 one on an 800-px image is off by up to 2 px (torchvision's "
    "autocast runs roi_align in fp32)",
    "relax.vision.roi_pool": "box corners (see roi_align)",
    "relax.vision.multibox_transform_loc": "decodes box corners (see roi_align)",
    "relax.vision.get_valid_counts": "compares scores with a threshold: rounding moves scores across it",
    "relax.vision.non_max_suppression": "compares overlaps and scores: rounding ties and reorders boxes",
    "relax.vision.all_class_non_max_suppression": "compares overlaps and scores (see non_max_suppression)",
    "relax.nn.batch_norm": "statistics stay fp32 (as MXNet keeps BatchNorm params); TVM 0.27 also legalizes "
    "a low-precision batch_norm to a float32 result, which breaks the graph",
}

_FP32_FLOAT16_ONLY = {
    "relax.exp": "overflows float16 beyond x = 11",
    "relax.log": "underflows float16 near zero input",
    "relax.erf": "LLVM has no float16 erf (TVM's Relay kept it fp32 too)",
    "relax.sum": "a long sum overflows float16's 65504 maximum",
    "relax.mean": "its sum overflows float16's 65504 maximum",
    "relax.nn.adaptive_avg_pool2d": "a global sum over a plane overflows float16",
    "relax.nn.adaptive_avg_pool1d": "a global sum overflows float16",
    "relax.nn.adaptive_avg_pool3d": "a global sum overflows float16",
}

_FP32_BFLOAT16_ONLY: dict[str, str] = {}

_BF16_FOLLOWS = "bfloat16 has float32's range, and TVM computes bfloat16 ops in fp32 arithmetic"

_WIDEST = {
    name: "combines tensors elementwise: run in the widest input dtype so no operand loses bits"
    for name in (
        "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.floor_divide",
        "relax.maximum", "relax.minimum", "relax.where", "relax.concat", "relax.stack",
        "relax.equal", "relax.not_equal", "relax.less", "relax.less_equal", "relax.greater",
        "relax.greater_equal", "relax.mod", "relax.floor_mod", "relax.atan2", "relax.nn.prelu",
        "relax.log_add_exp",
    )
}

_CREATE = {
    name: "creates a tensor filled with one value: exact in any float dtype"
    for name in ("relax.zeros", "relax.ones", "relax.full", "relax.zeros_like", "relax.ones_like", "relax.full_like")
}

_FOLLOW = _CREATE | {
    name: "dtype-neutral: moves, selects or maps values without accumulating"
    for name in (
        "relax.nn.relu", "relax.nn.leakyrelu", "relax.nn.silu", "relax.nn.gelu", "relax.nn.gelu_tanh",
        "relax.nn.selu", "relax.nn.softplus", "relax.sigmoid", "relax.tanh", "relax.clip",
        "relax.nn.max_pool1d", "relax.nn.max_pool2d", "relax.nn.max_pool3d", "relax.nn.avg_pool1d",
        "relax.nn.avg_pool2d", "relax.nn.avg_pool3d", "relax.nn.dropout", "relax.nn.pad",
        "relax.nn.batch_flatten", "relax.nn.pixel_shuffle", "relax.reshape", "relax.permute_dims",
        "relax.flatten", "relax.squeeze", "relax.expand_dims", "relax.broadcast_to", "relax.take",
        "relax.strided_slice", "relax.split", "relax.tile", "relax.repeat", "relax.flip",
        "relax.layout_transform", "relax.image.resize2d", "relax.sqrt", "relax.rsqrt", "relax.abs",
        "relax.negative", "relax.square", "relax.sign", "relax.floor", "relax.ceil", "relax.round",
        "relax.max", "relax.min", "relax.argmax", "relax.argmin", "relax.topk", "relax.sort",
        "relax.gather_elements", "relax.gather_nd", "relax.tril", "relax.triu", "relax.sin", "relax.cos",
    )
}


@dataclass(frozen=True)
class OpLists:
    """The four AMP categories, each a mapping from a full Relax op name to its reason."""

    target: dict[str, str] = field(default_factory=dict)
    fp32: dict[str, str] = field(default_factory=dict)
    widest: dict[str, str] = field(default_factory=dict)
    follow: dict[str, str] = field(default_factory=dict)

    def category(self, op: str) -> str | None:
        """The category that lists `op`, None when no list does."""
        return next((name for name in CATEGORIES if op in getattr(self, name)), None)

    def reason(self, op: str) -> str:
        """Why `op` is in its category."""
        category = self.category(op)
        return getattr(self, category)[op] if category else "in no list"


def default_lists(target_dtype: str) -> OpLists:
    """The default op lists for `target_dtype` ("float16" or "bfloat16")."""
    target_dtype = check_choice(target_dtype, LOW_FLOAT_DTYPES, "target_dtype")
    if target_dtype == "float16":
        fp32 = {**_FP32_COMMON, **_FP32_FLOAT16_ONLY}
        follow = dict(_FOLLOW)
    else:
        fp32 = {**_FP32_COMMON, **_FP32_BFLOAT16_ONLY}
        follow = {**{op: _BF16_FOLLOWS for op in _FP32_FLOAT16_ONLY}, **_FOLLOW}
    return OpLists(target=dict(_TARGET), fp32=fp32, widest=dict(_WIDEST), follow=follow)
