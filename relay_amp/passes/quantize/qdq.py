"""realize_qdq: a model quantized elsewhere (QuantizeLinear/DequantizeLinear pairs, as ONNX Runtime's static
quantizer and PyTorch's exporters write them) compiled on relay_amp's int8 convolutions and matmuls.

TVM's ONNX importer turns QDQ into `relax.quantize` / `relax.dequantize`. The range of each quantize -> dequantize
pair in front of a conv or matmul becomes that layer's activation threshold; every pair is then removed, and
the dequantizes of constant weights and biases fold into fp32 constants. What is left is the QuantPlan quantize
would have made from those ranges, realized by apply_quant_plan: the model's own codes, as uint8 around its zero
point (a signed int8 range shifted by 128), where the range is 8-bit codes of one scale, else symmetric int8 over
the larger side, and
symmetric per-channel weights re-derived from the model's (the same codes where its weights are symmetric per
channel, as ONNX Runtime writes them). A pair whose scale the model computes at run time (DynamicQuantizeLinear,
ONNX Runtime's dynamic quantization) makes its matmul a dynamic one, with per-row scales at run time.
"""

from collections.abc import Iterable

import numpy as np
import tvm
from tvm import relax

from ..._dead_code import EliminateDeadCode
from ..._ir import clamped, get_function, rewrite_function, tensor_dtype
from ...dtypes import MODEL_FLOAT_DTYPES, check_choice
from ...errors import ModuleError
from ..layers import layer_bindings, list_layers, op_bindings
from .plan import DYNAMIC, QuantEntry, QuantPlan, zero_point_position
from .realize import (FALLBACK, FALLBACK_DTYPES, QUANTIZABLE_OPS, prepared, quantizable_ops, realize_prepared,
                      unquantizable)

QDQ_OBSERVER = "qdq"  # the plan's thresholds are the model's own ranges


def _is_op(expr: relax.Expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def _constant(expr: relax.Expr) -> np.ndarray | None:
    return expr.value.numpy().astype("float64") if isinstance(expr, tvm.ir.expr.Constant) else None


def _pair_quantize(dequantize: relax.Expr, bound) -> relax.Call | None:
    """The quantize call of a dequantize(quantize(x)) pair on a float x with one scale and zero point, or None;
    `bound` looks a variable's bound value up (or returns None)."""
    if not _is_op(dequantize, "relax.dequantize"):
        return None
    quantize = bound(dequantize.args[0])
    if not _is_op(quantize, "relax.quantize") or tensor_dtype(quantize.args[0]) not in MODEL_FLOAT_DTYPES:
        return None
    for quantized_arg, dequantized_arg in zip(quantize.args[1:], dequantize.args[1:]):
        values = _constant(quantized_arg), _constant(dequantized_arg)
        same_value = quantized_arg.same_as(dequantized_arg) and values[0] is None
        if not same_value and (values[0] is None or values[1] is None or not np.array_equal(*values)):
            return None
    return quantize


def _is_dynamic(quantize: relax.Call) -> bool:
    """Whether a pair's scale is computed at run time."""
    return _constant(quantize.args[1]) is None


def code_range(quantize: relax.Call) -> tuple[float, float]:
    """The real values a quantize call's codes stand for: (lowest, highest) over its scales and zero points."""
    info = np.iinfo(tensor_dtype(quantize))
    scale, zero = _constant(quantize.args[1]), _constant(quantize.args[2])
    return float(((info.min - zero) * scale).min()), float(((info.max - zero) * scale).max())


def input_ranges(mod: tvm.IRModule, ops: Iterable[str] = QUANTIZABLE_OPS, func: str = "main"
                 ) -> list[tuple[float, float] | str | None]:
    """Per layer of `ops` (the shared layer index), the range of the QDQ pair its input comes through, DYNAMIC
    where the pair's scale is computed at run time, or None where there is no pair."""
    values = {binding.var: binding.value for binding in op_bindings(mod, func)}
    ranges = []
    for binding in layer_bindings(mod, ops, func):
        data = binding.value.args[0]
        quantize = _pair_quantize(values.get(data, data), values.get)
        if quantize is None:
            ranges.append(None)
        else:
            ranges.append(DYNAMIC if _is_dynamic(quantize) else code_range(quantize))
    return ranges


@relax.expr_functor.mutator
class _PairRemover(relax.PyExprMutator):
    """Replaces dequantize(quantize(x)) by x clamped to the range its codes stand for (ONNX Runtime folds a ReLU
    or ReLU6 into that range and removes the op), or by x where the range is computed at run time (it holds all
    of x); the unused quantize is removed after."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        quantize = _pair_quantize(new_call, self._bound)
        if quantize is None:
            return new_call
        if _is_dynamic(quantize):
            return quantize.args[0]
        return clamped(self.builder_, quantize.args[0], *code_range(quantize))

    def _bound(self, expr: relax.Expr) -> relax.Expr | None:
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) else None


def strip_qdq(mod: tvm.IRModule, func: str = "main") -> tvm.IRModule:
    """`mod` without its activation quantize -> dequantize pairs (the float model they were inserted into), each
    pair's clipping kept as a clamp."""
    stripped = rewrite_function(_PairRemover(mod), mod, func)
    return EliminateDeadCode()(relax.transform.CanonicalizeBindings()(stripped))


def _entry(layer, call: relax.Call, value_range: tuple[float, float] | None) -> QuantEntry:
    reason = unquantizable(call)
    if reason:
        return QuantEntry(layer.index, layer.op, layer.name, FALLBACK, 0.0, f"not quantizable: {reason}")
    if value_range is None:
        return QuantEntry(layer.index, layer.op, layer.name, FALLBACK, 0.0, "no QDQ pair on its input")
    if value_range == DYNAMIC:
        if layer.op != "relax.matmul":
            return QuantEntry(layer.index, layer.op, layer.name, FALLBACK, 0.0,
                              "its input's scale is computed at run time: dynamic int8 covers matmuls")
        return QuantEntry(layer.index, layer.op, layer.name, DYNAMIC, 0.0, "dynamic: per-row scales at run time")
    low, high = value_range
    zero_point = _zero_point(low, high)
    if low >= 0 or zero_point is not None:
        return QuantEntry(layer.index, layer.op, layer.name, "uint8", high, "from the model's QuantizeLinear",
                          zero_point or 0)
    return QuantEntry(layer.index, layer.op, layer.name, "int8", max(-low, high), "from the model's QuantizeLinear")


def _zero_point(low: float, high: float) -> int | None:
    """The uint8 code of 0.0 where [low, high] (low < 0 < high) is what 255 steps of 8-bit codes stand for (the
    model's own uint8 codes around a zero point, or int8 ones shifted by 128), else None."""
    if not low < 0 < high:
        return None
    position = zero_point_position(low, high)
    return int(np.rint(position)) if abs(position - np.rint(position)) < 1e-3 else None


def realize_qdq(mod: tvm.IRModule, ops: Iterable[str] = QUANTIZABLE_OPS, fallback_dtype: str = "bfloat16",
                func: str = "main") -> tvm.IRModule:
    """Compile a QDQ-quantized model's convs and matmuls to int8 with the model's ranges; the rest in
    `fallback_dtype`. The QuantPlan (observer "qdq") is stored on the result as quantize stores it."""
    get_function(mod, func)
    ops = quantizable_ops(ops, "realize_qdq")
    ranges = input_ranges(mod, ops, func)
    if not any(ranges):
        raise ModuleError(f"{func} has no QuantizeLinear/DequantizeLinear pair in front of a {'/'.join(ops)} "
                          "call: it is not a QDQ model (calibrate it with relay_amp.quantize)")
    stripped = strip_qdq(mod, func)
    ready = prepared(stripped)
    entries = [_entry(layer, binding.value, value_range) for layer, binding, value_range in
               zip(list_layers(ready, ops, func), layer_bindings(ready, ops, func), ranges)]
    plan = QuantPlan(list(ops), QDQ_OBSERVER, "per_channel",
                     check_choice(fallback_dtype, FALLBACK_DTYPES, "fallback_dtype"), func, entries)
    return realize_prepared(ready, plan)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.RealizeQDQ")
class RealizeQDQ:
    """Pass form of `realize_qdq`."""

    def __init__(self, ops: Iterable[str] = QUANTIZABLE_OPS, fallback_dtype: str = "bfloat16", func: str = "main"):
        self.ops, self.fallback_dtype, self.func = tuple(ops), fallback_dtype, func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """The realized module; the input module is left as it was."""
        return realize_qdq(mod, self.ops, self.fallback_dtype, self.func)
