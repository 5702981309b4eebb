"""Quantize: calibrated post-training int8 for convolutions and matmuls, the rest in a fallback dtype.

Each quantized layer (conv2d, conv1d or matmul) becomes `conv(codes(x), W8, out_dtype=int32)` and one multiply by
its scales: weights are symmetric int8 per output channel (or per tensor), computed on the host; activations
become int8 codes by `floor(x / s + 0.5)`, clipped, with s from calibration (uint8 where calibration saw no
negative input, which is the operand VNNI's `vpdpbusd` takes directly), or per row at run time for `dynamic`
matmuls. Every op left in floating point then goes through AMP in the fallback dtype.

An input whose negative side is short (after GELU, SiLU or hardswish: down to -0.17, -0.28, -0.375) gets uint8
codes `floor(x / s + z + 0.5)` with a zero point z instead, where that halves symmetric int8's step or nearly:
symmetric codes spend half their levels on a side the input barely reaches. The layer then subtracts z times
each output channel's weight-code sum (a per-channel constant the kernels' epilogue adds), and a padded conv's
codes are padded with z (the code of 0.0) by a pad op. wav2vec2's feature encoder in int8 (16 calibration
inputs): output cosine to fp32 0.9972 with symmetric codes, 0.9988 with zero points (ONNX Runtime's dynamic
int8: 0.9986); EfficientNet-B0 int8q top-1 agreement 27 -> 28 of 32, largest error 0.095 -> 0.064.

Any other signed input (`activation_dtype="auto"`) gets symmetric int8's step and codes offset by 128: uint8
codes around zero point 128, which the kernels read as they are. As int8 codes the kernels shifted them to uint8
in a pass of their own and subtracted the shift's products in int32 in their epilogue; now the zero point's
products join the layer's bias, and the layer before writes codes it need not floor (see
relay_amp.backend.cpu.affine). MobileNetV2's expansions read its projections' signed outputs: int8q 1.98 -> 1.80
ms on Emerald Rapids in one process, top-1 agreement unchanged.

A conv in groups of fewer than MIN_KERNEL_GROUP_WIDTH output channels (a depthwise conv), which no dot-product
kernel takes, multiplies its codes by its weight codes held in fp32 and accumulates in fp32: exact, as every
partial sum is an integer below 2^24, and its input is read in one byte instead of the fallback's two.
`quantize` makes one int8 only where its input is unsigned (after a ReLU or ReLU6: MobileNetV2 int8q 1.87 -> 1.71
ms on Zen 4, top-1 agreement unchanged); after a SiLU the symmetric codes spend half their levels on a side it
barely reaches (EfficientNet-B0 lost 4-5 of 32 top-1 agreements, and its expansion kernels' int8 stores cost more
than the bf16 depthwise saved), so there it stays in the fallback.

A mixture of experts' product by every expert (the dense form: each routed row reads only its own expert's
outputs) is int8 where the current target, else the host, has AVX-512 VNNI (relay_amp.targets.int8_expert_products):
the CPU backend's expert kernel computes it for the routed rows alone on vpdpbusd. Elsewhere it stays in the
fallback, where the kernel does the same in bf16 (in int8 every expert's products would be computed).

With `quantized_residuals` (the default), an add of two tensors reads the value of an operand's uint8 codes where
a layer quantizes that operand (a ResNet block's input after its ReLU, added back at its end), as ONNX Runtime's
QDQ models do. The tensor then has no fp32 reader left, so the kernel that computes it stores only its codes, and
the add's kernel reads them (a quarter of fp32's bytes): ResNet-50 int8q on Zen 4 11.05 -> 10.73 ms, its 18
separate requantize functions gone; top-1 agreement with fp32 unchanged (32/32), largest error 0.022 -> 0.023.
A signed operand's codes have a zero point (offset int8 codes, or a short negative side's), which the add
subtracts: the linear bottlenecks of MobileNetV2, EfficientNet and GhostNet, whose block outputs are added back
unactivated.

With `activation_bits="auto"` (the default), unsigned inputs get 7-bit codes (0 to 127) where the current target,
else the host, multiplies bytes only with AVX2's vpmaddubsw (relay_amp.targets.seven_bit_codes): its int16 sums of
two uint8 x int8 products cannot overflow on 7-bit codes, so the CPU backend takes them a byte each where it
widens 8-bit codes to int16 (ResNet-50 int8q on Zen 3: 0.77x the time, largest error 0.021 -> 0.024). Only inputs
whose RMS is at least SEVEN_BIT_RMS of their threshold do, and signed inputs keep 8 bits: MobileNetV3-Large lost
top-1 agreements to 7 bits on both. Dynamic matmuls' per-row codes are 7-bit there too, offset to uint8 around zero
point 64 (BERT int8q 0.79x the time, output cosine to fp32 0.99985 -> 0.99957).

With `bias_correction` (the default), calibration also measures each input channel's mean, and each layer takes out
the mean error its weights' rounding makes over such inputs, in the per-channel constant its epilogue adds anyway
(relay_amp.passes.quantize.bias): on Zen 3, 32 random inputs, ResNet-50 int8q's largest error against fp32 0.024 ->
0.015 (ONNX Runtime's static int8: 0.023), EfficientNet-B0's 0.051 -> 0.044.

With `shared_ranges` (the default), layers whose inputs are moves of one value (a split's halves and their concat,
a concat and its max pools) share one range (relay_amp.passes.quantize.shared), so the CPU backend computes the
codes once, in the kernels that make the values, and moves bytes.
"""

from collections.abc import Iterable
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import tvm
from tvm import relax

from ..._expert_matmuls import expert_products
from ..._folding import fold_constants
from ..._ir import clamped, get_function, rewrite_function, tensor_dtype, tensor_shape, with_attr
from ...dtypes import check_choice
from ...errors import LayerIndexError, OptionError
from ...ops import canonical_ops
from ...targets import int8_expert_products, seven_bit_codes
from ..amp import to_mixed_precision
from ..batch_norm import FoldBatchNorm
from ..casts import eliminate_redundant_casts
from ..layers import layer_bindings, list_layers, resolve_layers
from ..ranges import layer_input, observe
from .bias import ChannelMeans, input_channel_axis, rounding_shift, weight_axes
from .observers import DEFAULT_PERCENTILE, OBSERVERS, Histogram, merged, threshold
from .plan import DYNAMIC, SHARED_RANGE, STATIC_DTYPES, QuantEntry, QuantPlan, code_levels, zero_point_position
from .shared import MAX_WIDENING, moved_input_groups

CONVOLUTIONS = ("relax.nn.conv2d", "relax.nn.conv1d")  # conv1d: audio front ends (the CPU backend runs it as conv2d)
QUANTIZABLE_OPS = (*CONVOLUTIONS, "relax.matmul")
# the narrowest groups (output channels) the int8 kernels take: four of them share a 16-lane block of outputs; wider
# ones fill blocks or are padded to them (relay_amp.backend.cpu.kernels.grouped_weight). Those (RegNet's 8 or 24,
# ResNeXt's 4 to 32) are quantized as any conv: in the fp32 sums on TVM's schedule, RegNetY-400MF's grouped convs
# took 15.6 of its 19 ms.
MIN_KERNEL_GROUP_WIDTH = 4
WEIGHT_GRANULARITIES = ("per_channel", "per_tensor")
# auto: uint8 where calibration saw no negative input, uint8 with a zero point where the negative side is short (after
# GELU, SiLU, hardswish), else int8; symmetric: no zero points (uint8 or int8); int8: int8 everywhere
ACTIVATION_DTYPES = ("auto", "symmetric", "int8")
SKEWED = 0.75  # a zero point is taken where its step is under this share of symmetric int8's
FALLBACK_DTYPES = ("float32", "bfloat16", "float16")
FALLBACK = "fallback"
ROUTED_ROWS = ("an expert layer's product by every expert, of which only each routed row's own expert's is read: in the "
               "fallback, the CPU backend computes only those (relay_amp.backend.cpu.experts)")
INT8_MAX = 127  # weight codes: symmetric int8
# activation codes' bits: 8, or 7 where 8-bit codes would saturate the target's byte products
# (relay_amp.targets.seven_bit_codes); auto: 7 for unsigned and per-row codes where the current target (else the
# host) is such a target (see _activation_bits)
ACTIVATION_BITS = (7, 8)
# auto gives an unsigned input 7-bit codes only where its RMS is at least this share of its threshold, so that their
# rounding noise (step^2 / 12, the step threshold / 127) stays under 1/44 of the RMS: ResNet-50's ReLU outputs
# measured 0.10-0.21 of theirs; MobileNetV3-Large's early ReLU outputs 0.056-0.098, and 7 bits there had cost it
# top-1 agreements
SEVEN_BIT_RMS = 0.1


def int8_offset(bits: int) -> int:
    """What signed `bits`-bit codes are offset by to become uint8 codes of the same step (128 for 8 bits), the
    operand vpdpbusd takes."""
    return 2 ** (bits - 1)


def unquantizable(call: relax.Call) -> str | None:
    """Why a conv2d/conv1d/matmul call cannot run in int8 here, or None when it can."""
    data, weight = call.args[:2]
    if tensor_dtype(data) != "float32":
        return f"its input is {tensor_dtype(data)}, not float32"
    if not isinstance(weight, tvm.ir.expr.Constant) or tensor_dtype(weight) != "float32":
        return "its second operand is not a float32 constant"
    if call.op.name == "relax.matmul" and weight.value.numpy().ndim != 2:
        return "a batched weight"
    return None


def _narrow_grouped_conv(call: relax.Call) -> bool:
    """Whether `call` is a convolution in groups narrower than MIN_KERNEL_GROUP_WIDTH output channels (a depthwise
    convolution): no dot-product kernel takes one."""
    if call.op.name not in CONVOLUTIONS or int(call.attrs.groups) == 1:
        return False
    out_channels = tensor_shape(call.args[1])[str(call.attrs.kernel_layout).index("O")]
    return out_channels // int(call.attrs.groups) < MIN_KERNEL_GROUP_WIDTH


def _residual_add(call: relax.Call) -> bool:
    """Whether `call` adds two tensors that are not constants (a residual connection's add)."""
    return (call.op.same_as(tvm.ir.Op.get("relax.add"))
            and not any(isinstance(arg, tvm.ir.expr.Constant) for arg in call.args))


def quantizable_ops(ops: Iterable[str], caller: str) -> tuple[str, ...]:
    """`ops` canonicalized, or an OptionError naming the first one `caller` cannot make int8."""
    ops = canonical_ops(ops)
    for op in ops:
        if op not in QUANTIZABLE_OPS:
            raise OptionError(f"{caller} cannot quantize {op}: it quantizes {list(QUANTIZABLE_OPS)}")
    return ops


def quantize_weight(weight: np.ndarray, channel_axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes of `weight` and their scales, one per index of `channel_axis` (one in all if None)."""
    axes = tuple(a for a in range(weight.ndim) if a != channel_axis)
    peak = np.abs(weight).max(axis=axes, keepdims=True).astype("float64")
    scales = np.where(peak > 0, peak / INT8_MAX, 1.0)
    codes = np.clip(np.rint(weight / scales), -INT8_MAX, INT8_MAX).astype("int8")
    return codes, scales.reshape(-1)


def _channel_axes(call: relax.Call) -> tuple[int, int]:
    """The output-channel axis of the call's weight and of its result."""
    if call.op.name == "relax.matmul":
        return weight_axes(call)[0], len(tensor_shape(call)) - 1
    return weight_axes(call)[0], str(call.attrs.out_layout or call.attrs.data_layout).index("C")


class _LayerCodes(NamedTuple):
    """A quantized layer's input as uint8 codes: value = (codes - zero_point) * step."""

    codes: relax.Var
    step: float
    zero_point: int


@relax.expr_functor.mutator
class _Realizer(relax.PyExprMutator):
    """Rewrites the chosen calls into int8 calls between activation codes and one dequantizing multiply."""

    def __init__(self, mod: tvm.IRModule, entries: dict[relax.Call, QuantEntry], per_channel: bool,
                 quantized_residuals: bool):
        super().__init__(mod)
        self.entries = entries
        self.per_channel = per_channel
        self.quantized_residuals = quantized_residuals
        self.layer_codes: dict[relax.Var, _LayerCodes] = {}  # in this block: a quantized layer's input -> its codes

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        self.layer_codes.clear()  # another block's dataflow vars are out of scope
        return super().visit_dataflow_block_(block)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if _residual_add(new_call):
            return relax.Call(new_call.op, [self._dequantized(arg) for arg in new_call.args], new_call.attrs)
        entry = self.entries.get(call)
        if entry is None or not entry.quantized:
            return new_call
        data, weight = new_call.args
        weight_axis, out_axis = _channel_axes(call)
        codes, weight_scales = quantize_weight(weight.value.numpy(), weight_axis if self.per_channel else None)
        rounding = self._rounding_shift(call, weight.value.numpy(), codes, weight_scales, weight_axis, entry)
        exact = self.builder_.emit(relax.op.astype(data, "float32"))  # see _codes
        zero_point = entry.zero_point
        if entry.dtype == DYNAMIC:  # per-row int8 codes, or 7-bit ones offset to uint8 as a signed input's static ones
            row_scale = self.builder_.emit(relax.op.divide(relax.op.max(relax.op.abs(exact), axis=-1, keepdims=True),
                                                           relax.const(float(code_levels("int8", entry.bits)))))
            row_scale = self.builder_.emit(relax.op.maximum(row_scale, relax.const(np.finfo("float32").tiny)))
            zero_point = int8_offset(entry.bits) if entry.bits < 8 else 0
            activations = self._codes(relax.op.divide(exact, row_scale), "uint8" if zero_point else "int8", zero_point,
                                      entry.bits)
            scale = row_scale
        else:
            step = entry.step
            activations = self._codes(relax.op.multiply(exact, relax.const(1.0 / step)), entry.dtype, entry.zero_point,
                                      entry.bits)
            if self.quantized_residuals and entry.dtype == "uint8" and isinstance(data, relax.Var):
                self.layer_codes[data] = _LayerCodes(activations, step, entry.zero_point)
            if entry.zero_point:
                activations, new_call = self._padded_with_zero_point(new_call, activations, entry.zero_point)
            weight_scales, scale = weight_scales * step, None
        shape = [1] * len(tensor_shape(call))
        shape[out_axis] = -1 if self.per_channel else 1
        real = relax.op.multiply(self._accumulated(new_call, activations, codes),
                                 relax.const(weight_scales.reshape(shape).astype("float32")))
        # per output channel, added before a row's scale: the zero point's products (zero_point x the channel's
        # weight-code sum) and, for static codes, the weights' rounding error; for per-row codes that comes after
        sums = codes.astype("int64").sum(axis=tuple(a for a in range(codes.ndim) if a != weight_axis))
        before_scale = -zero_point * sums * np.broadcast_to(weight_scales, sums.shape)
        shape[out_axis] = -1  # one per output channel, whatever the weights' granularity
        if scale is None:
            return self._channel_constant(real, before_scale - rounding, shape)
        real = self._channel_constant(real, before_scale, shape)
        return self._channel_constant(relax.op.multiply(self.builder_.emit(real), scale), -rounding, shape)

    @staticmethod
    def _rounding_shift(call: relax.Call, weight: np.ndarray, codes: np.ndarray, weight_scales: np.ndarray,
                        weight_axis: int, entry: QuantEntry) -> np.ndarray:
        """Per output channel (along `weight_axis` of the weight), the mean output error of the weights' rounding
        over calibration's inputs (zero where the entry has no input means: see relay_amp.passes.quantize.bias)."""
        if not entry.input_means:
            return np.zeros(weight.shape[weight_axis])
        shape = [1] * weight.ndim
        shape[weight_axis] = -1
        return rounding_shift(call, weight, codes * weight_scales.reshape(shape), entry.input_means)

    def _channel_constant(self, real: relax.Expr, values: np.ndarray, shape: list[int]) -> relax.Expr:
        """`real` plus one constant per output channel (`values`, reshaped to `shape`), or `real` itself where they
        are all zero."""
        if not values.any():
            return real
        return relax.op.add(self.builder_.emit(real), relax.const(values.reshape(shape).astype("float32")))

    def _padded_with_zero_point(self, call: relax.Call, activations: relax.Expr, zero_point: int):
        """A conv's codes padded with its zero point (the code of 0.0) by a pad op, and the conv without padding;
        a matmul or an unpadded conv as they are."""
        padding = [int(p) for p in call.attrs.padding] if call.op.name in CONVOLUTIONS else []
        if not any(padding):
            return activations, call
        spatial = len(padding) // 2  # conv2d: [top, left, bottom, right]; conv1d: [left, right]
        sides = {axis: (padding[i], padding[i + spatial]) for i, axis in enumerate("HW"[-spatial:])}
        widths = [width for axis in str(call.attrs.data_layout) for width in sides.get(axis, (0, 0))]
        padded = self.builder_.emit(relax.op.nn.pad(activations, widths, pad_value=float(zero_point)))
        return padded, relax.Call(call.op, call.args, with_attr(call.attrs, padding=[0] * len(padding)))

    def _dequantized(self, operand: relax.Expr) -> relax.Expr:
        """A residual add's operand: the value of its uint8 codes where a layer quantized it, else itself."""
        if operand not in self.layer_codes:
            return operand
        codes = self.layer_codes[operand]
        real = self.builder_.emit(relax.op.astype(codes.codes, "float32"))
        if codes.zero_point:
            real = self.builder_.emit(relax.op.subtract(real, relax.const(float(codes.zero_point), "float32")))
        return self.builder_.emit(relax.op.multiply(real, relax.const(codes.step, "float32")))

    def _accumulated(self, call: relax.Call, activations: relax.Expr, codes: np.ndarray) -> relax.Expr:
        """The layer over activation and weight codes, as fp32: int32 sums cast, or a narrow grouped conv's fp32
        sums."""
        if _narrow_grouped_conv(call):
            attrs = with_attr(call.attrs, out_dtype="float32")
            return self.builder_.emit(relax.Call(call.op, [activations, relax.const(codes.astype("float32"))], attrs))
        attrs = with_attr(call.attrs, out_dtype="int32")
        return relax.op.astype(self.builder_.emit(relax.Call(call.op, [activations, relax.const(codes)], attrs)),
                               "float32")

    def _codes(self, scaled: relax.Expr, dtype: str, zero_point: int = 0, bits: int = 8) -> relax.Expr:
        """Activations already divided by their step, shifted by the zero point, rounded and clipped to `dtype`'s
        codes.

        The activations are cast to float32 first, a cast that is a no-op here: AMP, which runs after, computes an op
        in the fallback dtype where its input is in it, and bf16's 8 significant bits would round x / s to whole
        codes above 128 (a half-code step above 64) before floor(x + 0.5) does, up to a whole code off.

        floor(x + 0.5) rounds as a vector instruction (round's half-away-from-zero is a libm call per element);
        maximum and minimum clip with layout inference (clip has none: an NHWC build would transpose around it)."""
        low = -code_levels("int8", bits) if dtype == "int8" else 0
        offset = relax.const(zero_point + 0.5)
        rounded = relax.op.floor(self.builder_.emit(relax.op.add(self.builder_.emit(scaled), offset)))
        clipped = self.builder_.emit(clamped(self.builder_, self.builder_.emit(rounded), low, code_levels(dtype, bits)))
        return self.builder_.emit(relax.op.astype(clipped, dtype))


def prepared(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` as quantize numbers its layers: batch norms folded into convs, weight transposes folded."""
    return fold_constants(FoldBatchNorm()(mod))


def apply_quant_plan(mod: tvm.IRModule, plan: QuantPlan) -> tvm.IRModule:
    """Quantize `mod` as `plan` says (a saved, possibly hand-edited plan) without calibrating again."""
    return realize_prepared(prepared(mod), plan)


def realize_prepared(mod: tvm.IRModule, plan: QuantPlan) -> tvm.IRModule:
    """`apply_quant_plan` for a module `prepared` already (callers that numbered its layers, or apply many plans)."""
    layers, bindings = list_layers(mod, plan.ops, plan.func), layer_bindings(mod, plan.ops, plan.func)
    chosen = {}
    for entry in plan.entries:
        if not 0 <= entry.index < len(layers) or (layers[entry.index].op, layers[entry.index].name) != (
                entry.op, entry.name):
            raise LayerIndexError(f"quantization plan entry {entry.index} ({entry.op} {entry.name!r}) does not "
                                  "match this module's layers: quantize this module")
        call = bindings[entry.index].value
        _check_entry(entry, call)
        chosen[call] = entry
    _one_of(plan.weight_granularity, WEIGHT_GRANULARITIES, "weight_granularity")
    realizer = _Realizer(mod, chosen, plan.weight_granularity == "per_channel", plan.quantized_residuals)
    realized = rewrite_function(realizer, mod, plan.func)
    if plan.fallback_dtype == "float32":  # the codes' float32 casts are of float32 values: removed
        return plan.attach(eliminate_redundant_casts(realized))
    fallback = check_choice(plan.fallback_dtype, FALLBACK_DTYPES, "fallback_dtype")
    return plan.attach(to_mixed_precision(realized, fallback, func=plan.func))  # AMP removes them where it can


def _check_entry(entry: QuantEntry, call: relax.Call) -> None:
    """Raise OptionError or LayerIndexError where a plan's entry cannot be realized on the layer `call`."""
    reason = unquantizable(call) if entry.quantized else None
    if reason:
        raise OptionError(f"layer {entry.index} ({entry.op} {entry.name!r}) cannot be int8: {reason}")
    shape = tensor_shape(call.args[0]) or ()
    channels = shape[input_channel_axis(call)] if shape else None
    if entry.input_means and isinstance(channels, int) and len(entry.input_means) != channels:
        raise LayerIndexError(f"quantization plan entry {entry.index} ({entry.op} {entry.name!r}) has "
                              f"{len(entry.input_means)} input means; the layer's input has {channels} channels: "
                              "quantize this module")
    if entry.bits not in ACTIVATION_BITS:
        raise OptionError(f"layer {entry.index} ({entry.op} {entry.name!r}): activation codes of {entry.bits!r} "
                          f"bits; they have {' or '.join(map(str, ACTIVATION_BITS))}")


@tvm.transform.module_pass(opt_level=0, name="relay_amp.Quantize")
class Quantize:
    """Pass form of `quantize`; the QuantPlan is stored on the output module."""

    def __init__(self, dataset: Iterable, *, ops: Iterable[str] = QUANTIZABLE_OPS, observer: str = "minmax",
                 percentile: float = DEFAULT_PERCENTILE, weight_granularity: str = "per_channel",
                 activation_dtype: str = "auto", excluded_layers: Iterable[int | str] | None = None,
                 fallback_dtype: str = "bfloat16", dynamic_matmuls: bool = False, quantized_residuals: bool = True,
                 shared_ranges: bool = True, activation_bits: "int | str" = "auto", bias_correction: bool = True,
                 func: str = "main"):
        self.ops = quantizable_ops(ops, "quantize")
        self.observer = _one_of(observer, OBSERVERS, "observer")
        self.percentile = float(percentile)
        if not 0 < self.percentile <= 100:
            raise OptionError(f"percentile must be in (0, 100], got {percentile!r}")
        self.weight_granularity = _one_of(weight_granularity, WEIGHT_GRANULARITIES, "weight_granularity")
        self.activation_dtype = _one_of(activation_dtype, ACTIVATION_DTYPES, "activation_dtype")
        self.activation_bits = _activation_bits(activation_bits)
        self.bits_by_range = activation_bits == "auto"  # 7 only where an input's values fill its codes (see _decide)
        self.excluded_layers = list(excluded_layers or ())
        self.fallback_dtype = check_choice(fallback_dtype, FALLBACK_DTYPES, "fallback_dtype")
        self.dynamic_matmuls = bool(dynamic_matmuls)
        self.quantized_residuals = bool(quantized_residuals)
        self.shared_ranges = bool(shared_ranges)
        self.bias_correction = bool(bias_correction)
        self.func = func
        self.dataset = list(dataset)

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Calibrate, decide every layer, realize; the input module is left as it was."""
        ready = prepared(mod)
        return realize_prepared(ready, self.plan(ready))

    def plan(self, mod: tvm.IRModule) -> QuantPlan:
        """The decisions for a prepared module: calibration's thresholds, exclusions and fallbacks."""
        get_function(mod, self.func)
        layers, bindings = list_layers(mod, self.ops, self.func), layer_bindings(mod, self.ops, self.func)
        routed = set() if int8_expert_products() else expert_products(get_function(mod, self.func))
        kept = {layer.index: ROUTED_ROWS for layer, binding in zip(layers, bindings) if binding.var in routed}
        kept.update(dict.fromkeys(resolve_layers(layers, self.excluded_layers), "excluded"))
        histograms, means = self._calibrate(mod, layers, bindings)
        entries = [self._decide(layer, binding.value, histogram, kept.get(layer.index))
                   for layer, binding, histogram in zip(layers, bindings, histograms)]
        inputs = [binding.value.args[0] for binding in bindings]
        for group in moved_input_groups(get_function(mod, self.func), inputs) if self.shared_ranges else []:
            static = [index for index in group if entries[index].dtype in STATIC_DTYPES]
            self._share_range(static, layers, bindings, histograms, entries)
        if self.bias_correction:
            entries = [replace(entry, input_means=channels.means) if entry.quantized else entry
                       for entry, channels in zip(entries, means)]
        return QuantPlan(list(self.ops), self.observer, self.weight_granularity, self.fallback_dtype, self.func,
                         entries, self.quantized_residuals)

    def _calibrate(self, mod: tvm.IRModule, layers: list,
                   bindings: list) -> tuple[list[Histogram], list[ChannelMeans]]:
        """One run over the dataset: per layer, a histogram of its input and its input channels' means."""
        histograms = [Histogram() for _ in layers]
        means = [ChannelMeans(input_channel_axis(binding.value)) for binding in bindings]
        for number, inputs in enumerate(observe(mod, self.dataset, self.ops, self.func, take=layer_input)):
            for layer, histogram, channels, values in zip(layers, histograms, means, inputs):
                if not np.isfinite(values).all():
                    raise OptionError(f"calibration batch {number}: the input of layer {layer.index} ({layer.op} "
                                      f"{layer.name!r}) holds NaN or inf")
                histogram.add(values)
                channels.add(values)
        return histograms, means

    def _share_range(self, members: list[int], layers: list, bindings: list, histograms: list[Histogram],
                     entries: list[QuantEntry]) -> None:
        """Give the static int8 layers `members`, whose inputs are moves of common values, one range: their merged
        histogram's, where it decides them alike and is at most MAX_WIDENING times each one's own threshold."""
        if len(members) < 2:
            return
        common = merged([histograms[index] for index in members])
        shared = [self._decide(layers[index], bindings[index].value, common, None) for index in members]
        decisions = {(entry.dtype, entry.threshold, entry.zero_point, entry.bits) for entry in shared}
        if len(decisions) > 1 or shared[0].dtype not in STATIC_DTYPES or any(
                shared[0].threshold > MAX_WIDENING * entries[index].threshold for index in members):
            return
        names = ", ".join(str(index) for index in members)
        for index, entry in zip(members, shared):
            entries[index] = replace(entry, reason=f"{entry.reason}; {SHARED_RANGE} {names}")

    def _decide(self, layer, call: relax.Call, histogram: Histogram, kept: "str | None") -> QuantEntry:
        """The plan's entry for `layer` (`call`), its input's `histogram` calibrated; `kept`: why it stays in the
        fallback regardless (excluded, or an expert layer's), if it does."""
        unsigned_bits, signed_bits, dynamic_bits = self.activation_bits

        def entry(dtype: str, limit: float, reason: str, zero_point: int = 0, bits: int = 8) -> QuantEntry:
            return QuantEntry(layer.index, layer.op, layer.name, dtype, float(limit), reason, zero_point, bits)

        reason = unquantizable(call)
        if reason:
            return entry(FALLBACK, 0.0, f"not quantizable: {reason}")
        if kept:
            return entry(FALLBACK, 0.0, kept)
        if self.dynamic_matmuls and layer.op == "relax.matmul":
            return entry(DYNAMIC, 0.0, "dynamic: per-row scales at run time", bits=dynamic_bits)
        if _narrow_grouped_conv(call) and histogram.signed:
            return entry(FALLBACK, 0.0, "grouped convolution of a signed input (kept in the fallback, see realize)")
        dtype = "uint8" if self.activation_dtype != "int8" and not histogram.signed else "int8"
        bits = unsigned_bits if dtype == "uint8" else signed_bits
        limit = threshold(histogram, self.observer, code_levels(dtype, bits), self.percentile)
        if bits < 8 and self.bits_by_range and histogram.rms < SEVEN_BIT_RMS * limit:
            bits = 8
            limit = threshold(histogram, self.observer, code_levels(dtype, bits), self.percentile)
        symmetric = entry(dtype, limit, f"calibrated: {self.observer}", bits=bits)
        if dtype == "uint8" or self.activation_dtype != "auto":
            return symmetric
        offset = entry("uint8", limit, f"calibrated: {self.observer}, zero point {int8_offset(bits)}: int8's codes "
                       "offset to uint8", int8_offset(bits), bits)  # symmetric's step
        shifted = self._zero_pointed(histogram, bits)
        if shifted is None:
            return offset
        shifted_limit, zero_point = shifted
        candidate = entry("uint8", shifted_limit, f"calibrated: {self.observer}, zero point {zero_point}", zero_point,
                          bits)
        return candidate if candidate.step < SKEWED * symmetric.step else offset

    def _zero_pointed(self, histogram: Histogram, bits: int) -> "tuple[float, int] | None":
        """(threshold, zero point) of `bits`-bit uint8 codes over [lowest value seen, the observer's threshold],
        None where that range has no negative side."""
        levels = code_levels("uint8", bits)
        limit = threshold(histogram, self.observer, levels, self.percentile)
        low = max(histogram.minimum, -limit)
        if limit <= 0 or low >= 0:
            return None
        return limit, min(int(np.rint(zero_point_position(low, limit, bits))), levels - 1)


def _activation_bits(bits: "int | str") -> tuple[int, int, int]:
    """`activation_bits` resolved to the bits of unsigned codes (a ReLU's output), of signed ones (codes with a
    zero point) and of dynamic matmuls' per-row codes: 7 or 8 as given; for "auto", 7, 8 and 7 where
    `seven_bit_codes` holds for the current target (else the host's preset: unsigned codes then take the byte
    kernel, where their values fill them: SEVEN_BIT_RMS; signed static ones, after hardswish or GELU, lost more to 7
    bits than ReLUs' did: MobileNetV3-Large's top-1 agreement 20 -> 13 of 32; per-row codes span each row), else 8."""
    if bits == "auto":
        seven = 7 if seven_bit_codes() else 8
        return seven, 8, seven
    if isinstance(bits, bool) or bits not in ACTIVATION_BITS:
        raise OptionError(f"activation_bits must be \"auto\" or one of {list(ACTIVATION_BITS)}, got {bits!r}")
    return int(bits), int(bits), int(bits)


def _one_of(value: str, allowed: tuple[str, ...], option: str) -> str:
    if value not in allowed:
        raise OptionError(f"{option} must be one of {list(allowed)}, got {value!r}")
    return value


def quantize(mod: tvm.IRModule, dataset: Iterable, **options) -> tvm.IRModule:
    """Calibrated int8 for `mod`'s convs and matmuls on `dataset` (input batches); options as Quantize's."""
    return Quantize(dataset, **options)(mod)
