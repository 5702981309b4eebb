"""The relay_amp passes as tvm.transform.Pass objects, for use inside tvm.transform.Sequential."""

from .backend.cpu.affine import FoldAffineClamps
from .backend.cpu.dispatch import UseDotKernels
from .backend.cpu.epilogue import FuseKernelEpilogues
from .backend.cpu.experts import GroupedExpertMatmuls
from .backend.cpu.fastmath import FastMath
from .backend.cpu.int4 import UsePackedInt4Kernels
from .backend.cpu.widen import WidenArithmetic, WidenContractions
from .passes.amp import ToMixedPrecision
from .passes.batch_norm import FoldBatchNorm
from .passes.booleans import BooleanComparisons
from .passes.casts import EliminateRedundantCasts
from .passes.conv_transpose import TransposedConvsAsConvs
from .passes.einsum import EinsumsAsMatmuls
from .passes.experts import DenseExpertMatmuls
from .passes.group_norm import GroupNormsAsOps
from .passes.layer_norm import LayerNormsAsOps
from .passes.layout import ConvertLayout
from .passes.moves import HoistOverMoves
from .passes.padding_taps import DropPaddingTaps
from .passes.parallel_convs import GroupSplitConvs, MergeParallelConvs
from .passes.pooling import GlobalPoolWindows, SeparableMaxPools
from .passes.quantize import Quantize, RealizeQDQ
from .passes.recast import Recast
from .passes.reshapes import SinkReshapes
from .passes.selection import WidenedSelections
from .passes.shapes import Specialize
from .passes.splits import SplitsAsSlices
from .passes.weight_only import DenseWeights, QuantizeWeights

__all__ = ["BooleanComparisons", "ConvertLayout", "DenseExpertMatmuls", "DenseWeights", "DropPaddingTaps", "EinsumsAsMatmuls",
           "EliminateRedundantCasts", "FastMath", "FoldAffineClamps", "FoldBatchNorm", "FuseKernelEpilogues",
           "GlobalPoolWindows", "GroupNormsAsOps", "GroupSplitConvs", "GroupedExpertMatmuls", "HoistOverMoves",
           "LayerNormsAsOps", "MergeParallelConvs", "Quantize", "QuantizeWeights", "RealizeQDQ", "Recast",
           "SeparableMaxPools", "SinkReshapes", "Specialize", "SplitsAsSlices", "ToMixedPrecision",
           "TransposedConvsAsConvs", "UseDotKernels", "UsePackedInt4Kernels", "WidenArithmetic", "WidenContractions",
           "WidenedSelections"]
