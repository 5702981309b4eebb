"""The CPU pipeline: convolutions to NHWC, fast math and kernel dispatch, then fusion; after fusion, tuning
records, relay_amp's default schedules and TVM's CPU lowering (its buffers of up to 64 KB kept on the stack)."""

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

from ...passes.conv_transpose import TransposedConvsAsConvs
from ...passes.layout import conv_layout_passes
from ...passes.moves import HoistOverMoves
from ...passes.padding_taps import DropPaddingTaps
from ...passes.reshapes import SinkReshapes
from ...passes.sub_byte import HoldSubByteInBytes
from ...passes.weight_only import DenseWeights
from ..fusion import AUTO, deduplication_passes, fusion_passes
from ..views import ContiguousTakesAsViews, view_passes
from . import amx
from .affine import BatchNormsAsAffine, FoldAffineClamps
from .bf16_round import rounding_passes
from .reciprocal import reciprocal_passes
from .conv1d import Conv1dAsConv2d
from .conv3d import Conv3dAsConv2d
from .dispatch import UseDotKernels, kernel_dtypes
from .split_reads import DepthwiseReadsSplitInPlace
from .epilogue import FuseKernelEpilogues
from .experts import GroupedExpertMatmuls
from .fastmath import FastMath
from .int4 import UsePackedInt4Kernels
from .kernels import DotKernelRule
from .lane_predicates import WholeVectorWriteBacks
from .multiplier import RepeatMultiplierInputs
from .nan_tests import NanTestsAsBitTests
from .norms import GroupNormsOverChannels
from .operand_scales import ScalesAfterMatmuls
from .rows import PadSoftmaxRows
from .sampling import FuseWeightedSamples, GridSamplesChannelsLast
from .resize import SeparableResizes
from .schedules import default_schedule, default_schedules
from .stack import TIR_PIPELINE as STACK_PIPELINE
from .tap_skips import SkipPaddedTaps
from .widen import NormsReadNarrow, WidenArithmetic, WidenContractions
from .winograd import WinogradConvs, bf16_suits as bf16_winograd, min_extent as winograd_min_extent
from .winograd import suits as suits_winograd

CONV_LAYOUT = ["NHWC", "HWIO"]  # the layout relay_amp's CPU kernels take: channels innermost
# TIR's common subexpression elimination off: LLVM's own takes the same redundancy out (ResNet-18, BERT, DAC and EnCodec
# built without it ran 0.98-1.01x the time, outputs bit-identical), and on long unrolled functions it was the slowest
# lowering pass (a small EnCodec's build 25.9 -> 15.1 s, DAC's in bf16 32.3 -> 27.2 s)
PASS_CONFIG: dict = {"tirx.disable_cse_tir": True}
TIR_PIPELINE = STACK_PIPELINE  # TVM's S-TIR lowering, small buffers on the stack (relay_amp.backend.cpu.stack)


def layout_passes(conv_layout: "str | list[str] | None" = AUTO) -> list[tvm.transform.Pass]:
    """Convolutions to `conv_layout`; "auto" is CONV_LAYOUT, None keeps the model's layouts."""
    return conv_layout_passes(CONV_LAYOUT if conv_layout == AUTO else conv_layout)


def prepare_passes(target: tvm.target.Target, fast_math: bool = True,
                   conv_layout: "str | list[str] | None" = AUTO) -> tvm.transform.Pass:
    """Weights a file held packed made dense (relay_amp.passes.weight_only), identical bindings computed once, a mixture
    of experts' routed rows taken out of every expert's product computed alone, grouped by expert
    (relay_amp.backend.cpu.experts), int4 values held in int8 (relay_amp.passes.sub_byte), transposed convolutions as
    convolutions of their output phases (relay_amp.passes.conv_transpose), convolutions to NHWC (`conv_layout`
    overrides; None keeps the model's; conv1d to NWC, then a conv2d of height 1; conv3d to NDHWC, then a conv2d over its
    frames, relay_amp.backend.cpu.conv3d), convs with a channel multiplier as depthwise convs of repeated channels
    (relay_amp.backend.cpu.multiplier), taps that read only padding cut from the convs' windows
    (relay_amp.passes.padding_taps), channels-last group norms as per-channel sums (relay_amp.backend.cpu.norms), grid
    samples read channels-last and deformable attention's weighted sums computed as they sample
    (relay_amp.backend.cpu.sampling), bilinear NCHW resizes as resizes along W and then H, an upsampled NHWC result's
    transpose to NCHW moved before the resize (relay_amp.backend.cpu.resize), matmuls' operand scales moved to their
    products (relay_amp.backend.cpu.operand_scales), bf16 chains widened, batch norms no conv took as scales and shifts,
    runs of scales, biases and clamps folded (relay_amp.backend.cpu.affine), softmax rows padded to whole vectors, bf16
    convs and matmuls widened where only fp32 has kernels (AVX2) or fp32's are faster (the target's core:
    relay_amp.backend.cpu.cores), fp32 3x3 convs as Winograd's F(2x2, 3x3) on targets without AVX-512 or on Zen 4, bf16
    ones too on Zen 4 with fast math (relay_amp.backend.cpu.winograd), dot-product kernel dispatch, elementwise ops of
    reshaped tensors computed before the reshapes (relay_amp.passes.reshapes), kernel epilogue fusion (casts and scalar
    ops moved next to the kernels first; activations before fast math splits them), identical bindings computed once
    again (dispatch pads a tensor once per kernel that reads it; merged earlier, two casts of one output would join an
    epilogue and store it wide), depthwise convs reading their part of a channel split in place
    (relay_amp.backend.cpu.split_reads), norms and softmaxes reading a kernel's output in place, widened or through a
    slice's window (relay_amp.backend.cpu.widen), fast math (unless turned off) and packed int4 kernels, takes of one
    index that select a contiguous block made views of it (an unrolled recurrence's step reading its input row:
    relay_amp.backend.views), then legalization and fusion.

    Relax's ConvertLayout carries the layout through the ops between convolutions and transposes only at the graph's
    edges; layers in the current LayoutConfig's skip_layers keep theirs. Dispatched kernels are already tensorized;
    MetaSchedule tunes their tiles through their own rule.
    """
    dtypes = kernel_dtypes(target)
    return tvm.transform.Sequential([
        DenseWeights(),
        *deduplication_passes(),
        GroupedExpertMatmuls(),
        HoldSubByteInBytes(),
        TransposedConvsAsConvs(),
        *layout_passes(conv_layout),
        Conv1dAsConv2d(),
        Conv3dAsConv2d(),
        RepeatMultiplierInputs(),
        DropPaddingTaps(),
        GroupNormsOverChannels(),
        FuseWeightedSamples(),
        GridSamplesChannelsLast(),
        SeparableResizes(),
        ScalesAfterMatmuls(),
        WidenArithmetic(),
        BatchNormsAsAffine(),
        FoldAffineClamps(),
        PadSoftmaxRows(),
        *([WidenContractions(dtypes),
           *([WinogradConvs(least_extent=winograd_min_extent(target), bf16=fast_math and bf16_winograd(target))]
             if suits_winograd(target) else []),
           UseDotKernels(dtypes, amx_dtypes=amx.target_dtypes(target))] if dtypes else []),
        SinkReshapes(),
        *([HoistOverMoves(), FuseKernelEpilogues(fast_math=fast_math), *deduplication_passes()] if dtypes else []),
        DepthwiseReadsSplitInPlace(),
        NormsReadNarrow(fast_softmax=fast_math),
        *([FastMath()] if fast_math else []),
        UsePackedInt4Kernels(target),
        ContiguousTakesAsViews(),
        *fusion_passes(target),
    ], name="relay_amp_cpu_prepare")


def lowering_passes(target: tvm.target.Target, tuned: bool) -> tvm.transform.Pass:
    """For a prepared module: reshapes made views, outputs' too (relay_amp.backend.views), tuning records (when
    `tuned`), default schedules for the rest, NaN tests as tests of the bits (relay_amp.backend.cpu.nan_tests), vector
    write-backs that store part of their lanes split into whole vectors and the cut one
    (relay_amp.backend.cpu.lane_predicates), taps that read only padding skipped (relay_amp.backend.cpu.tap_skips),
    bf16 roundings dropped in registers and native elsewhere (on avx512_bf16 targets), fast math's quotients on the
    reciprocal estimate (AVX-512 targets: relay_amp.backend.cpu.reciprocal), lower."""
    return tvm.transform.Sequential([
        *view_passes(),
        *([relax.transform.MetaScheduleApplyDatabase()] if tuned else []),
        default_schedules(DotKernelRule()),
        *_after_schedules(target),
        *cpu_generic.dataflow_lower_passes(target),
        *cpu_generic.finalize_passes(target),
    ], name="relay_amp_cpu_lower")


def candidate_passes(target: tvm.target.Target) -> tvm.transform.Pass:
    """What a tuning candidate gets after its schedule, as `lowering_passes` gives a built function: its NaN tests as
    bit tests (relay_amp.backend.cpu.nan_tests), its cut vector write-backs split
    (relay_amp.backend.cpu.lane_predicates), its taps that read only padding skipped (relay_amp.backend.cpu.tap_skips),
    bf16 roundings (relay_amp.backend.cpu.bf16_round) and fast quotients (relay_amp.backend.cpu.reciprocal), so that
    tuning measures the code a build runs."""
    return tvm.transform.Sequential(_after_schedules(target), name="relay_amp_cpu_candidate")


def _after_schedules(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """The passes a scheduled function gets before TVM lowers it, in a build and in a tuning candidate alike."""
    return [NanTestsAsBitTests, WholeVectorWriteBacks, SkipPaddedTaps, *rounding_passes(target),
            *reciprocal_passes(target)]


def untuned_schedule(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> "tvm.s_tir.Schedule | None":
    """The schedule an untuned build gives `func` (a tuning task), with its trace, or None."""
    return default_schedule(func, target, DotKernelRule())
