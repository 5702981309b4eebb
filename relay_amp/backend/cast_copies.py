"""CastsPerReader: a cast that several fusible functions read, computed in each of them instead of stored once.

Operator fusion joins an elementwise op to its reader only where it has one reader, or where all its readers meet
in elementwise ops before any other kind. A cast of a bf16 tensor to fp32 that two ops of a pool's or norm's function
read (EfficientFormer's pooling mixer, x + scale * (pool(x) - x), reads x twice) is neither: it runs as a function
of its own that stores the fp32 copy, twice the bytes of the tensor, for the other to read back. A cast costs one
conversion per value read, so here each reader (an elementwise, broadcast, injective or reducing function, which
fusion joins a cast to) gets a copy of its own, computed where it reads the tensor, where that moves fewer bytes
(`_copies_pay`: any widening cast; a rounding to bf16 read twice). EfficientFormer-L1 (timm, 224x224)
in bf16 on Zen 5, one process: its 8 pooling mixers' cast functions gone, B/A 0.970, outputs bit-identical.

A rounding that fusion joins to the function computing its input (a layer norm whose result only the rounding
reads) is stored by that function in bf16, so copies of it never pay there: PVT-v2's and SegFormer's norms feed
a projection and, as an image, a strided conv, and copies had made each norm store fp32 and each reshape a
function of its own rounding it (PVT-v2-B0: 12 such functions).
"""

import tvm
from tvm import relax

from .._ir import binding_readers, called_prim_func, only_store, rewrite_each_function

MAX_FUSIBLE_PATTERN = 3  # relax's kCommReduce: fusion joins an elementwise producer to functions up to this pattern
MAX_ABSORBING_PATTERN = 4  # relax's kOutEWiseFusable: fusion joins an elementwise reader to functions up to this one
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
    producers = {binding.var: binding.value for block in func.body.blocks for binding in block.bindings}

    def copies_pay(binding: relax.Binding) -> bool:
        bits = _cast_bits(_called(mod, binding.value))
        return bits is not None and _copies_pay(bits, len(readers.get(binding.var, [])),
                                                _absorbed(mod, binding.value, producers, readers))

    return {binding.var for block in func.body.blocks for binding in block.bindings
            if copies_pay(binding) and all(_fusible(mod, reader) for reader in readers[binding.var])}


def _absorbed(mod: tvm.IRModule, cast: relax.Call, producers: dict, readers: dict) -> bool:
    """Whether fusion joins the cast call `cast` to the function that computes its input (a layer norm's, whose
    result only the cast reads), so that the cast stores nothing of its own."""
    data = cast.args[1].fields[0]
    pattern = _pattern(mod, producers[data]) if data in producers else None
    return pattern is not None and pattern <= MAX_ABSORBING_PATTERN and len(readers.get(data, [])) == 1


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


def _copies_pay(bits: "tuple[int, int] | None", readers: int, absorbed: bool = False) -> bool:
    """Whether `readers` copies of a cast of (input, output) `bits` move fewer bytes than the cast does: than its
    function moves and its readers read of its result (a widening cast's copies always; a narrowing one's from 32
    to 16 bits only with two readers: GroupNormsOverChannels' three sums of a kernel's result rounded to bf16 read
    it rounded once), or, where the cast is `absorbed` into the function computing its input, than that function
    stores and the readers read (only a widening cast's: a layer norm rounded to bf16 stores and gives half the
    bytes, where copies would store its fp32 result and each read that)."""
    if bits is None or not 2 <= readers <= MAX_READERS:
        return False
    source, result = bits
    if absorbed:
        return source < result
    return readers * source < source + result + readers * result


@tvm.transform.module_pass(opt_level=0, name="relay_amp.CastsPerReader")
class CastsPerReader:
    """Every cast function's call that 2 to MAX_READERS fusible functions (elementwise to reducing) read, and nothing
    else, copied into each reader's arguments where that moves fewer bytes, so fusion joins a copy to each."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function of `mod`."""
        return rewrite_each_function(mod, _CastCopier)
