"""Sampling positions kept in float32: the ops that compute the positions a grid_sample or a ROI pooling reads.

Those ops are in the fp32 list, but the positions they read are computed before them, by adds and multiplies that
AMP would run in the low dtype: deformable attention's positions are reference points (constants, which never hold
an op in fp32) plus predicted offsets, so a Deformable DETR's positions were rounded to bfloat16 before the sampler
read them, off by up to 1/256 of the map. PyTorch's autocast keeps them fp32 by type promotion (a bf16 offset plus
an fp32 reference is fp32). `sampling_positions` walks back from each position operand through the elementwise and
data-moving ops computing it (the widest and follow lists) to where it starts: a GEMM's output (accumulated in fp32),
a parameter or a constant.
"""

from tvm import relax

from ..._ir import tensor_dtype
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


def _walk_back(expr: relax.Expr, bound: dict, lists: OpLists, kept: dict, reason: tuple) -> None:
    pending = [expr]
    while pending:
        item = pending.pop()
        value = bound.get(item) if isinstance(item, relax.Var) else None
        if value is None or value in kept or lists.category(call_op_name(value)) not in WALKED:
            continue
        kept[value] = reason
        pending.extend(arg for arg in value.args if isinstance(arg, relax.Var) and is_float(tensor_dtype(arg) or ""))
