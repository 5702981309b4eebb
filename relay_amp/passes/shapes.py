"""shapes: the symbolic dims of a model's inputs (an ONNX export's dynamic batch or sequence axes), and
`specialize` / `Specialize`, which binds them to sizes.

Exporters mark axes dynamic (`torch.onnx.export(..., dynamic_axes={"pixel_values": {0: "batch"}})`), and TVM's
importer keeps them as symbolic dims named as the file names them. relay_amp's dot-product kernels pack and tile
static shapes, so a convolution or matmul over a symbolic dim runs on a generic schedule instead (a
dynamic-batch ResNet-18 in bf16: about 2.4x slower than the same model with its batch bound). `build` warns about
such inputs. `relay_amp.frontend.from_onnx(path, dims={"batch": 1})` binds them in the file before import, so
that shapes computed from them fold to constants too (a transformer's positions: Range over the sequence length);
`specialize(mod, {"batch": 1})` binds them in a module already imported.
"""

from collections.abc import Mapping

import tvm
from tvm import relax

from .._ir import checked_dims, get_function, tensor_shape
from ..errors import OptionError


def symbolic_dims(mod: tvm.IRModule, func: str = "main") -> list[str]:
    """The names of the symbolic dims in `func`'s input shapes, in order of first appearance."""
    names: list[str] = []
    for param in get_function(mod, func).params:
        shape = getattr(param.ty, "shape", None)
        for dim in getattr(shape, "values", None) or []:
            if isinstance(dim, tvm.tirx.Var) and dim.name not in names:
                names.append(dim.name)
    return names


def bind_advice(dims: list[str]) -> str:
    """How to give the symbolic dims `dims` sizes, for an error or warning message."""
    sizes = ", ".join(f"{name!r}: N" for name in dims)
    return (f"bind them first: relay_amp.frontend.from_onnx(path, dims={{{sizes}}}), or "
            f"relay_amp.specialize(mod, {{{sizes}}}) (CLI: --dim {','.join(f'{name}=N' for name in dims)})")


def static_input_shape(param: relax.Var) -> tuple[int, ...]:
    """The shape of input `param`, or OptionError naming its symbolic dims and how to bind them."""
    shape = tensor_shape(param) or ()
    symbolic = [dim for dim in shape if isinstance(dim, str)]
    if symbolic:
        raise OptionError(f"input {param.name!r} has symbolic dim {symbolic[0]!r} (all: {', '.join(symbolic)}): "
                          f"{bind_advice(symbolic)}")
    return shape


def specialize(mod: tvm.IRModule, dims: Mapping[str, int], func: str = "main") -> tvm.IRModule:
    """A copy of `mod` with the symbolic input dims named in `dims` bound to their sizes (e.g. {"batch": 1})."""
    return Specialize(dims, func)(mod)


@tvm.transform.module_pass(opt_level=0, name="relay_amp.Specialize")
class Specialize:
    """Bind symbolic input dims by name to sizes, so that the kernels see static shapes."""

    def __init__(self, dims: Mapping[str, int], func: str = "main"):
        self.dims = dict(dims)
        self.func = func

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """`mod` with the dims bound in `func`; the input module is left as it was."""
        dims = checked_dims(self.dims, symbolic_dims(mod, self.func))
        return relax.transform.BindSymbolicVars(dims, self.func)(mod)
