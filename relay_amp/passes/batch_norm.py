"""FoldBatchNorm: inference batch norms after convolutions and linear layers folded into their weights and a bias add.

Run it before mixed precision or recast: AMP keeps batch norm in fp32 (TVM legalizes a low-precision one to an
fp32 result), so an unfolded batch norm costs two casts and a pass over the activations per conv.
`relay_amp.frontend` folds them at import (from_onnx and from_torch; the TorchScript ONNX exporter folds a conv's,
not a linear layer's); this pass is for modules built or imported another way.
"""

import tvm

from .._ir import fold_batch_norm


@tvm.transform.module_pass(opt_level=0, name="relay_amp.FoldBatchNorm")
class FoldBatchNorm:
    """Fold every conv2d or matmul -> batch_norm pair with constant weights and statistics into the conv or matmul
    (each conv of a concat of convs -> batch_norm into that conv)."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Fold in every Relax function of `mod`; the input module is left as it was."""
        return fold_batch_norm(mod)
