"""The shared layer index: one numbering of op calls that every relay_amp pass uses."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import tvm
from tvm import relax

from .._ir import get_function, tensor_dtype, tensor_shape
from ..errors import LayerIndexError
from ..ops import call_op_name, canonical_ops

DEFAULT_LAYER_OPS = ("relax.nn.conv2d", "relax.matmul")


@dataclass(frozen=True)
class Layer:
    """One call of a selected op, numbered in the binding order of its function."""

    index: int
    op: str
    name: str
    input_shapes: tuple
    input_dtypes: tuple
    output_shape: tuple | None
    output_dtype: str | None


@relax.expr_functor.visitor
class _BindingCollector(relax.PyExprVisitor):
    """Records every variable binding of a function in program order (nested blocks included)."""

    def __init__(self):
        super().__init__()
        self.bindings: list[relax.VarBinding] = []

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        super().visit_var_binding_(binding)
        self.bindings.append(binding)


def _bindings(func: relax.Function) -> list[relax.VarBinding]:
    collector = _BindingCollector()
    collector.visit_expr(func)
    return collector.bindings


def op_bindings(mod: tvm.IRModule, func: str = "main") -> list[relax.VarBinding]:
    """Every binding of `func` whose value calls a Relax op, in program order."""
    return [b for b in _bindings(get_function(mod, func)) if call_op_name(b.value) is not None]


def layer_bindings(mod: tvm.IRModule, ops: Iterable[str], func: str = "main") -> list[relax.VarBinding]:
    """The bindings whose value calls one of `ops`, in layer-index order."""
    wanted = set(canonical_ops(ops))
    return [b for b in _bindings(get_function(mod, func)) if call_op_name(b.value) in wanted]


def _tensor_inputs(call: relax.Call) -> list[relax.Expr]:
    inputs = []
    for arg in call.args:
        inputs.extend(arg.fields if isinstance(arg, relax.Tuple) else [arg])
    return [arg for arg in inputs if tensor_dtype(arg) is not None]


def _describe(index: int, binding: relax.VarBinding) -> Layer:
    call = binding.value
    inputs = _tensor_inputs(call)
    return Layer(
        index=index,
        op=call.op.name,
        name=binding.var.name,
        input_shapes=tuple(tensor_shape(arg) for arg in inputs),
        input_dtypes=tuple(tensor_dtype(arg) for arg in inputs),
        output_shape=tensor_shape(call),
        output_dtype=tensor_dtype(call),
    )


def list_layers(mod: tvm.IRModule, ops: Iterable[str] = DEFAULT_LAYER_OPS, func: str = "main") -> list[Layer]:
    """The layers of `func`: calls of `ops` numbered in binding order."""
    return [_describe(i, b) for i, b in enumerate(layer_bindings(mod, ops, func))]


def count_layers(mod: tvm.IRModule, ops: Iterable[str] = DEFAULT_LAYER_OPS, depth: bool = False, func: str = "main") -> int:
    """The number of layers; with depth=True the longest chain of them (parallel layers count once)."""
    if not depth:
        return len(layer_bindings(mod, ops, func))
    wanted = set(canonical_ops(ops))
    chain: dict[relax.Var, int] = {}
    for binding in _bindings(get_function(mod, func)):
        upstream = [chain.get(var, 0) for var in relax.analysis.free_vars(binding.value)]
        own = 1 if call_op_name(binding.value) in wanted else 0
        chain[binding.var] = max(upstream, default=0) + own
    return max(chain.values(), default=0)


def resolve_layers(layers: Sequence[Layer], selectors: Iterable[int | str] | None) -> set[int]:
    """Turn indices (negative from the end) and binding names into a set of layer indices."""
    chosen: set[int] = set()
    for selector in selectors or ():
        chosen |= _resolve_one(layers, selector)
    return chosen


def _resolve_one(layers: Sequence[Layer], selector: int | str) -> set[int]:
    count = len(layers)
    if isinstance(selector, str):
        found = {layer.index for layer in layers if layer.name == selector}
        if not found:
            raise LayerIndexError(f"no layer is named {selector!r} (names: {[l.name for l in layers]})")
        return found
    if isinstance(selector, bool) or not isinstance(selector, int):
        raise LayerIndexError(f"layer selector {selector!r} must be an int index or a binding name")
    if not -count <= selector < count:
        valid = f"{-count}..{count - 1}" if count else "none: the module has no such layers"
        raise LayerIndexError(f"layer index {selector} is out of range for {count} layers (valid: {valid})")
    return {selector % count}
