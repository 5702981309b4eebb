"""Einsums of two tensors as matmuls: transposes and reshapes around one relax.matmul, which the kernels take.

TVM computes relax.einsum (torch.export's) by topi.einsum, and its ONNX importer writes an Einsum node as a call of
that TE function: a generic loop nest that no kernel takes and AMP cannot lower (XLNet's and Longformer's
projections and attention, timm's einsum attention). Each operand's axes are grouped as batch (in both operands
and the output), free (in one operand and the output) and contracted (in both operands only), and the einsum
becomes matmul([batch, free, contracted] x [batch, contracted, free]) reshaped and transposed to the output.
"""

import math

import tvm
from tvm import relax

from ._ir import only_store, rewrite_op_calls, rewrite_te_calls, tensor_dtype, tensor_shape

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def einsums_as_matmuls(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` with every einsum of two tensors (relax.einsum, or a call of a TE einsum as TVM's ONNX importer writes
    one) as transposes and reshapes around one matmul, where every axis has a static size and each operand names
    its axes once."""
    lifted = rewrite_te_calls(mod, func, _as_einsum)
    return rewrite_op_calls(lifted, func, {"relax.einsum": _as_matmul})


def _as_einsum(call: relax.Call, prim_func: tvm.tirx.PrimFunc) -> "relax.Expr | None":
    subscripts = te_einsum_subscripts(prim_func)
    return None if subscripts is None else relax.op.einsum(list(call.args[1].fields), subscripts)


def te_einsum_subscripts(func: "tvm.tirx.PrimFunc | None") -> "str | None":
    """The subscripts ("ij,jk->ik") of a PrimFunc whose one store is out[v...] = out[v...] + a[v...] * b[v...], or
    a[v...] * b[v...] where nothing is contracted, with every index a block variable (topi.einsum of two tensors),
    else None."""
    store = only_store(func)
    if store is None or len(func.params) != 3:
        return None
    product = store.value
    if isinstance(product, tvm.tirx.Add):
        if not _loads(product.a, func.params[2], store.indices):
            return None
        product = product.b
    if not isinstance(product, tvm.tirx.Mul):
        return None
    operands = [product.a, product.b]
    if not all(_loads(load, param) for load, param in zip(operands, func.params[:2])):
        return None
    names: dict = {}
    terms = [_term(indices, names) for indices in (operands[0].indices, operands[1].indices, store.indices)]
    return None if None in terms else f"{terms[0]},{terms[1]}->{terms[2]}"


def _loads(expr, param, indices=None) -> bool:
    """Whether `expr` loads the PrimFunc parameter `param` (at `indices`, where given)."""
    if not isinstance(expr, tvm.ir.expr.TensorLoad) or not expr.source.same_as(param):
        return False
    return indices is None or all(a.same_as(b) for a, b in zip(expr.indices, indices))


def _term(indices, names: dict) -> "str | None":
    """The letters of `indices`, each a variable (letters given in order of first appearance), else None."""
    if not all(isinstance(index, tvm.tirx.Var) for index in indices) or len(names) + len(indices) > len(LETTERS):
        return None
    return "".join(names.setdefault(index, LETTERS[len(names)]) for index in indices)


def _as_matmul(call: relax.Call, builder: relax.BlockBuilder) -> "relax.Expr | None":
    """The matmul form of a relax.einsum of two operands, or None where it has none (see einsums_as_matmuls)."""
    operands = call.args[0].fields if isinstance(call.args[0], relax.Tuple) else None
    plan = _grouped_axes(str(call.attrs.subscripts), operands)
    if plan is None:
        return None
    (lhs, rhs), output, sizes = plan
    batch = [c for c in output if c in lhs and c in rhs]
    left, right = [c for c in output if c not in rhs], [c for c in output if c not in lhs]
    contracted = [c for c in lhs if c in rhs and c not in output]
    a = _grouped(builder, operands[0], lhs, [batch, left, contracted], sizes)
    b = _grouped(builder, operands[1], rhs, [batch, contracted, right], sizes)
    product = relax.op.matmul(a, b, out_dtype=tensor_dtype(call))
    produced = batch + left + right
    shape, order = [sizes[c] for c in produced], [produced.index(c) for c in output]
    if order == sorted(order):  # the last op is the call's replacement, not emitted
        same = shape == _group_sizes([batch, left, right], sizes)
        return product if same else relax.op.reshape(builder.emit(product), shape)
    return relax.op.permute_dims(_reshaped(builder, builder.emit(product), shape), order)


def _grouped_axes(subscripts: str, operands) -> "tuple | None":
    """(operand terms, output term, size per letter), or None for anything but two operands of static shapes that
    name each axis once and sum no axis alone."""
    if operands is None or len(operands) != 2 or "->" not in subscripts or "." in subscripts:
        return None
    inputs, output = subscripts.replace(" ", "").split("->")
    terms = inputs.split(",")
    shapes = [tensor_shape(operand) for operand in operands]
    if len(terms) != 2 or any(s is None or len(s) != len(t) or len(set(t)) != len(t) for s, t in zip(shapes, terms)):
        return None
    sizes = {letter: size for term, shape in zip(terms, shapes) for letter, size in zip(term, shape)}
    if any(not isinstance(size, int) for size in sizes.values()):
        return None
    if any(c not in output and c not in other for term, other in zip(terms, terms[::-1]) for c in term):
        return None  # an axis summed within one operand: left to TVM's einsum
    return terms, output, sizes


def _grouped(builder: relax.BlockBuilder, operand: relax.Expr, term: str, groups: list, sizes: dict) -> relax.Expr:
    """`operand` (axes named by `term`) transposed to the order of `groups` and reshaped to one axis per group
    (the batch group left out where empty)."""
    order = [term.index(c) for group in groups for c in group]
    moved = operand if order == sorted(order) else builder.emit(relax.op.permute_dims(operand, order))
    return _reshaped(builder, moved, _group_sizes(groups, sizes))


def _group_sizes(groups: list, sizes: dict) -> list:
    """One axis per group of letters ([batch, rows, columns] or [batch, rows, depth]), its size their product;
    the batch group left out where empty."""
    shape = [math.prod(sizes[c] for c in group) for group in groups]
    return shape if groups[0] else shape[1:]


def _reshaped(builder: relax.BlockBuilder, expr: relax.Expr, shape: list) -> relax.Expr:
    """`expr` reshaped to `shape`, unless it has that shape."""
    if list(tensor_shape(expr)) == list(shape):
        return expr
    return builder.emit(relax.op.reshape(expr, shape))
