"""LayoutConfig and ConvertLayout: convert conv layouts (NHWC, HWNC for tensor cores) but for chosen layers."""

from collections.abc import Iterable
from typing import ClassVar

import tvm
from tvm import relax

from .._folding import FoldConstants
from .._ir import calls_any_op, clamps_as_max_min, rewrite_function, tensor_shape
from .._pads import pads_as_ops
from ..errors import OptionError
from ..ops import call_op_name, canonical_op, tuple_fields
from . import blocks
from .layers import layer_bindings, list_layers, resolve_layers
from .transposes import BINARY, SinkTransposes

CONV_OPS = ("relax.nn.conv2d", "relax.nn.conv1d")  # the layers LayoutConfig's skip_layers index
CONV_3D = "relax.nn.conv3d"  # converted with the conv2ds, a depth axis added to their layout
# ops whose only legalization is in one layout: ConvertLayout would carry a converted conv's layout into them (NHWC
# into a transposed conv after a conv), which then nothing lowers, so they are held in it
LEGALIZED_LAYOUTS = {"relax.nn.conv2d_transpose": ["NCHW", "IOHW"], "relax.nn.conv1d_transpose": ["NCW", "IOW"]}
# data layout -> the kernel layout "default" stands for (the channel roles of the data layout)
DEFAULT_KERNEL_LAYOUTS = {"NCHW": "OIHW", "NHWC": "OHWI", "HWNC": "HWOI", "HWCN": "HWIO"}


class LayoutConfig:
    """A scope whose skip_layers (indices into list_layers over conv2d and conv1d) ConvertLayout leaves alone."""

    _stack: ClassVar[list["LayoutConfig"]] = []

    def __init__(self, skip_layers: Iterable[int | str] | None = None):
        self.skip_layers = list(skip_layers or ())

    def __enter__(self) -> "LayoutConfig":
        LayoutConfig._stack.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        LayoutConfig._stack.remove(self)

    @classmethod
    def current(cls) -> "LayoutConfig | None":
        """The innermost active LayoutConfig, None outside any."""
        return cls._stack[-1] if cls._stack else None


def _resolve_layouts(desired: dict[str, list[str]]) -> dict[str, list[str]]:
    resolved = {}
    for op, layouts in desired.items():
        layouts = list(layouts)
        if not layouts or len(layouts) > 2:
            raise OptionError(f"desired layouts for {op!r} are [data_layout, kernel_layout], got {layouts!r}")
        data = layouts[0]
        kernel = layouts[1] if len(layouts) == 2 else "default"
        if kernel == "default":
            if data not in DEFAULT_KERNEL_LAYOUTS:
                raise OptionError(f"no default kernel layout for data layout {data!r} of {op!r}; "
                                  f"known: {sorted(DEFAULT_KERNEL_LAYOUTS)}")
            kernel = DEFAULT_KERNEL_LAYOUTS[data]
        resolved[canonical_op(op)] = [data, kernel]
    return resolved


@tvm.transform.module_pass(opt_level=0, name="relay_amp.ConvertLayout")
class ConvertLayout:
    """relax.transform.ConvertLayout that skips the conv layers of the current LayoutConfig, and modules without an
    op of `desired_layouts`. TVM's pass copies its map of every binding's layout at each call it infers a layout
    for, so it takes time quadratic in a dataflow block's bindings even where nothing changes (15-22 s for a 2-layer
    LSTM over 300 steps, 10812 bindings); it runs a new map for each block, so longer blocks are cut into pieces
    (relay_amp.passes.blocks) where the fewest values cross, and joined after (Sequencer2D-S, 27835 bindings:
    103 -> 3.5 s, the same graph). Values crossing a cut pass it in the model's layout, as a function's outputs do
    (a transpose each way where a converted value crosses), which is why cuts go where the fewest values cross."""

    def __init__(self, desired_layouts: dict[str, list[str]], func: str = "main"):
        self.desired_layouts = _resolve_layouts(desired_layouts)
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = rewrite_function(_ConvertibleForms(mod), mod, self.func)
        if not calls_any_op(mod, self.desired_layouts):
            return mod  # TVM's pass would only walk the graph, in time quadratic in its bindings (see the class)
        cut = blocks.blocks_cut(mod, self.func, blocks.BLOCK_LIMIT)
        converted = self._converted(cut)
        if cut.same_as(mod):
            return converted
        return relax.transform.CanonicalizeBindings()(blocks.blocks_joined(converted, self.func))  # hand-overs inlined

    def _converted(self, mod: tvm.IRModule) -> tvm.IRModule:
        """TVM's ConvertLayout of `mod` to the desired layouts, the current LayoutConfig's skipped convs kept."""
        config = LayoutConfig.current()
        skipped = resolve_layers(list_layers(mod, CONV_OPS, self.func), config.skip_layers if config else ())
        convs = layer_bindings(mod, CONV_OPS, self.func)
        kept = {convs[index].value for index in skipped}

        def layout_for(call: relax.Call) -> dict[str, list[str]]:
            if call in kept:  # pin the layouts it has: returning {} would let it follow a converted input
                return {call.op.name: [call.attrs.data_layout, call.attrs.kernel_layout]}
            return self.desired_layouts

        return relax.transform.ConvertLayout(self.desired_layouts, layout_for)(mod)


@relax.expr_functor.mutator
class _ConvertibleForms(relax.PyExprMutator):
    """The calls TVM's ConvertLayout fails on in forms it reads: squeezes and permutations with negative axes
    counted from the front (squeeze: std::bad_alloc; permute_dims: "Invalid layout"; DeBERTa-v2's
    squeeze(axis=[-2]) through torch.export), and stacks as concatenations of tensors given the new axis (stack has
    no layout rule: "Invalid SLayout", or an index out of bounds; torch.stack through torch.export)."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new_call = super().visit_call_(call)
        name = call_op_name(new_call)
        if name == "relax.stack":
            return self._concatenated(new_call)
        if name not in _AXES_ATTRS:
            return new_call
        axes = getattr(new_call.attrs, _AXES_ATTRS[name])
        if axes is None or all(int(axis) >= 0 for axis in axes):
            return new_call
        counted = [int(axis) % new_call.args[0].ty.ndim for axis in axes]
        data = new_call.args[0]
        return relax.op.squeeze(data, counted) if name == "relax.squeeze" else relax.op.permute_dims(data, counted)

    def _concatenated(self, stack: relax.Call) -> relax.Expr:
        fields = tuple_fields(self.builder_, stack.args[0])
        if fields is None:
            return stack
        axis = int(stack.attrs.axis) % stack.ty.ndim
        return relax.op.concat([self.builder_.emit(relax.op.expand_dims(tensor, [axis])) for tensor in fields], axis)


_AXES_ATTRS = {"relax.squeeze": "axis", "relax.permute_dims": "axes"}  # the ops _ConvertibleForms counts, their attr


def convert_layout(mod: tvm.IRModule, desired_layouts: dict[str, list[str]], func: str = "main") -> tvm.IRModule:
    """Functional form of ConvertLayout (honours the current LayoutConfig)."""
    return ConvertLayout(desired_layouts, func)(mod)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.ClampsAsMaxMin")
class ClampsAsMaxMin:
    """Clips (and TE scalar clamps) as maximum and minimum by constants, which ConvertLayout carries a layout
    through (see relay_amp._ir.clamps_as_max_min)."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return clamps_as_max_min(mod, self.func)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.PadsAsOps")
class PadsAsOps:
    """ONNX's constant Pads, as TVM's importer writes them (TE function calls), as relax.nn.pad, which
    SinkTransposes moves transposes past (see relay_amp._pads; relay_amp's frontends do it at import)."""

    def __init__(self, func: str = "main"):
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite `func` of `mod`; the input module is left as it was."""
        return pads_as_ops(mod, self.func)


@relax.transform.function_pass(opt_level=0, name="relay_amp.ConstantsAtFullRank")
class ConstantsAtFullRank:
    """Constant operands of elementwise arithmetic with fewer dims than the other operand (an exporter's [C, 1, 1]
    per-channel scale of an [N, C, H, W] tensor) reshaped to its rank with leading 1s: ConvertLayout carries a layout
    only through operands of equal rank, and leaves a transpose pair around any other."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, ctx) -> relax.Function:
        """`func` with its low-rank constant operands reshaped; the input module is left as it was."""
        return _FullRankConstants(mod).visit_expr(func)


@relax.expr_functor.mutator
class _FullRankConstants(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call_op_name(call) not in BINARY:
            return call
        rank = max(len(tensor_shape(arg) or ()) for arg in call.args)
        args = [self._at_rank(arg, rank) for arg in call.args]
        if all(new.same_as(old) for new, old in zip(args, call.args)):
            return call
        return relax.Call(call.op, args, call.attrs, call.ty_args)

    def _at_rank(self, operand: relax.Expr, rank: int) -> relax.Expr:
        shape = tensor_shape(operand)
        if not isinstance(operand, tvm.ir.expr.Constant) or shape is None or not 0 < len(shape) < rank:
            return operand
        return self.builder_.emit(relax.op.reshape(operand, (1,) * (rank - len(shape)) + tuple(shape)))


def conv_layout_passes(conv_layout: "str | list[str] | None") -> list[tvm.transform.Pass]:
    """The passes that put conv2d into `conv_layout` (a data layout, or [data, kernel]), conv1d into the same
    layout without its H (NHWC: NWC) and conv3d with a D before it (NDHWC), transposed convs held in the layouts TVM lowers (LEGALIZED_LAYOUTS), clamps
    first made maximum and minimum, TE pads relax pads and low-rank constants given their tensors' rank, so that the
    layout carries through them, then the transposes left around ops without a layout rule (pads) sunk until they
    cancel (relay_amp.passes.transposes); none for None."""
    if conv_layout is None:
        return []
    layouts = _resolve_layouts({CONV_OPS[0]: [conv_layout] if isinstance(conv_layout, str) else list(conv_layout)})
    convert = ConvertLayout({**layouts, **_one_dimensional(layouts[CONV_OPS[0]]),
                             **_three_dimensional(layouts[CONV_OPS[0]]), **LEGALIZED_LAYOUTS})
    fold = FoldConstants  # transposes of constants: sinking moves past constant operands only
    return [ClampsAsMaxMin(), PadsAsOps(), ConstantsAtFullRank(), convert, fold, SinkTransposes(), fold,
            relax.transform.CanonicalizeBindings()]


def _three_dimensional(layouts: list[str]) -> dict[str, list[str]]:
    """conv3d's desired layouts for conv2d's `layouts`, a depth axis before the height (NHWC: NDHWC); none where
    the conv2d layouts are not NHWC/HWIO or NCHW/OIHW."""
    data, kernel = layouts
    known = {("NHWC", "HWIO"): ["NDHWC", "DHWIO"], ("NCHW", "OIHW"): ["NCDHW", "OIDHW"]}
    return {CONV_3D: known[(data, kernel)]} if (data, kernel) in known else {}


def _one_dimensional(layouts: list[str]) -> dict[str, list[str]]:
    """conv1d's desired layouts for conv2d's `layouts`, their H left out; none where that leaves no 1-D layout."""
    data, kernel = (layout.replace("H", "") for layout in layouts)
    return {CONV_OPS[1]: [data, kernel]} if data in ("NCW", "NWC") and sorted(kernel) == ["I", "O", "W"] else {}
