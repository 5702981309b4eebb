"""The CUDA pipeline: int4 operands packed for s4 tensor cores, fusion; after fusion, tuning records, the
tensor-core rule ahead of TVM's dlight rules, and TVM's CUDA lowering."""

import tvm
from tvm import relax
from tvm.relax.backend.cuda import pipeline as cuda_lowering

from ..._ir import op_calls, tensor_dtype
from ...passes.layout import conv_layout_passes
from ...passes.padding_taps import DropPaddingTaps
from ...passes.sub_byte import HoldSubByteInBytes
from ...passes.weight_only import DenseWeights
from ..fusion import AUTO, deduplication_passes, fusion_passes
from ..views import view_passes
from .int4 import PackInt4Operands, UseS4TensorCores
from .tensorcore import WMMA_DTYPES, gpu_schedules

# No StorageRewrite: it reuses a float16 staging buffer for a float32 accumulator write-back (a conv with a
# 16-pixel GEMM side), and lowering then fails on the mismatched wmma store pointer ("tvm_access_ptr element type
# must match the source buffer"); merging static shared memory instead fails on BERT's float16 matmuls.
# CUDA graphs: the VM captures a model's static run of kernels on its first call and replays it after (TVM's
# RewriteCUDAGraph); on an H200 at batch 1 the BERT-style encoder's float16 ran 0.402 -> 0.337 ms, calibrated int8
# ResNet-18 0.464 -> 0.443 ms
PASS_CONFIG = {"tirx.disable_storage_rewrite": True, "relax.backend.use_cuda_graph": True}
TIR_PIPELINE = "default"  # TVM's
# The layout "auto" gives convs on tensor cores: on an H200, calibrated int8 ResNet-18 ran 3.2x faster in it
# than in NCHW, float16 MobileNetV3 1.28x
TENSOR_CORE_LAYOUT = "NHWC"
MODEL_LAYOUT = "NCHW"  # what exporters write; a model laid out otherwise was laid out on purpose
TENSOR_CORE_DTYPES = {operand for operand, _ in WMMA_DTYPES}  # the conv inputs wmma takes


def layout_passes(conv_layout: "str | list[str] | None" = AUTO) -> list[tvm.transform.Pass]:
    """Convolutions to `conv_layout`; "auto" puts them in TENSOR_CORE_LAYOUT where they run on tensor cores (see
    `TensorCoreLayout`), None keeps the model's."""
    return [TensorCoreLayout()] if conv_layout == AUTO else conv_layout_passes(conv_layout)


@tvm.transform.module_pass(opt_level=0, name="TensorCoreLayout")
class TensorCoreLayout:
    """Every convolution in TENSOR_CORE_LAYOUT (converted at the graph's edges) where the module's convolutions
    are all in the exporters' MODEL_LAYOUT and some of them take tensor-core dtypes (float16 AMP, int8); a module
    of fp32 convolutions, or one already laid out otherwise (a seed workflow's HWNC), is left as it is."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """`mod` with its convolutions in TENSOR_CORE_LAYOUT, or `mod` itself where that would not pay."""
        convs = op_calls(mod, ["relax.nn.conv2d"])
        takes_tensor_cores = any(tensor_dtype(call.args[0]) in TENSOR_CORE_DTYPES for call in convs)
        if not takes_tensor_cores or any(call.attrs.data_layout != MODEL_LAYOUT for call in convs):
            return mod
        return tvm.transform.Sequential(conv_layout_passes(TENSOR_CORE_LAYOUT))(mod)


def prepare_passes(target: tvm.target.Target, fast_math: bool = True,
                   conv_layout: "str | list[str] | None" = AUTO) -> tvm.transform.Pass:
    """Weights a file held packed made dense, identical bindings computed once, int4 values held in int8, legalization
    and fusion; convolutions on tensor cores in NHWC (`TensorCoreLayout`; `conv_layout` overrides, None keeps the
    model's; the tensor-core rule takes NCHW, NHWC and HWNC), losing the taps that read only padding
    (relay_amp.passes.padding_taps); matmuls and NHWC/HWNC convolutions over int4 values on packed words and s4
    tensor cores. `fast_math` is a CPU option: CUDA's exact
    functions are already fast."""
    return tvm.transform.Sequential([DenseWeights(), *deduplication_passes(), HoldSubByteInBytes(),
                                     *layout_passes(conv_layout), DropPaddingTaps(), PackInt4Operands(),
                                     UseS4TensorCores(), *fusion_passes(target)], name="relay_amp_cuda_prepare")


def lowering_passes(target: tvm.target.Target, tuned: bool) -> tvm.transform.Pass:
    """For a prepared module: reshapes made views, outputs' too (relay_amp.backend.views), tuning records (when
    `tuned`), tensor cores and dlight, lower."""
    return tvm.transform.Sequential([
        *view_passes(),
        *([relax.transform.MetaScheduleApplyDatabase()] if tuned else []),
        gpu_schedules(),
        *cuda_lowering.dataflow_lower_passes(target),
        *cuda_lowering.finalize_passes(target),
    ], name="relay_amp_cuda_lower")


def candidate_passes(target: tvm.target.Target) -> tvm.transform.Pass:
    """What a tuning candidate gets after its schedule before TVM's build: nothing on CUDA."""
    return tvm.transform.Sequential([], name="relay_amp_cuda_candidate")


def untuned_schedule(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> None:
    """None: tuning on CUDA starts from MetaSchedule's own space (dlight's schedules carry no replayable trace)."""
    return None
