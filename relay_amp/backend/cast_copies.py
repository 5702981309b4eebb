"""CastsPerReader: a cast that several fusible functions read, computed in each of them instead of stored once.

Operator fusion joins an elementwise op to its reader only where it has one reader, or where all its readers meet
in elementwise ops before any other kind. A cast of a bf16 tensor to fp32 that two ops of a pool's or norm's function
read (EfficientFormer's pooling mixer, x + scale * (pool(x) - x), reads x twice) is neither: it runs as a function
of its own that stores the fp32 copy, twice the bytes of the tensor, for the other to read back. A cast costs one
conversion per value read, so here each reader (an elementwise, broadcast, injective or reducing function, which
fusion joins a cast to) gets a copy of its own, computed where it reads the tensor. EfficientFormer-L1 (timm, 224x224)
in bf16 on Zen 5, one process: its 8 pooling mixers' cast functions gone, B/A 0.970, outputs bit-identical.
"""

import tvm
from tvm import relax

from .._ir import binding_readers, called_prim_func, only_store, rewrite_each_function

MAX_FUSIBLE_PATTERN = 3  # relax's kCommReduce: fusion joins an elementwise producer to functions up to this pattern
MAX_READERS = 4  # a cast read more often stays one function: each copy converts every value once more


@relax.expr_functor.mutator
class _CastCopier(relax.PyExprMutator):
    """Gives each reader of a shared cast (`_shared_casts`) a copy of the cast of its own."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        super().__init__(mod)
        self.shared = _shared_casts(mod, func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if called_prim_func(self.builder_.get(), new_call) is None:
            return new_call
        fields = list(new_call.args[1].fields)
        copies = [self.builder_.emit(self.lookup_binding(field)) if field in self.shared else field
                  for field in fields]
        if all(copy.same_as(field) for copy, field in zip(copies, fields)):
            return new_call
        return relax.Call(new_call.op, [new_call.args[0], relax.Tuple(copies), *new_call.args[2:]], new_call.attrs,
                          new_call.ty_args)


def _shared_casts(mod: tvm.IRModule, func: relax.Function) -> set[relax.Var]:
    """The vars bound to a cast function's call that 2 to MAX_READERS fusible functions read and nothing else."""
    readers = binding_readers(func)
    return {binding.var for block in func.body.blocks for binding in block.bindings
            if _is_cast(_called(mod, binding.value)) and 2 <= len(readers.get(binding.var, [])) <= MAX_READERS
            and all(_fusible(mod, reader) for reader in readers[binding.var])}


def _fusible(mod: tvm.IRModule, reader: "relax.Binding | None") -> bool:
    """Whether `reader` calls a function fusion joins an elementwise producer to (not the returned expression)."""
    pattern = None if reader is None else _pattern(mod, reader.value)
    return pattern is not None and pattern <= MAX_FUSIBLE_PATTERN


def _called(mod: tvm.IRModule, value: relax.Expr) -> "tvm.tirx.PrimFunc | None":
    """The PrimFunc `value` calls through call_tir, None for anything else."""
    return called_prim_func(mod, value) if isinstance(value, relax.Call) else None


def _pattern(mod: tvm.IRModule, value: relax.Expr) -> "int | None":
    """The op pattern of the function `value` calls through call_tir, None for anything else."""
    func = _called(mod, value)
    pattern = None if func is None else func.attrs.get("op_pattern") if func.attrs else None
    return None if pattern is None else int(pattern)


def _is_cast(func: "tvm.tirx.PrimFunc | None") -> bool:
    """Whether `func` stores a cast of its one input's value at the same index (a legalized astype)."""
    store = only_store(func)
    if store is None or len(func.params) != 2 or not isinstance(store.value, tvm.tirx.Cast):
        return False
    load = store.value.value
    return isinstance(load, tvm.ir.expr.TensorLoad) and load.source.same_as(func.params[0]) and all(
        index.same_as(out) for index, out in zip(load.indices, store.indices))


@tvm.transform.module_pass(opt_level=0, name="relay_amp.CastsPerReader")
class CastsPerReader:
    """Every cast function's call that 2 to MAX_READERS fusible functions (elementwise to reducing) read, and
    nothing else, copied into each reader's arguments, so fusion joins a copy to each."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function of `mod`."""
        return rewrite_each_function(mod, _CastCopier)
