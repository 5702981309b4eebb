"""Calibration: observed activation ranges per layer, and the float16 range guard that uses them."""

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import tvm
from tvm import relax

from .._bodies import with_function
from .._ir import get_function
from ..errors import LayerIndexError, ModelLoadError, OptionError
from ..runtime import compile_for_host, run_executable
from ..serialization import atomic_write_text
from .layers import DEFAULT_LAYER_OPS, layer_bindings, list_layers
from .shapes import static_input_shape

FINITE_MAX = {"float16": float(np.finfo(np.float16).max), "bfloat16": 3.389531e38}
DEFAULT_MARGIN = 2.0  # keep a layer in fp32 once its observed range passes half the dtype's finite range


@dataclass(frozen=True)
class LayerRange:
    """The largest |output| a layer produced on the calibration data."""

    index: int
    op: str
    name: str
    output_shape: tuple
    max_abs: float

    def describes(self, layer) -> bool:
        """Whether this record was taken on `layer` (same index, op, name and output shape)."""
        return (self.index, self.op, self.name, tuple(self.output_shape)) == (
            layer.index, layer.op, layer.name, tuple(layer.output_shape or ()))


@dataclass
class RangeStats:
    """Per-layer output ranges recorded by calibrate()."""

    ops: tuple = DEFAULT_LAYER_OPS
    layers: list[LayerRange] = field(default_factory=list)

    def over(self, dtype: str, margin: float = DEFAULT_MARGIN) -> list[LayerRange]:
        """The layers whose range exceeds dtype's finite range divided by margin (NaN and inf count)."""
        limit = FINITE_MAX[dtype] / margin
        return [layer for layer in self.layers if not layer.max_abs <= limit]

    def save(self, path: str | os.PathLike) -> None:
        """Write the stats as JSON, atomically."""
        atomic_write_text(path, json.dumps({"ops": list(self.ops), "layers": [asdict(l) for l in self.layers]}))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RangeStats":
        """Read stats written by save()."""
        try:
            data = json.loads(open(path, encoding="utf-8").read())
            layers = [LayerRange(**{**layer, "output_shape": tuple(layer["output_shape"])}) for layer in data["layers"]]
            return cls(tuple(data["ops"]), layers)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{path} is not a relay_amp range file: {err}") from err


def as_input_list(batch) -> list[np.ndarray]:
    """One batch of model inputs as a list of arrays (a single array means a one-input model)."""
    return [np.asarray(x) for x in batch] if isinstance(batch, (list, tuple)) else [np.asarray(batch)]


def check_inputs(mod: tvm.IRModule, inputs: Sequence[np.ndarray], func: str = "main") -> None:
    """Raise OptionError when inputs do not match the parameters of `func` in number, shape or dtype."""
    params = get_function(mod, func).params
    if len(inputs) != len(params):
        raise OptionError(f"{func} takes {len(params)} inputs, a batch holds {len(inputs)}")
    for param, value in zip(params, inputs):
        shape = static_input_shape(param)
        if value.shape != shape or str(value.dtype) != str(param.ty.dtype):
            raise OptionError(f"input {param.name!r} must be {shape} {param.ty.dtype}, "
                              f"got {value.shape} {value.dtype}")


def _probe(mod: tvm.IRModule, ops: Iterable[str], func: str, take: Callable) -> tvm.IRModule:
    """`mod` with `func` returning take(binding) for each of its layer bindings instead of its result. Each value a
    dataflow block computes leaves it through an output var bound at the block's end, so the blocks stay dataflow
    and the build still reaches its kernels (a function made non-dataflow got none: ResNet-50's probe ran 0.55 s,
    its model 0.05 s)."""
    original = get_function(mod, func)
    values = [take(b) for b in layer_bindings(mod, ops, func)]
    exported: dict[relax.Var, relax.Var] = {}
    blocks = [_exporting(block, values, exported) for block in original.body.blocks]
    outputs = relax.Tuple([exported.get(value, value) for value in values])
    body = relax.BlockBuilder().normalize(relax.SeqExpr(blocks, outputs))
    probe = relax.Function(original.params, body, None, original.is_pure, original.attrs)
    return with_function(mod, func, probe)


def _exporting(block: relax.BindingBlock, values: list[relax.Expr], exported: dict) -> relax.BindingBlock:
    """`block` with an output var bound at its end for each of `values` it binds to a dataflow var (recorded in
    `exported`); any other block as it is."""
    if not isinstance(block, relax.DataflowBlock):
        return block
    bound = {binding.var for binding in block.bindings}
    exports = []
    for value in values:
        if isinstance(value, relax.DataflowVar) and value in bound and value not in exported:
            exported[value] = relax.Var(f"{value.name}_observed", value.ty)
            exports.append(relax.VarBinding(exported[value], value))
    return relax.DataflowBlock([*block.bindings, *exports])


def layer_output(binding: relax.VarBinding) -> relax.Expr:
    """What a layer produces (observe's default)."""
    return binding.var


def layer_input(binding: relax.VarBinding) -> relax.Expr:
    """A layer's first operand: its activations."""
    return binding.value.args[0]


def observe(mod: tvm.IRModule, dataset: Iterable, ops: Iterable[str] = DEFAULT_LAYER_OPS, func: str = "main",
            take: Callable = layer_output) -> Iterator[list[np.ndarray]]:
    """Run `mod` on every input batch of `dataset`; per batch, the value take(binding) of each layer of `ops`."""
    if not list_layers(mod, ops, func):
        raise OptionError(f"the module has no layers of {list(ops)} to calibrate")
    executable = compile_for_host(_probe(mod, ops, func, take))
    seen = 0
    for batch in dataset:
        inputs = as_input_list(batch)
        check_inputs(mod, inputs, func)
        yield run_executable(executable, inputs, func)
        seen += 1
    if not seen:
        raise OptionError("the calibration dataset is empty")


def calibrate(mod: tvm.IRModule, dataset: Iterable, ops: Iterable[str] = DEFAULT_LAYER_OPS,
              func: str = "main") -> RangeStats:
    """Run `mod` on every input batch of `dataset` and record each layer's largest |output|."""
    layers = list_layers(mod, ops, func)
    peaks = np.zeros(len(layers))
    for outputs in observe(mod, dataset, ops, func):
        peaks = np.fmax(peaks, [np.nanmax(np.abs(o.astype("float64")), initial=0.0) for o in outputs])
        peaks = np.where([np.isnan(o.astype("float64")).any() for o in outputs], np.nan, peaks)
    return RangeStats(tuple(ops), [LayerRange(l.index, l.op, l.name, tuple(l.output_shape or ()), float(p))
                                   for l, p in zip(layers, peaks)])


def range_excluded(mod: tvm.IRModule, stats: RangeStats, dtype: str, margin: float,
                   func: str = "main") -> dict[relax.Call, str]:
    """The calls the range guard keeps in fp32, with the reason it records for each."""
    layers = list_layers(mod, stats.ops, func)
    bindings = layer_bindings(mod, stats.ops, func)
    kept = {}
    for layer in stats.over(dtype, margin):
        if layer.index >= len(layers) or not layer.describes(layers[layer.index]):
            raise LayerIndexError(f"range stats for layer {layer.index} ({layer.op} {layer.name!r}) "
                                  "do not match this module: calibrate this module")
        kept[bindings[layer.index].value] = f"range: max |x| {layer.max_abs:.3g} > {FINITE_MAX[dtype]:.5g}/{margin:g}"
    return kept
