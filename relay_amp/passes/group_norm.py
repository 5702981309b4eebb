"""GroupNormsAsOps: the exporters' group norm spellings as one relax.nn.group_norm.

The TorchScript and dynamo ONNX exporters write GroupNorm(G, C) as a reshape of [N, C, H, W] to [N, G, C/G*H*W],
an InstanceNormalization (TVM's importer: mean, subtract, variance, add, sqrt, divide, multiply, add), a reshape
back and a per-channel multiply and add. Left so, a channels-last build transposes to NCHW and back around each
one. As relax.nn.group_norm, ConvertLayout carries NHWC through it, AMP keeps it fp32 as one op, and the CPU
backend computes it over the channels (relay_amp.backend.cpu.norms). `relay_amp.frontend` does this at import;
this pass is for modules imported another way.
"""

import tvm

from .._group_norm import group_norms_as_ops


@tvm.transform.module_pass(opt_level=0, name="relay_amp.GroupNormsAsOps")
class GroupNormsAsOps:
    """Every group norm spelled as an instance norm of a grouping reshape as one relax.nn.group_norm."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Rewrite every Relax function of `mod`; the input module is left as it was."""
        return group_norms_as_ops(mod)
