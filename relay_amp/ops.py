"""Operator names: accept `nn.conv2d` or `relax.nn.conv2d`, reject anything that is not a Relax op."""

from collections.abc import Iterable

import tvm
from tvm import relax

from .errors import UnknownOpError

_PREFIX = "relax."
_HINTS = {
    "relax.dense": "Relax has no dense op: frontends emit permute_dims + matmul, use 'matmul'",
    "relax.nn.dense": "Relax has no dense op: frontends emit permute_dims + matmul, use 'matmul'",
    "relax.nn.batch_matmul": "Relax has no batch_matmul op: use 'matmul'",
    "relax.concatenate": "the Relax name is 'concat'",
    "relax.cast": "the Relax name is 'astype'",
}


def _registered_ops() -> frozenset[str]:
    return frozenset(name for name in tvm.ir.Op.list_op_names() if name.startswith(_PREFIX))


def canonical_op(name: str) -> str:
    """Return the full Relax op name (`relax.nn.conv2d`) for `name`, or raise UnknownOpError."""
    if not isinstance(name, str) or not name:
        raise UnknownOpError(f"op names must be non-empty strings, got {name!r}")
    full = name if name.startswith(_PREFIX) else _PREFIX + name
    if full not in _registered_ops():
        hint = _HINTS.get(full, "see tvm.ir.Op.list_op_names() for the Relax ops")
        raise UnknownOpError(f"unknown op {name!r}: {hint}")
    return full


def canonical_ops(names: str | Iterable[str]) -> tuple[str, ...]:
    """Canonicalize a name or a sequence of names, keeping order and dropping repeats."""
    if isinstance(names, str):
        names = [names]
    return tuple(dict.fromkeys(canonical_op(name) for name in names))


def call_op_name(expr: relax.Expr) -> str | None:
    """The op name of a call to a Relax operator, None for anything else."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def bound_call(mutator: relax.PyExprMutator, expr: relax.Expr, op_name: str) -> relax.Call | None:
    """The call of `op_name` bound to the var `expr` (in `mutator`'s builder); None for anything else."""
    bound = mutator.lookup_binding(expr) if isinstance(expr, relax.Var) else None
    return bound if call_op_name(bound) == op_name else None


def bound_value(mutator, expr: relax.Expr) -> "relax.Expr | None":
    """The value the var `expr` is bound to (in `mutator`'s builder, or a block builder; None where it is bound to
    nothing), or `expr` itself where it is not a var."""
    return mutator.lookup_binding(expr) if isinstance(expr, relax.Var) else expr


def tuple_fields(mutator, expr: relax.Expr) -> "list[relax.Expr] | None":
    """The fields of the tuple `expr` is, or the var `expr` is bound to (in `mutator`'s builder, or a block
    builder); None for anything else."""
    bound = bound_value(mutator, expr)
    return list(bound.fields) if isinstance(bound, relax.Tuple) else None


def sliced_by_binding(mutator: relax.PyExprMutator, expr: relax.Expr) -> relax.Expr | None:
    """What the strided_slice bound to the var `expr` (in `mutator`'s builder) slices; None for anything else."""
    bound = bound_call(mutator, expr, "relax.strided_slice")
    return None if bound is None else bound.args[0]
