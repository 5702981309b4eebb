"""CastsPerReader: a cast that several fusible functions read, computed in each of them instead of stored once.

Operator fusion joins an elementwise op to its reader only where it has one reader, or where all its readers meet
in elementwise ops before any other kind. A cast of a bf16 tensor to fp32 that two ops of a pool's or norm's function
read (EfficientFormer's pooling mixer, x + scale * (pool(x) - x), reads x twice) is neither: it runs as a function
of its own that stores the fp32 copy, twice the bytes of the tensor, for the other to read back. A cast costs one
conversion per value read, so here each reader (an elementwise, broadcast, injective or reducing function, which
fusion joins a cast to) gets a copy of its own, computed where it reads the tensor, where that moves fewer bytes
(`_copies_pay`: any widening cast; a rounding to bf16 read twice). EfficientFormer-L1 (timm, 224x224)
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
        self.mod = mod
        self.shared = _shared_casts(mod, func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if called_prim_func(self.mod, new_call) is None:
            return new_call
        fields = list(new_call.args[1].fields)
        copies = [self.builder_.emit(self.lookup_binding(field)) if field in self.shared else field
                  for field in fields]
        if all(copy.same_as(field) for copy, field in zip(copies, fields)):
            return new_call
        return relax.Call(new_call.op, [new_call.args[0], relax.Tuple(copies), *new_call.args[2:]], new_call.attrs,
                          new_call.ty_args)


def _shared_casts(mod: tvm.IRModule, func: relax.Function) -> set[relax.Var]:
    """The vars bound to a cast function's call that fusible functions read, and nothing else, as often as copies
    pay (`_copies_pay`)."""
    readers = binding_readers(func)
    return {binding.var for block in func.body.blocks for binding in block.bindings
            if _copies_pay(_cast_bits(_called(mod, binding.value)), len(readers.get(binding.var, [])))
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


def _cast_bits(func: "tvm.tirx.PrimFunc | None") -> "tuple[int, int] | None":
    """(input bits, output bits) of a value where `func` stores a cast of its one input's value at the same index (a
    legalized astype), else None."""
    store = only_store(func)
    if store is None or len(func.params) != 2 or not isinstance(store.value, tvm.tirx.Cast):
        return None
    load = store.value.value
    if not (isinstance(load, tvm.ir.expr.TensorLoad) and load.source.same_as(func.params[0])
            and all(index.same_as(out) for index, out in zip(load.indices, store.indices))):
        return None
    return tvm.DataType(str(load.ty)).bits, tvm.DataType(str(store.value.ty)).bits


def _copies_pay(bits: "tuple[int, int] | None", readers: int) -> bool:
    """Whether `readers` copies of a cast of (input, output) `bits` read fewer bytes than the cast function moves
    and its readers read of its result: always for a widening cast (bf16 to fp32), for a narrowing one from 32 to
    16 bits only with two readers (GroupNormsOverChannels' three sums of a kernel's result rounded to bf16 read it
    rounded once)."""
    if bits is None or not 2 <= readers <= MAX_READERS:
        return False
    wide, narrow = bits
    return readers * wide < wide + narrow + readers * narrow


@tvm.transform.module_pass(opt_level=0, name="relay_amp.CastsPerReader")
class CastsPerReader:
    """Every cast function's call that 2 to MAX_READERS fusible functions (elementwise to reducing) read, and nothing
    else, copied into each reader's arguments where that moves fewer bytes, so fusion joins a copy to each."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function of `mod`."""
        return rewrite_each_function(mod, _CastCopier)
