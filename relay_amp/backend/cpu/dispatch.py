"""dispatch: route fp32, bf16 and int8 matmuls and NHWC convolutions to relay_amp.backend.cpu.kernels.

`UseDotKernels` replaces each eligible `relax.matmul` / `relax.nn.conv2d` by a `call_tir` of a tensorized
kernel (vdpbf16ps or vpdpbusd, their 8-bit codes' substitutes on targets without AVX-512 VNNI
(`kernels.target_intrinsic`), or AMX tiles through relay_amp.backend.cpu.amx). A constant weight is packed
once, here, into a new constant; a matmul's runtime second operand (attention) is packed by Relax ops at run
time, one per batch element, unless the matmul has a few rows (a decode step: Q.K^T becomes (K.Q^T)^T, the
cached keys the kernel's rows; P.V reads V in place on the generic schedule), where packing would copy the whole
cache for a few products of each value. A grouped conv's weight is made block-diagonal over 16-lane output blocks
(`kernels.grouped_weight`), where that costs at most MAX_GROUP_WASTE times the products; groups whose width is off
the 16 lanes (24) get zero outputs up to whole blocks each, and the result's groups are compacted after. A
dilated (atrous) conv's kernel reads its window's taps spaced apart (`ConvSpec.dilation`; on AMX too). Calls the
kernels cannot take (other dtypes, NCHW data, depthwise convs, broadcast runtime matmuls) are left to the generic
schedules. Conv inputs whose channels do not fill the
instruction's group (an RGB stem conv) and runtime matmuls of such a depth (P.V over 197 tokens) get zero
channels added to both operands; a weight whose output channels are off the 16-lane blocks (a 1000-class head)
gets zero output channels, sliced off the result. A pad of that slice back to the whole result (a softmax's rows
padded with its lowest value) becomes an add of the pad value on the zero channels, which the kernel's epilogue
takes (relay_amp.backend.cpu.epilogue). A conv whose input channels get zeros for its kernel (a grouped conv of
8-channel groups over 104 channels reads 112) and whose input is such a slice through elementwise ops (bias,
ReLU, cast) reads those ops recomputed on the whole result instead: the kernel computed the zero channels already,
so nothing slices and pads (RegNetY-400MF in bf16 on Zen 4: 4.10 -> 3.68 ms). More generally, an elementwise op of
such slices (a bias, a ReLU, the residual add of two blocks' slices) runs on the whole results and the slice moves
after it, so the kernel's epilogue takes the op: the extra channels then hold finite values, which the next
conv's zero weights ignore (EfficientNet-B0's 24- and 40-channel stages in int8: 2.71 -> 2.66 ms on Zen 4).
Likewise an elementwise op of a grouped conv's compacted result (the groups of 12 or 20 of MixNet's grouped
pointwise convs: their scale and bias, ReLU, an int8 requantization) runs on the padded groups, its per-channel
constants padded per group, and the compaction moves after it, where it had kept the op out of the kernel's
epilogue (MixNet-S on Zen 5, one process: fp32 3.23 -> 3.00 ms, bf16 2.22 -> 2.07, int8q 1.86 -> 1.74).
A depthwise conv of such a slice runs on the whole result as well, its weight given zero channels (whose outputs
are zeros), and so does a reduction over the pixels of one or an elementwise op of one and a per-channel operand
(an SE block's pooling and gate); a dense conv reading such a slice reads the whole result, with zero weights for
the extra channels, whether or not its dot's group needs them. MobileNetV3's widths of 72, 120, 184 and 200
channels then run on whole vectors and no function copies a slice (on Zen 5, one process: MobileNetV3-Large fp32
2.23 -> 2.16 ms, bf16 1.38 -> 1.21, int8q 0.99 -> 0.89; outputs bit-identical). A conv of a compacted result
reads the padded groups themselves, with zero weights for each group's padding: a dense conv, a grouped conv
each of whose groups reads whole groups of it (MixNet's grouped pointwise convs after grouped ones), and a
depthwise conv, which then runs on the padded channels and is compacted after (so its bias and activation follow
the compaction down and the grouped conv after it reads the padded result too). MixNet-S on Zen 5, one process,
bit-identical: bf16 B/A 0.94, int8q 0.95-0.96, fp32 within noise; all 8 compactions that fed a conv are gone.
"""

import dataclasses
import math

import numpy as np
import tvm
from tvm import relax

from ..._dead_code import EliminateDeadCode
from ..._folding import fold_constants
from ..._ir import add_func_once, depthwise_weight, pad_after, rewrite_function, tensor_dtype, tensor_shape
from ...dtypes import MODEL_FLOAT_DTYPES, numpy_dtype
from ...ops import bound_call, call_op_name, sliced_by_binding
from ...passes.transposes import UNARY
from ..code_bounds import value_range
from . import amx, cores, kernels, tap_skips

FEW_ROWS = 8  # a runtime matmul of this many rows or fewer packs no cache (_Dispatcher._few_rows)
DATA_DTYPES = ("float32", "bfloat16", "int8", "uint8")  # activations relay_amp.backend.cpu.kernels has a dot product for


def target_dtypes(target: tvm.target.Target) -> frozenset[str]:
    """The data dtypes whose dot-product instruction `target` (an llvm target) has."""
    if target.kind.name != "llvm":
        return frozenset()
    has = tvm.target.codegen.target_has_features
    return frozenset(dtype for dtype in DATA_DTYPES
                     if has(kernels.target_intrinsic(dtype, target).llvm_feature, target))


def kernel_dtypes(target: tvm.target.Target) -> frozenset[str]:
    """The data dtypes the kernels compute in for `target`: those whose dot-product instruction it has, less those
    slower than fp32's FMA on its core (relay_amp.backend.cpu.cores) where AMX tiles do not take them, whose
    contractions WidenContractions then computes on the fp32 kernels."""
    return target_dtypes(target) - (cores.slow_dtypes(target) - amx.target_dtypes(target))


def _constant_weight(expr: relax.Expr, data_dtype: str) -> np.ndarray | None:
    """A constant weight in the kernel's weight dtype, or in fp32 holding only values that dtype holds exactly (a
    grouped conv's bf16 weight that WidenArithmetic widened, a quantized one's integer codes) read back in it."""
    weight_dtype = kernels.intrinsic_for(data_dtype).b_dtype
    if not isinstance(expr, tvm.ir.expr.Constant) or tensor_dtype(expr) not in (weight_dtype, "float32"):
        return None
    values = expr.value.numpy()
    if tensor_dtype(expr) == weight_dtype:
        return values
    with np.errstate(invalid="ignore"):
        narrow = values.astype(numpy_dtype(weight_dtype))
    return narrow if np.array_equal(narrow.astype("float32"), values) else None


def _weight_operand(packed: "np.ndarray | relax.Expr") -> relax.Expr:
    """A kernel's packed weight as its call's operand: a constant, or the runtime packing itself."""
    return relax.const(packed) if isinstance(packed, np.ndarray) else packed


def _static_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    shape = tensor_shape(expr)
    return shape if shape is not None and all(isinstance(d, int) for d in shape) else None


def _out_dtype(call: relax.Call, data_dtype: str) -> str:
    out_dtype = call.attrs.out_dtype
    return data_dtype if out_dtype is None or str(out_dtype) in ("", "void") else str(out_dtype)


def _packed_at_run_time(operand: relax.Expr, shape: tuple[int, ...], dot: kernels.DotIntrin, batch: int) -> relax.Expr:
    """A runtime [..., K, N] operand in the kernel's weight layout [batch, N/16, 1, 1, K/group, 16, group]: the
    same order kernels.pack_weight gives a constant, by a reshape and a transpose (fused with its producer), in the
    instruction's dtype (int8 codes widened to INT16_DOT's int16)."""
    (k, n), lanes, group = shape[-2:], kernels.LANES, dot.group
    if tensor_dtype(operand) != dot.b_dtype:
        operand = relax.op.astype(operand, dot.b_dtype)
    split = relax.op.reshape(operand, (batch, k // group, group, n // lanes, lanes))
    blocked = relax.op.permute_dims(split, [0, 3, 1, 4, 2])
    return relax.op.reshape(blocked, (batch, n // lanes, 1, 1, k // group, lanes, group))


@relax.expr_functor.mutator
class _Dispatcher(relax.PyExprMutator):
    """Rewrites eligible matmul/conv2d calls into kernel calls."""

    in_dataflow = False  # slices sink only inside dataflow blocks, where kernels' epilogues are fused

    def __init__(self, mod: tvm.IRModule, dtypes: frozenset[str], amx_dtypes: frozenset[str]):
        super().__init__(mod)
        self.dtypes = dtypes
        self.amx_dtypes = amx_dtypes
        self.kernel_count = 0
        self.kernel_funcs: dict = {}  # ("dot" or "amx", ConvSpec) -> the kernel's GlobalVar (add_func_once)
        self.zero_tailed: set[relax.Var] = set()  # kernel results whose channels past the sliced ones are zeros
        self.finite_tailed: set[relax.Var] = set()  # ... are finite: zero-tailed, or elementwise ops of those
        self.padded_groups: set[relax.Var] = set()  # grouped kernel results of groups padded to whole blocks

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        self.in_dataflow = True
        visited = super().visit_dataflow_block_(block)
        self.in_dataflow = False
        return visited

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        if call_op_name(new_call) == "relax.nn.pad":
            return self._pad_of_zero_tail(new_call)
        for sink in (self._slice_sunk, self._compaction_sunk, self._depthwise_sunk,
                     self._reduction_sunk) if self.in_dataflow else ():
            sunk = sink(new_call)
            if sunk is not None:
                return sunk
        if not isinstance(new_call.op, tvm.ir.Op) or tensor_dtype(new_call.args[0]) not in self.dtypes:
            return new_call
        rewrite = {"relax.matmul": self._matmul, "relax.nn.conv2d": self._conv2d}.get(new_call.op.name)
        replaced = None if rewrite is None else rewrite(new_call)
        return new_call if replaced is None else replaced

    def _matmul(self, call: relax.Call) -> relax.Expr | None:
        data, operand = call.args
        dtype, shape = tensor_dtype(data), _static_shape(data)
        weight = _constant_weight(operand, dtype)
        if shape is None:
            return None
        if weight is not None:
            if weight.ndim > 2 and weight.ndim <= len(shape) and all(d == 1 for d in weight.shape[:-2]):
                weight = weight.reshape(weight.shape[-2:])  # a batch of one (torch.export's einsum as bmm)
            if weight.ndim == 2:
                return self._constant_matmul(call, data, shape, weight[None], 0)
            if weight.shape[:-2] == shape[:-2] and dtype in MODEL_FLOAT_DTYPES:
                return self._constant_matmul(call, data, shape, weight.reshape(-1, *weight.shape[-2:]),
                                             math.prod(weight.shape[:-2]))
            return None
        return self._runtime_matmul(call, shape)

    def _constant_matmul(self, call: relax.Call, data: relax.Expr, shape: tuple[int, ...], weights: np.ndarray,
                         weight_batch: int) -> relax.Expr | None:
        """A matmul by constant `weights` ([batch, K, N]): one weight for every row where `weight_batch` is 0, else
        one per batch element (Winograd's 16 transformed filters), each packed as the kernel takes it."""
        dtype = tensor_dtype(data)
        in_ch, width = weights.shape[1:]
        dot = kernels.weight_intrinsic(kernels.target_intrinsic(dtype), np.concatenate(weights, axis=1), 0,
                                       self._largest_code(data))
        weights = np.pad(weights, [(0, 0), (0, 0), (0, -width % kernels.LANES)])
        if not kernels.supports(weights.shape[2], in_ch, dot):
            return None
        packed = np.stack([kernels.pack_weight(weight, "IO", dot) for weight in weights])
        result = self._emit_matmul(call, data, shape, weights.shape[2], packed if weight_batch else packed[0], dot,
                                   weight_batch)
        return self._first_channels(result, len(shape) - 1, width, weights.shape[2])

    def _first_channels(self, result: relax.Expr, axis: int, channels: int, padded: int) -> relax.Expr:
        """`result` ([..., padded] on `axis`) without the zero output channels a weight or runtime operand off the
        kernel's channel blocks was given."""
        if padded == channels:
            return result
        whole = self.builder_.emit(result)
        if axis == len(tensor_shape(whole)) - 1:
            self.zero_tailed.add(whole)
            self.finite_tailed.add(whole)
        return relax.op.strided_slice(whole, axes=[axis], begin=[0], end=[channels])

    def _leading_channels(self, whole: relax.Var, channels: int, zeros: bool) -> relax.Expr:
        """The first `channels` of `whole` (on its last axis), a result whose other channels are finite, and zeros
        where `zeros`: the slice the sinks (`_slice_sunk`, `_depthwise_sunk`, `_reduction_sunk`) move past an op."""
        self.finite_tailed.add(whole)
        if zeros:
            self.zero_tailed.add(whole)  # a softmax's padding can still join the epilogue (`_pad_of_zero_tail`)
        return relax.op.strided_slice(whole, axes=[len(tensor_shape(whole)) - 1], begin=[0], end=[channels])

    def _slice_sunk(self, call: relax.Call) -> "relax.Expr | None":
        """An elementwise op (WIDENABLE) whose tensor operands are all the leading channels of finite-tailed results
        of one width (a bias, a ReLU, a residual add of two such slices) as the op on the whole results, sliced
        after: its per-channel constants get neutral values on the extra channels. The op then follows the kernel,
        whose epilogue takes it, and the slice moves on to the next op; a conv reading it takes the whole result
        (`_unsliced`). None where the op is not such an op."""
        name, shape = call_op_name(call), tensor_shape(call)
        if name not in WIDENABLE or not shape or not isinstance(shape[-1], int) or _divides_by_a_tensor(call):
            return None
        wholes = {i: sliced_by_binding(self, arg) for i, arg in enumerate(call.args)
                  if not isinstance(arg, tvm.ir.expr.Constant)}
        widths = {tensor_shape(whole)[-1] if whole in self.finite_tailed else None for whole in wholes.values()}
        if not wholes or len(widths) != 1 or None in widths or any(
                not _broadcast_along_channels(tensor_shape(call.args[i]), shape) for i in wholes):
            return None
        extra = widths.pop() - shape[-1]
        args = [wholes[i] if i in wholes else _padded_constant(call, arg, extra) for i, arg in enumerate(call.args)]
        whole = self.builder_.emit(relax.Call(call.op, args, call.attrs))
        zeros = all(source in self.zero_tailed for source in wholes.values()) and _keeps_zeros(call)
        return self._leading_channels(whole, shape[-1], zeros)

    def _depthwise_sunk(self, call: relax.Call) -> "relax.Expr | None":
        """A depthwise NHWC conv (one output channel per input channel) of the leading channels of a finite-tailed
        result as the conv of the whole result, sliced after: zero weights on the extra channels, whose outputs
        are then zeros. Its channels fill whole vectors (72 of 80, 184 of 192: 8-lane vectors before, widened one
        lane group at a time in bf16), no function slices its input, and the slice moves on past its bias and
        activation to the next conv, which reads the whole result too (`_unsliced`). None where the call is not
        such a conv."""
        weight = depthwise_weight(call)
        compacted = None if weight is None else self._compacted(call.args[0])
        if compacted is not None:
            return self._depthwise_of_padded_groups(call, weight, *compacted)
        whole = None if weight is None else sliced_by_binding(self, call.args[0])
        if whole not in self.finite_tailed or tensor_shape(whole)[:-1] != tensor_shape(call.args[0])[:-1]:
            return None
        attrs, shape, constant = call.attrs, tensor_shape(call.args[0]), call.args[1]
        layout, width = str(attrs.kernel_layout), tensor_shape(whole)[-1]
        padded_weight = np.pad(weight, [(0, width - shape[-1] if axis == "O" else 0) for axis in layout])
        result = self.builder_.emit(relax.op.nn.conv2d(
            whole, relax.const(padded_weight, tensor_dtype(constant)), attrs.strides, attrs.padding,
            attrs.dilation, width, "NHWC", layout, "NHWC", attrs.out_dtype))
        return self._leading_channels(result, shape[-1], zeros=True)

    def _depthwise_of_padded_groups(self, call: relax.Call, weight: np.ndarray, padded: relax.Var, groups: int,
                                    width: int) -> relax.Expr:
        """A depthwise NHWC conv of a padded-group result's compaction as the conv of the padded result, compacted
        after: zero weights on each group's padding, whose outputs are then zeros (MixNet's depthwise conv between
        two grouped pointwise convs of 36-channel groups computed as 48). Its bias and activation follow the
        compaction down (`_compaction_sunk`), and the grouped conv after it reads the padded result (`_conv2d`)."""
        attrs, layout = call.attrs, str(call.attrs.kernel_layout)
        padded_weight = _group_padded_axis(weight, layout.index("O"), groups, kernels.padded_group_width(width))
        result = relax.op.nn.conv2d(padded, relax.const(padded_weight, tensor_dtype(call.args[1])), attrs.strides,
                                    attrs.padding, attrs.dilation, tensor_shape(padded)[-1], "NHWC", layout, "NHWC",
                                    attrs.out_dtype)
        return self._groups_compacted(result, groups, width)

    def _reduction_sunk(self, call: relax.Call) -> "relax.Expr | None":
        """A mean, sum, max or min over other axes than the channels of the leading channels of a finite-tailed
        result as the reduction of the whole result, sliced after (an SE block's pooling of a depthwise conv's
        result that `_depthwise_sunk` widened); None where the call is not such a reduction."""
        whole = sliced_by_binding(self, call.args[0]) if call_op_name(call) in CHANNELWISE_REDUCTIONS else None
        rank = len(tensor_shape(call.args[0]) or ())
        axes = [] if whole is None or call.attrs.axis is None else [int(axis) % rank for axis in call.attrs.axis]
        if whole not in self.finite_tailed or not axes or rank - 1 in axes:
            return None
        result = self.builder_.emit(relax.Call(call.op, [whole], call.attrs))
        return self._leading_channels(result, tensor_shape(call)[-1], whole in self.zero_tailed)

    def _pad_of_zero_tail(self, pad: relax.Call) -> relax.Expr:
        """`pad` of a kernel result's first channels back to all of them or fewer (a softmax's rows padded with its
        lowest value, relay_amp.backend.cpu.rows) as the whole result plus the pad value on the zero channels: a
        per-channel constant that joins the kernel's epilogue, so no function slices and pads the result. Padded to
        fewer (rows to 208, the bf16 kernel's two-column blocks to 224) the sum is sliced to them: a copy of its
        own still (FuseOps fuses no slice into the softmax after it), but no pad."""
        whole = sliced_by_binding(self, pad.args[0])
        if whole not in self.zero_tailed:  # its one slice is `_first_channels`': the leading channels
            return pad
        shape, channels = tensor_shape(whole), tensor_shape(pad.args[0])[-1]
        widths = [int(width) for width in pad.attrs.pad_width]
        if widths[:-1] != [0] * (2 * len(shape) - 1) or channels + widths[-1] > shape[-1]:
            return pad
        tail = np.full(shape[-1], float(pad.attrs.pad_value), numpy_dtype(tensor_dtype(whole)))
        tail[:channels] = 0
        masked = relax.op.add(whole, relax.const(tail))
        if channels + widths[-1] == shape[-1]:
            return masked
        return relax.op.strided_slice(self.builder_.emit(masked), axes=[len(shape) - 1], begin=[0],
                                      end=[channels + widths[-1]])

    def _runtime_matmul(self, call: relax.Call, shape: tuple[int, ...]) -> relax.Expr | None:
        """A matmul of two runtime tensors (attention's Q.K^T and P.V): its second operand packed by Relax ops
        at run time, one packed weight per batch element (a 2-D one is a batch of one). A width off the kernels'
        column blocks (`_column_block`: 197 tokens) gets zero columns, sliced off the output; a depth off the
        instruction's group (P.V over 197 tokens in bf16) gets zero products: a zero column of the first operand, a
        zero row of the second."""
        if shape[-2] <= FEW_ROWS:
            return self._few_rows(call, shape)
        data, operand = call.args
        dot, operand_shape = kernels.target_intrinsic(tensor_dtype(data)), _static_shape(operand)
        weight_dtype = kernels.intrinsic_for(tensor_dtype(data)).b_dtype  # the model's: int8, widened as it is packed
        if (tensor_dtype(operand) != weight_dtype or operand_shape is None or len(operand_shape) < 2
                or operand_shape[-2] != shape[-1] or operand_shape[:-2] not in ((), shape[:-2])):
            return None  # broadcast batches
        width, batch = operand_shape[-1], math.prod(operand_shape[:-2])
        extra_depth = -shape[-1] % dot.group
        if extra_depth:
            data = self.builder_.emit(pad_after(data, len(shape), -1, extra_depth))
            operand = self.builder_.emit(pad_after(operand, len(operand_shape), -2, extra_depth))
            shape, operand_shape = _deeper(shape, -1, extra_depth), _deeper(operand_shape, -2, extra_depth)
        extra_width = -width % self._column_block(dot, tensor_dtype(data))
        if extra_width:  # zero columns, padded as the operand is packed
            operand = self.builder_.emit(pad_after(operand, len(operand_shape), -1, extra_width))
            operand_shape = _deeper(operand_shape, -1, extra_width)
        packed = self.builder_.emit(_packed_at_run_time(operand, operand_shape, dot, batch))
        result = self._emit_matmul(call, data, shape, operand_shape[-1], packed, dot, batch)
        return self._first_channels(result, len(shape) - 1, width, operand_shape[-1])

    def _few_rows(self, call: relax.Call, shape: tuple[int, ...]) -> relax.Expr | None:
        """A runtime matmul of a few rows (a decode step's Q.K^T and P.V): packing the second operand would copy
        the whole key or value cache every step for a few products of each value. Q.K^T of the keys as stored,
        K^T a transpose, is computed as (K.Q^T)^T, the keys the kernel's rows and the few queries its packed
        operand; P.V is left to the generic schedule, which reads V in place."""
        data, operand = call.args
        cast = bound_call(self, operand, "relax.astype")  # AMP's, after the transpose
        keys = bound_call(self, operand if cast is None else cast.args[0], "relax.permute_dims")
        rank = len(shape)
        swapped = [*range(rank - 2), rank - 1, rank - 2]
        if keys is None or [int(a) for a in keys.attrs.axes or []] != swapped:
            return None
        stored, keys_shape = keys.args[0], _static_shape(keys.args[0])
        if keys_shape is None or keys_shape[:-2] != shape[:-2] or keys_shape[-2] <= FEW_ROWS:
            return None  # a few keys too: the generic schedule
        if cast is not None:
            stored = self.builder_.emit(relax.op.astype(stored, cast.attrs.dtype))
        queries = self.builder_.emit(relax.op.permute_dims(data, swapped))
        product = self.builder_.normalize(relax.op.matmul(stored, queries, out_dtype=call.attrs.out_dtype))
        dispatched = self._runtime_matmul(product, keys_shape)
        return relax.op.permute_dims(self.builder_.emit(product if dispatched is None else dispatched), swapped)

    def _column_block(self, dot: kernels.DotIntrin, dtype: str) -> int:
        """The multiple a runtime operand's width is padded to: two 16-lane columns for a dot-product instruction
        off AMX, so that its default tile shares each broadcast between two columns (ViT's 12x197x64 by 12x64x197
        in bf16 on Zen 4: 0.295 -> 0.253 ms for 7% more products); one for fp32 FMAs, which measured slower so
        (0.41 -> 0.47 ms)."""
        two_columns = dot in kernels.INTRINSICS and dtype not in self.amx_dtypes
        return kernels.LANES * (2 if two_columns else 1)

    def _emit_matmul(self, call: relax.Call, data: relax.Expr, shape: tuple[int, ...], out_ch: int,
                     packed: "np.ndarray | relax.Expr", dot: kernels.DotIntrin, weight_batch: int = 0) -> relax.Expr:
        """The kernel call for `call`, a matmul of `data` (of `shape`), as a 1x1 conv on `dot`: rows as pixels (per
        weight when `weight_batch`); `packed` is a constant packed here or a runtime operand packed by Relax ops."""
        dtype, in_ch = tensor_dtype(call.args[0]), shape[-1]
        images, rows = (weight_batch, math.prod(shape[:-1]) // weight_batch) if weight_batch else (1, math.prod(shape[:-1]))
        spec = kernels.ConvSpec((images, 1, rows, in_ch), (1, 1), out_ch, (1, 1), dtype, _out_dtype(call, dtype),
                                weight_batch, instruction=kernels.instruction_name(dtype, dot))
        flat = self.builder_.emit(relax.op.reshape(data, spec.data_shape))
        extra = 0 if self._on_amx(spec) else kernels.padded_width(rows, out_ch) - rows
        if extra:  # the last register tile computes rows past the data, which the kernel does not store
            spec = dataclasses.replace(spec, data_shape=(images, 1, rows + extra, in_ch), stored_width=rows)
        result = self._emit_kernel(spec, flat, packed)
        return relax.op.reshape(result, (*shape[:-1], out_ch))

    def _conv2d(self, call: relax.Call) -> relax.Expr | None:
        attrs, data, dtype = call.attrs, call.args[0], tensor_dtype(call.args[0])
        weight = _constant_weight(call.args[1], dtype)
        if weight is None or attrs.data_layout != "NHWC" or attrs.out_layout != "NHWC":
            return None
        layout, dot, groups = str(attrs.kernel_layout), kernels.target_intrinsic(dtype), 1
        uncompacted = self._uncompacted(data, weight, layout, int(attrs.groups))
        if uncompacted is not None:  # the padded groups read with zero weights for each group's padding
            data, weight = uncompacted
        shape = _static_shape(data)
        if shape is None:
            return None
        channels = weight.shape[layout.index("O")]  # outputs padded up to the 16 lanes are sliced off after
        group_width = channels // int(attrs.groups)
        if int(attrs.groups) == 1:  # zero input channels: the rest of a whole result it reads, or up to the dot's group
            dot = kernels.weight_intrinsic(dot, weight, layout.index("I"), self._largest_code(data))
            extra = self._whole_extra(data, dot.group) or -weight.shape[layout.index("I")] % dot.group
            weight = np.pad(weight, [(0, {"I": extra, "O": -channels % kernels.LANES}.get(axis, 0)) for axis in layout])
        else:
            grouped = self._grouped_weight(np.transpose(weight, [layout.index(axis) for axis in "OIHW"]),
                                           int(attrs.groups), dtype)
            if grouped is None:
                return None
            (weight, groups), layout = grouped, "OIHW"
            dot = kernels.weight_intrinsic(dot, weight, 1, self._largest_code(data))  # input channels as packed
            extra = groups * weight.shape[1] - shape[3]  # zero input channels for a last block short of groups
        out_ch, in_ch = weight.shape[layout.index("O")], shape[3] + extra
        if not kernels.supports(out_ch, in_ch, dot, groups):
            return None
        top, left, bottom, right = (int(p) for p in attrs.padding)
        padded_shape = (shape[0], shape[1] + top + bottom, shape[2] + left + right, in_ch)
        kernel_size = (weight.shape[layout.index("H")], weight.shape[layout.index("W")])
        spec = kernels.ConvSpec(padded_shape, kernel_size, out_ch, tuple(int(s) for s in attrs.strides), dtype,
                                _out_dtype(call, dtype), groups=groups, dilation=tuple(int(d) for d in attrs.dilation),
                                instruction=kernels.instruction_name(dtype, dot))
        in_one_row = None if self._on_amx(spec) else _pixels_in_one_row(spec)
        spec = in_one_row or spec
        width = spec.out_shape[2]
        extra_width = 0 if self._on_amx(spec) else kernels.padded_width(width, out_ch) - width
        if extra_width:  # the last register tile computes pixels past the row (an audio conv's 799 outputs), unstored
            computed = (*spec.data_shape[:2], spec.data_shape[2] + extra_width * spec.strides[1], in_ch)
            spec = dataclasses.replace(spec, data_shape=computed, stored_width=width)
        if not in_one_row and tap_skips.worth_skipping(spec, (top, left, bottom, right), self._on_amx(spec)):
            spec = dataclasses.replace(spec, padding=(top, left, bottom, right))
        widened = self._unsliced(data, extra) if extra else None
        if widened is not None:  # the zero channels come from the producing kernel: nothing to pad
            data, extra = widened, 0
        pad_width = [0, 0, top, bottom, left, right, 0, extra]
        if any(pad_width):
            data = self.builder_.emit(relax.op.nn.pad(data, pad_width))
        if in_one_row:
            data = self.builder_.emit(relax.op.reshape(data, spec.input_shape))
        result = self._emit_kernel(spec, data, kernels.pack_weight(weight, layout, dot))
        if in_one_row:
            result = self.builder_.emit(relax.op.reshape(result, (*padded_shape[:3], out_ch)))
        if int(attrs.groups) != 1 and kernels.padded_group_width(group_width) != group_width:
            return self._groups_compacted(result, int(attrs.groups), group_width)
        return self._first_channels(result, 3, channels, out_ch)

    def _grouped_weight(self, weight_oihw: np.ndarray, groups: int, dtype: str) -> "tuple[np.ndarray, int] | None":
        """`kernels.grouped_weight` in blocks of 16 output channels, or where `dtype` is computed on AMX tiles, of
        an AMX panel's 32 (groups of 8 or 16 merged: RegNetY's, which AMX takes only whole panels of)."""
        panel = amx.PANELS * kernels.LANES
        merged = kernels.grouped_weight(weight_oihw, groups, panel) if dtype in self.amx_dtypes else None
        return merged or kernels.grouped_weight(weight_oihw, groups)

    def _groups_compacted(self, result: relax.Expr, groups: int, group_width: int) -> relax.Expr:
        """A grouped conv's NHWC result without the zero output channels that padded each group to whole blocks."""
        whole = self.builder_.emit(result)
        self.padded_groups.add(whole)
        *outer, _ = tensor_shape(whole)
        padded_width = kernels.padded_group_width(group_width)
        blocked = self.builder_.emit(relax.op.reshape(whole, (*outer, groups, padded_width)))
        kept = self.builder_.emit(relax.op.strided_slice(blocked, axes=[4], begin=[0], end=[group_width]))
        return relax.op.reshape(kept, (*outer, groups * group_width))

    def _compacted(self, expr: relax.Expr) -> "tuple[relax.Var, int, int] | None":
        """(the padded-group result, groups, group width) where `expr` is `_groups_compacted`'s compaction of one."""
        flat = bound_call(self, expr, "relax.reshape")
        kept = None if flat is None else bound_call(self, flat.args[0], "relax.strided_slice")
        blocked = None if kept is None else bound_call(self, kept.args[0], "relax.reshape")
        if blocked is None or blocked.args[0] not in self.padded_groups:
            return None
        groups, width = tensor_shape(kept)[-2:]
        return blocked.args[0], groups, width

    def _uncompacted(self, data: relax.Expr, weight: np.ndarray, layout: str, conv_groups: int
                     ) -> "tuple[relax.Var, np.ndarray] | None":
        """(the padded-group result, `weight` with zero input channels for each group's padding) where `data` is its
        compaction and each of the conv's `conv_groups` groups reads whole groups of it (a dense conv, or MixNet's
        grouped pointwise convs after grouped ones): the conv reads the padded result, and no function compacts it.
        None for any other input."""
        compacted = self._compacted(data)
        if compacted is None or compacted[1] % conv_groups:
            return None
        padded, groups, width = compacted
        axis = layout.index("I")
        per_conv_group = groups // conv_groups
        if weight.shape[axis] != per_conv_group * width:
            return None
        return padded, _group_padded_axis(weight, axis, per_conv_group, kernels.padded_group_width(width))

    def _compaction_sunk(self, call: relax.Call) -> "relax.Expr | None":
        """An elementwise op (WIDENABLE) whose tensor operands are all compactions of padded-group results of one
        grouping (a grouped conv's scale and bias, its int8 codes' requantization) as the op on the padded results,
        compacted after: its per-channel constants get neutral values on each group's padding. The op then follows
        the kernel, whose epilogue takes it, where the compaction's slice had kept the kernel's int32 sums apart.
        None where the op is not such an op."""
        name, shape = call_op_name(call), tensor_shape(call)
        if name not in WIDENABLE or not shape or _divides_by_a_tensor(call):
            return None
        sources = {i: self._compacted(arg) for i, arg in enumerate(call.args)
                   if not isinstance(arg, tvm.ir.expr.Constant)}
        groupings = {None if source is None else source[1:] for source in sources.values()}
        if not sources or len(groupings) != 1 or None in groupings or any(
                tensor_shape(call.args[i]) != shape for i in sources):
            return None
        groups, width = groupings.pop()
        padded = kernels.padded_group_width(width)
        args = [sources[i][0] if i in sources else _group_padded_constant(call, arg, groups, padded)
                for i, arg in enumerate(call.args)]
        return self._groups_compacted(relax.Call(call.op, args, call.attrs), groups, width)

    def _sliced_chain(self, data: relax.Expr) -> "tuple[list, relax.Expr] | None":
        """(the elementwise ops with constant operands between, outermost first, with their tensor operand's index;
        the finite-tailed result) where `data` is such ops of the leading channels of a finite-tailed result."""
        chain, current = [], data
        while (whole := sliced_by_binding(self, current)) is None:
            bound = self.lookup_binding(current) if isinstance(current, relax.Var) else None
            operand = widenable_operand(bound)
            if operand is None:
                return None
            chain.append((bound, operand))
            current = bound.args[operand]
        return (chain, whole) if whole in self.finite_tailed else None

    def _whole_extra(self, data: relax.Expr, group: int) -> int:
        """The channels the finite-tailed result `data` is sliced from (`_sliced_chain`) has past `data`'s, where
        the whole result fills the dot's groups, else 0. A dense conv reading it reads the whole result with zero
        weights for them (`_unsliced`), rather than a copy of the slice (MobileNetV3's 72 of 80 channels)."""
        sliced = self._sliced_chain(data)
        width = tensor_shape(sliced[1])[-1] if sliced else 0
        return width - tensor_shape(data)[-1] if sliced and width % group == 0 else 0

    def _unsliced(self, data: relax.Expr, extra: int) -> "relax.Expr | None":
        """`data` computed on the whole kernel result it was sliced from, where that result has exactly `extra`
        channels more (the zero ones `_first_channels` sliced off) and only elementwise ops with constant operands
        lie between: the ops recomputed on all channels, their per-channel constants padded with a neutral value.
        The conv reading it gives those channels zero weights, and the ops keep zeros finite, so its result is
        unchanged; the producing kernel's epilogue can then take the ops, and no function slices and pads."""
        sliced = self._sliced_chain(data)
        if sliced is None or tensor_shape(sliced[1])[-1] != tensor_shape(data)[-1] + extra:
            return None
        chain, whole = sliced
        for call, tensor in reversed(chain):
            args = [whole if i == tensor else _padded_constant(call, arg, extra) for i, arg in enumerate(call.args)]
            whole = self.builder_.emit(relax.Call(call.op, args, call.attrs))
        return whole

    def _emit_kernel(self, spec: kernels.ConvSpec, data: relax.Expr, packed: "np.ndarray | relax.Expr") -> relax.Expr:
        """The kernel call on a weight packed here (a constant) or by Relax ops at run time."""
        self.kernel_count += 1
        name = f"relay_amp_dot_kernel{self.kernel_count}"
        if self._on_amx(spec):
            return self._emit_amx_kernel(spec, data, _weight_operand(amx.padded_weight(packed, spec)), name)
        args = [data, _weight_operand(packed)]
        if spec.shifted:  # shifted to uint8: the correction is 128 x each output channel's weight sum
            args.append(relax.const(kernels.weight_sums(packed)) if isinstance(packed, np.ndarray)
                        else self.builder_.emit(_run_time_weight_sums(packed, spec)))
        gvar = add_func_once(self.builder_, self.kernel_funcs, ("dot", spec), lambda: kernels.conv2d_nhwc_compute(spec),
                             name)
        return self.builder_.emit(relax.call_tir(gvar, args, relax.TensorType(spec.stored_shape, spec.out_dtype)))

    def _largest_code(self, data: relax.Expr) -> int:
        """The largest uint8 code a kernel's 8-bit `data` gives its instruction: uint8 data's largest value
        (code_bounds: 127 for 7-bit codes), 255 for int8 data, which the kernel shifts by 128."""
        if tensor_dtype(data) != "uint8":
            return kernels.UINT8_MAX
        return int(min(value_range(self, data)[1], kernels.UINT8_MAX))

    def _on_amx(self, spec: kernels.ConvSpec) -> bool:
        return spec.data_dtype in self.amx_dtypes and amx.supports(spec)

    def _emit_amx_kernel(self, spec: kernels.ConvSpec, data: relax.Expr, weight: relax.Expr, name: str) -> relax.Expr:
        """The AMX kernel call, with the zero rows its input buffer adds."""
        extra_rows = amx.tiling(spec).data_shape[1] - spec.data_shape[1]
        if extra_rows:
            data = self.builder_.emit(pad_after(data, 4, 1, extra_rows))
        gvar = add_func_once(self.builder_, self.kernel_funcs, ("amx", spec), lambda: amx.conv2d_nhwc(spec), name)
        out_type = relax.TensorType(spec.out_shape, spec.out_dtype)
        return self.builder_.emit(relax.call_tir(gvar, [data, weight], out_type))


CHANNELWISE_REDUCTIONS = ("relax.mean", "relax.sum", "relax.max", "relax.min")  # zeros to zero, finite to finite

# elementwise ops that keep every finite value finite (no exp, log, sqrt or rsqrt), with their constant operands'
# neutral padding (None: unary)
WIDENABLE = {**{op: None for op in UNARY - {"relax.exp", "relax.log", "relax.sqrt", "relax.rsqrt"}},
             "relax.add": 0.0, "relax.subtract": 0.0, "relax.multiply": 1.0, "relax.divide": 1.0, "relax.maximum": 0.0,
             "relax.minimum": 0.0}


def widenable_operand(call: "relax.Expr | None") -> "int | None":
    """The index of the tensor operand of an elementwise op in WIDENABLE (the other one a constant), else None."""
    name = call_op_name(call)
    if name not in WIDENABLE:
        return None
    if WIDENABLE[name] is None:
        return 0
    constants = [isinstance(arg, tvm.ir.expr.Constant) for arg in call.args]
    if constants.count(False) != 1 or _divides_by_a_tensor(call):
        return None
    return constants.index(False)


def _divides_by_a_tensor(call: relax.Call) -> bool:
    """Whether `call` divides by a tensor, whose extra channels may hold zeros (not a widenable op)."""
    return call.op.name == "relax.divide" and not isinstance(call.args[1], tvm.ir.expr.Constant)


ZERO_AT_ZERO = frozenset(UNARY - {"relax.sigmoid", "relax.nn.softplus", "relax.clip", "relax.exp", "relax.log",
                                   "relax.sqrt", "relax.rsqrt"})
# constants c, the same on every channel, for which op(0, c) is 0
ZERO_WITH_SCALAR = {"relax.add": lambda c: c == 0, "relax.subtract": lambda c: c == 0,
                    "relax.multiply": lambda c: True, "relax.divide": lambda c: c != 0,
                    "relax.maximum": lambda c: c <= 0, "relax.minimum": lambda c: c >= 0}


def _keeps_zeros(call: relax.Call) -> bool:
    """Whether `call` (in WIDENABLE, its per-channel constants padded with their neutral value) maps zero
    channels to zeros."""
    name = call.op.name
    if name not in ZERO_WITH_SCALAR:
        return name in ZERO_AT_ZERO
    constants = [arg.value.numpy() for arg in call.args if isinstance(arg, tvm.ir.expr.Constant)]
    unpadded = [values for values in constants if _same_on_every_channel(values)]
    return all(ZERO_WITH_SCALAR[name](float(value)) for values in unpadded for value in values.reshape(-1))


def _broadcast_along_channels(operand: tuple, shape: tuple) -> bool:
    """Whether an operand of shape `operand` has all of a result of `shape`'s channels (the last axis), broadcast
    or not along the others (an SE block's gate of one value per channel)."""
    return len(operand) == len(shape) and operand[-1] == shape[-1] and all(
        size in (1, full) for size, full in zip(operand[:-1], shape[:-1]))


def _same_on_every_channel(values: np.ndarray) -> bool:
    """Whether constant `values` broadcast along the channel (last) axis: `_padded_constant` leaves them as they are."""
    return values.ndim == 0 or values.shape[-1] == 1


def _padded_constant(call: relax.Call, constant: relax.Expr, extra: int) -> relax.Expr:
    """A binary op's constant operand with `extra` more channels of the op's neutral value where it has one per
    channel; a scalar or an attribute-like operand as it is."""
    return _group_padded_constant(call, constant, 1, tensor_shape(call)[-1] + extra)


def _group_padded_constant(call: relax.Call, constant: relax.Expr, groups: int, padded: int) -> relax.Expr:
    """A binary op's constant operand with each of `groups` groups of its channels padded to `padded` with the
    op's neutral value where it has one per channel; a scalar or an attribute-like operand as it is."""
    if not isinstance(constant, tvm.ir.expr.Constant) or _same_on_every_channel(constant.value.numpy()):
        return constant
    values = constant.value.numpy()
    padded_values = _group_padded_axis(values, values.ndim - 1, groups, padded, WIDENABLE[call.op.name])
    return relax.const(padded_values, tensor_dtype(constant))


def _group_padded_axis(values: np.ndarray, axis: int, groups: int, padded: int, fill: float = 0.0) -> np.ndarray:
    """`values` with each of `groups` groups of its channels along `axis` padded to `padded` with `fill`."""
    moved = np.moveaxis(values, axis, -1)
    grouped = moved.reshape(*moved.shape[:-1], groups, moved.shape[-1] // groups)
    widths = [(0, 0)] * (grouped.ndim - 1) + [(0, padded - grouped.shape[-1])]
    filled = np.pad(grouped, widths, constant_values=fill)
    return np.moveaxis(filled.reshape(*moved.shape[:-1], groups * padded), -1, axis)


def _pixels_in_one_row(spec: kernels.ConvSpec) -> "kernels.ConvSpec | None":
    """A pointwise conv (1x1, stride 1, ungrouped) as one row of all its pixels, where its register tiles then compute
    fewer pixels past the data (7x7 pixels on AVX2: 49 in 5-row tiles, 50, not 7 rows of 8; 14x14: 196, not 14 rows
    of 15); else None."""
    batch, height, width, channels = spec.data_shape
    if spec.kernel_size != (1, 1) or spec.strides != (1, 1) or spec.groups != 1 or height == 1:
        return None
    pixels = height * width
    if kernels.padded_width(pixels, spec.out_channels) >= height * kernels.padded_width(width, spec.out_channels):
        return None
    return dataclasses.replace(spec, data_shape=(batch, 1, pixels, channels))


def _run_time_weight_sums(packed: relax.Expr, spec: kernels.ConvSpec) -> relax.Expr:
    """kernels.weight_sums of a runtime operand packed per batch element: [batch, N] int32 from
    [batch, N/16, 1, 1, K/4, 16, 4] int8."""
    sums = relax.op.sum(relax.op.astype(packed, "int32"), axis=[2, 3, 4, 6])
    scaled = relax.op.multiply(sums, relax.const(kernels.INT8_SHIFT, "int32"))
    return relax.op.reshape(scaled, (spec.weight_batch, spec.out_channels))


def _deeper(shape: tuple[int, ...], axis: int, extra: int) -> tuple[int, ...]:
    """`shape` with `extra` more along `axis`."""
    grown = list(shape)
    grown[axis] += extra
    return tuple(grown)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.UseDotKernels")
class UseDotKernels:
    """Route eligible matmuls and NHWC conv2ds to relay_amp's AVX-512 kernels, or its AMX kernels where their
    data dtype is in `amx_dtypes` and the shapes fit AMX tiles."""

    def __init__(self, dtypes: "frozenset[str] | set[str]" = frozenset(DATA_DTYPES), func: str = "main",
                 amx_dtypes: "frozenset[str] | set[str]" = frozenset()):
        self.dtypes = frozenset(dtypes)
        self.func = func
        self.amx_dtypes = frozenset(amx_dtypes)

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod` (weights behind layout changes folded first); the input module is left as it was."""
        mod = fold_constants(mod)
        rewritten = rewrite_function(_Dispatcher(mod, self.dtypes, self.amx_dtypes), mod, self.func)
        # the slices that sank below their ops are dead, but would still count as readers of the kernels' results
        # and keep the kernels' epilogues from taking those ops
        return EliminateDeadCode([self.func])(rewritten)
