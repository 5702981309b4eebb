"""FoldBatchNorm: inference batch norms after convolutions folded into the conv weights and a bias add.

Run it before mixed precision or recast: AMP keeps batch norm in fp32 (TVM legalizes a low-precision one to an
fp32 result), so an unfolded batch norm costs two casts and a pass over the activations per conv.
`relay_amp.frontend.from_torch` folds them already (the TorchScript ONNX exporter does too); this pass is for
modules built or imported another way.
"""

import tvm

from .._ir import fold_batch_norm


@tvm.transform.module_pass(opt_level=0, name="relay_amp.FoldBatchNorm")
class FoldBatchNorm:
    """Fold every conv2d -> batch_norm pair with constant weights and statistics into the convolution."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Fold in every Relax function of `mod`; the input module is left as it was."""
        return fold_batch_norm(mod)
