"""LayerNormsAsOps: the exporters' layer norm spelled out as one relax.nn.layer_norm.

ONNX has had a LayerNormalization op since opset 17; exporting at an older opset (14, the least that PyTorch's
attention needs, and a common default) writes each LayerNorm as ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div,
Mul and Add, which TVM's importer keeps as nine ops and its fusion runs as three functions reading the row three
times. As relax.nn.layer_norm, AMP keeps it fp32 as one op and the CPU backend computes it a row at a time.
`relay_amp.frontend` does this at import; this pass is for modules imported another way.
"""

import tvm

from .._layer_norm import layer_norms_as_ops


@tvm.transform.module_pass(opt_level=0, name="relay_amp.LayerNormsAsOps")
class LayerNormsAsOps:
    """Every layer norm over the last axis spelled out in elementwise ops and means as one relax.nn.layer_norm."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function of `mod`; the input module is left as it was."""
        return layer_norms_as_ops(mod)
