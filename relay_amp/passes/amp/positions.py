"""Values a sampler or a choice reads, kept in float32: the ops that compute the positions a grid_sample or a ROI
pooling reads, and the scores a top-k or an argmax chooses from.

Those ops are in the fp32 list, but the positions they read are computed before them, by adds and multiplies that
AMP would run in the low dtype: deformable attention's positions are reference points (constants, which never hold
an op in fp32) plus predicted offsets, so a Deformable DETR's positions were rounded to bfloat16 before the sampler
read them, off by up to 1/256 of the map. PyTorch's autocast keeps them fp32 by type promotion (a bf16 offset plus
an fp32 reference is fp32). `sampling_positions` walks back from each position operand through the elementwise and
data-moving ops computing it (the widest and follow lists) to where it starts: a GEMM's output (accumulated in fp32),
a parameter or a constant.

A mixture of experts' router chooses each token's experts with a top-k (or an argmax) of scores that a small GEMM
computes (sigmoid or softmax of the router's logits). Rounded to bf16, scores a few thousandths apart tie or swap,
and the token goes to other experts: in bf16, DeepSeek-V3-style routers (EXAONE-MoE: sigmoid scores) ran 18x
PyTorch autocast's error, PhiMoE's (an argmax of the logits) 8.6x. Such models compute their routers in fp32 on
purpose (transformers keeps those weights fp32). `routing_scores` keeps fp32 the ops from a choice's scores back to
the GEMM computing them, the GEMM included where its output is narrow (ROUTER_COLUMNS: experts, not a vocabulary).
"""

from tvm import relax

from ..._ir import tensor_dtype, tensor_shape
from ...dtypes import is_float
from ...ops import call_op_name
from .lists import OpLists

POSITION_OPERANDS = {  # op -> the index of its operand holding positions
    "relax.image.grid_sample": 1,
    "relax.vision.roi_align": 1,
    "relax.vision.roi_pool": 1,
}
REASON = "computes the positions {} samples at: kept fp32"
WALKED = ("widest", "follow")
CHOICES = ("relax.topk", "relax.argmax", "relax.argmin")  # ops that choose among their input's values
SCORE_REASON = "computes the scores a top-k or an argmax chooses from (a router's): kept fp32"
SCORES_WALKED = ("widest", "follow", "fp32")
ROUTER_COLUMNS = 512  # a GEMM computing a top-k's scores with at most this many outputs a row is kept fp32 too


def sampling_positions(func: relax.Function, lists: OpLists) -> dict[relax.Call, tuple[str, str]]:
    """The calls of `func` that compute the positions a sampling op reads, each with ("float32", its reason)."""
    bound = {binding.var: binding.value for block in func.body.blocks for binding in block.bindings}
    kept: dict[relax.Call, tuple[str, str]] = {}
    for value in bound.values():
        operand = POSITION_OPERANDS.get(call_op_name(value))
        if operand is not None:
            reason = ("float32", REASON.format(value.op.name.rpartition(".")[2]))
            _walk_back(value.args[operand], bound, lists, kept, reason)
    return kept


def routing_scores(func: relax.Function, lists: OpLists) -> dict[relax.Call, tuple[str, str]]:
    """The calls of `func` that compute the float scores a top-k or an argmax chooses from, back to a narrow GEMM
    (included) or a wide one, each with ("float32", its reason)."""
    bound = {binding.var: binding.value for block in func.body.blocks for binding in block.bindings}
    kept: dict[relax.Call, tuple[str, str]] = {}
    for value in bound.values():
        if call_op_name(value) in CHOICES and is_float(tensor_dtype(value.args[0]) or ""):
            _walk_back(value.args[0], bound, lists, kept, ("float32", SCORE_REASON), SCORES_WALKED, _router_gemm)
    return kept


def _router_gemm(call: relax.Call, lists: OpLists) -> bool:
    """Whether `call` is a GEMM of at most ROUTER_COLUMNS outputs a row."""
    shape = tensor_shape(call) or ()
    return lists.category(call_op_name(call)) == "target" and bool(shape) and isinstance(shape[-1], int) \
        and shape[-1] <= ROUTER_COLUMNS


def _walk_back(expr: relax.Expr, bound: dict, lists: OpLists, kept: dict, reason: tuple,
               walked: tuple = WALKED, last=lambda call, lists: False) -> None:
    """Record `reason` in `kept` for the calls computing `expr` through ops of the `walked` categories, and for
    those `last` accepts, past which the walk stops."""
    pending = [expr]
    while pending:
        item = pending.pop()
        value = bound.get(item) if isinstance(item, relax.Var) else None
        if value is None or value in kept:
            continue
        if lists.category(call_op_name(value)) not in walked:
            if last(value, lists):
                kept[value] = reason
            continue
        kept[value] = reason
        pending.extend(arg for arg in value.args if isinstance(arg, relax.Var) and is_float(tensor_dtype(arg) or ""))
