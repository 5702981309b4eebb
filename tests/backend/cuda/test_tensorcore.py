"""tensorcore: int8 and float16 matmuls and convs on wmma tensor cores, checked without a GPU.

Without a GPU nothing here runs a kernel: the tests check the schedule (structurally), which kernels of a model
use wmma, and, where nvcc is installed, that nvcc compiles the CUDA source to PTX with the tensor-core instruction.
"""

import re
import shutil

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

import relay_amp
from relay_amp import models, targets
from relay_amp.backend.cuda.tensorcore import (
    TensorCoreRule,
    sm_version,
    tensor_core_kernels,
)
from relay_amp.compile.build import build, compile_ptx, cuda_source
from relay_amp.passes.layout import convert_layout
from relay_amp.runtime import run_executable
from relay_amp.tools.cli import main

from builders import single_output_module, tensor

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
S8_MMA = "wmma.mma.sync.aligned.row.col.m16n16k16.s32.s8.s8.s32"
F16_MMA = "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32"


@T.prim_func(private=True, s_tir=True)
def _int8_matmul(A: T.Buffer((16, 16), "int8"), B: T.Buffer((16, 16), "int8"), C: T.Buffer((16, 16), "int32")):
    for i, j, k in T.grid(16, 16, 16):
        with T.sblock("matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = 0
            C[vi, vj] = C[vi, vj] + T.Cast("int32", A[vi, vk]) * T.Cast("int32", B[vk, vj])


@T.prim_func(private=True, s_tir=True)
def _int8_matmul_scheduled(A: T.Buffer((16, 16), "int8"), B: T.Buffer((16, 16), "int8"), C: T.Buffer((16, 16), "int32")):
    # with T.sblock("root"):
    A_reindex_shared = T.sblock_alloc_buffer((1, 16, 16), "int8", scope="shared")
    B_reindex_shared = T.sblock_alloc_buffer((1, 16, 16), "int8", scope="shared")
    A_reindex_shared_wmma_matrix_a = T.sblock_alloc_buffer((1, 16, 16), "int8", scope="wmma.matrix_a")
    B_reindex_shared_wmma_matrix_b = T.sblock_alloc_buffer((1, 16, 16), "int8", scope="wmma.matrix_b")
    C_reindex_shared = T.sblock_alloc_buffer((1, 16, 16), "int32", scope="shared")
    C_reindex_shared_wmma_accumulator = T.sblock_alloc_buffer((1, 16, 16), "int32", scope="wmma.accumulator")
    for ax0 in T.thread_binding(1, thread="blockIdx.y"):
        for ax1_0_0_ax2_0_0_fused in T.thread_binding(1, thread="blockIdx.x"):
            for ax1_0_1_ax2_0_1_fused in T.thread_binding(1, thread="threadIdx.y"):
                for ax1_0_2_init, ax2_0_2_init in T.grid(1, 1):
                    with T.sblock("matmul_o_init"):
                        v0_o, v1_o, v2_o = T.axis.remap("SSS", [ax0, ax1_0_2_init, ax2_0_2_init])
                        T.reads()
                        T.writes(C_reindex_shared_wmma_accumulator[0, 0:16, 0:16])
                        with T.sblock("matmul_init_o"):
                            v1_i_init_o = T.axis.spatial(1, 0)
                            v2_i_init_o = T.axis.spatial(1, 0)
                            T.reads()
                            T.writes(C_reindex_shared_wmma_accumulator[0, 0:16, 0:16])
                            C_1 = T.match_buffer(C_reindex_shared_wmma_accumulator[0, 0:16, 0:16], (16, 16), "int32", strides=("d1", "d0"), scope="wmma.accumulator", offset_factor=16)
                            T.tvm_fill_fragment(C_1.data, 16, 16, 16, C_1.elem_offset // C_1.strides[0] // 16 * (C_1.strides[0] // 16) + C_1.elem_offset % C_1.strides[0] // 16, T.float32(0.0))
                for ax3_0_0 in range(1):
                    for ax0_ax1_fused_0 in range(1):
                        for ax0_ax1_fused_1 in T.thread_binding(1, thread="threadIdx.y"):
                            for ax0_ax1_fused_2 in T.thread_binding(32, thread="threadIdx.x"):
                                for ax0_ax1_fused_3 in T.vectorized(8):
                                    with T.sblock("A_reindex_shared"):
                                        v0 = T.axis.spatial(1, 0)
                                        v1 = T.axis.spatial(16, (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1 * 256 + ax0_ax1_fused_2 * 8 + ax0_ax1_fused_3) // 16)
                                        v2 = T.axis.spatial(16, (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1 * 256 + ax0_ax1_fused_2 * 8 + ax0_ax1_fused_3) % 16)
                                        T.reads(A[v1, v2])
                                        T.writes(A_reindex_shared[v0, v1, v2])
                                        T.sblock_attr({"buffer_dim_align": [[0, 1, 32, 16]]})
                                        A_reindex_shared[v0, v1, v2] = A[v1, v2]
                    for ax1_ax0_fused_0 in range(2):
                        for ax1_ax0_fused_1 in T.thread_binding(1, thread="threadIdx.y"):
                            for ax1_ax0_fused_2 in T.thread_binding(32, thread="threadIdx.x"):
                                for ax1_ax0_fused_3 in T.vectorized(4):
                                    with T.sblock("B_reindex_shared"):
                                        v0 = T.axis.spatial(1, 0)
                                        v1 = T.axis.spatial(16, (ax1_ax0_fused_0 * 128 + ax1_ax0_fused_1 * 128 + ax1_ax0_fused_2 * 4 + ax1_ax0_fused_3) % 16)
                                        v2 = T.axis.spatial(16, (ax1_ax0_fused_0 * 128 + ax1_ax0_fused_1 * 128 + ax1_ax0_fused_2 * 4 + ax1_ax0_fused_3) // 16)
                                        T.reads(B[v2, v1])
                                        T.writes(B_reindex_shared[v0, v1, v2])
                                        T.sblock_attr({"buffer_dim_align": [[0, 1, 32, 16]]})
                                        B_reindex_shared[v0, v1, v2] = B[v2, v1]
                    for ax3_0_1 in range(1):
                        for ax0_0, ax1_0 in T.grid(1, 1):
                            with T.sblock("A_reindex_shared_wmma.matrix_a_o"):
                                v0_o = T.axis.spatial(1, 0)
                                v1_o, v2_o = T.axis.remap("SS", [ax0_0, ax1_0])
                                T.reads(A_reindex_shared[v0_o, 0:16, 0:16])
                                T.writes(A_reindex_shared_wmma_matrix_a[v0_o, 0:16, 0:16])
                                A_1 = T.match_buffer(A_reindex_shared[v0_o, 0:16, 0:16], (16, 16), "int8", strides=("s1", "s0"), scope="shared", offset_factor=16)
                                C_1 = T.match_buffer(A_reindex_shared_wmma_matrix_a[v0_o, 0:16, 0:16], (16, 16), "int8", strides=("d1", "d0"), scope="wmma.matrix_a", offset_factor=16)
                                T.tvm_load_matrix_sync(C_1.data, 16, 16, 16, C_1.elem_offset // C_1.strides[0] // 16 * (C_1.strides[0] // 16) + C_1.elem_offset % C_1.strides[0] // 16, T.tvm_access_ptr(T.type_annotation("int8"), A_1.data, A_1.elem_offset, A_1.strides[0] * 16, 1), A_1.strides[0], "row_major")
                        for ax0_0, ax1_0 in T.grid(1, 1):
                            with T.sblock("B_reindex_shared_wmma.matrix_b_o"):
                                v0_o = T.axis.spatial(1, 0)
                                v1_o, v2_o = T.axis.remap("SS", [ax0_0, ax1_0])
                                T.reads(B_reindex_shared[v0_o, 0:16, 0:16])
                                T.writes(B_reindex_shared_wmma_matrix_b[v0_o, 0:16, 0:16])
                                A_1 = T.match_buffer(B_reindex_shared[v0_o, 0:16, 0:16], (16, 16), "int8", strides=("s1", "s0"), scope="shared", offset_factor=16)
                                C_1 = T.match_buffer(B_reindex_shared_wmma_matrix_b[v0_o, 0:16, 0:16], (16, 16), "int8", strides=("d1", "d0"), scope="wmma.matrix_b", offset_factor=16)
                                T.tvm_load_matrix_sync(C_1.data, 16, 16, 16, C_1.elem_offset // C_1.strides[0] // 16 * (C_1.strides[0] // 16) + C_1.elem_offset % C_1.strides[0] // 16, T.tvm_access_ptr(T.type_annotation("int8"), A_1.data, A_1.elem_offset, A_1.strides[0] * 16, 1), A_1.strides[0], "col_major")
                        for ax1_0_2, ax2_0_2 in T.grid(1, 1):
                            with T.sblock("matmul_o_update"):
                                v0_o, v1_o, v2_o = T.axis.remap("SSS", [ax0, ax1_0_2, ax2_0_2])
                                v3_o = T.axis.reduce(1, ax3_0_0 + ax3_0_1)
                                T.reads(C_reindex_shared_wmma_accumulator[0, 0:16, 0:16], A_reindex_shared_wmma_matrix_a[0, 0:16, 0:16], B_reindex_shared_wmma_matrix_b[0, 0:16, 0:16])
                                T.writes(C_reindex_shared_wmma_accumulator[0, 0:16, 0:16])
                                with T.sblock("matmul_o"):
                                    v1_i_o = T.axis.spatial(1, 0)
                                    v2_i_o = T.axis.spatial(1, 0)
                                    v3_i_o = T.axis.reduce(1, 0)
                                    T.reads(C_reindex_shared_wmma_accumulator[0, 0:16, 0:16], A_reindex_shared_wmma_matrix_a[0, 0:16, 0:16], B_reindex_shared_wmma_matrix_b[0, 0:16, 0:16])
                                    T.writes(C_reindex_shared_wmma_accumulator[0, 0:16, 0:16])
                                    A_1 = T.match_buffer(A_reindex_shared_wmma_matrix_a[0, 0:16, 0:16], (16, 16), "int8", strides=("a1", "a0"), scope="wmma.matrix_a", offset_factor=16)
                                    B_1 = T.match_buffer(B_reindex_shared_wmma_matrix_b[0, 0:16, 0:16], (16, 16), "int8", strides=("b1", "b0"), scope="wmma.matrix_b", offset_factor=16)
                                    C_1 = T.match_buffer(C_reindex_shared_wmma_accumulator[0, 0:16, 0:16], (16, 16), "int32", strides=("c1", "c0"), scope="wmma.accumulator", offset_factor=16)
                                    T.tvm_mma_sync(C_1.data, C_1.elem_offset // C_1.strides[0] // 16 * (C_1.strides[0] // 16) + C_1.elem_offset % C_1.strides[0] // 16, A_1.data, A_1.elem_offset // A_1.strides[0] // 16 * (A_1.strides[0] // 16) + A_1.elem_offset % A_1.strides[0] // 16, B_1.data, B_1.elem_offset // B_1.strides[0] // 16 * (B_1.strides[0] // 16) + B_1.elem_offset % B_1.strides[0] // 16, C_1.data, C_1.elem_offset // C_1.strides[0] // 16 * (C_1.strides[0] // 16) + C_1.elem_offset % C_1.strides[0] // 16)
                for ax0_0, ax1_0 in T.grid(1, 1):
                    with T.sblock("C_reindex_shared_wmma.accumulator_o"):
                        v0_o = T.axis.spatial(1, 0)
                        v1_o, v2_o = T.axis.remap("SS", [ax0_0, ax1_0])
                        T.reads(C_reindex_shared_wmma_accumulator[v0_o, 0:16, 0:16])
                        T.writes(C_reindex_shared[v0_o, 0:16, 0:16])
                        A_1 = T.match_buffer(C_reindex_shared_wmma_accumulator[v0_o, 0:16, 0:16], (16, 16), "int32", strides=("d1", "d0"), scope="wmma.accumulator", offset_factor=16)
                        C_1 = T.match_buffer(C_reindex_shared[v0_o, 0:16, 0:16], (16, 16), "int32", strides=("s1", "s0"), scope="shared", offset_factor=16)
                        T.tvm_store_matrix_sync(A_1.data, 16, 16, 16, A_1.elem_offset // A_1.strides[0] // 16 * (A_1.strides[0] // 16) + A_1.elem_offset % A_1.strides[0] // 16, T.tvm_access_ptr(T.type_annotation("int32"), C_1.data, C_1.elem_offset, C_1.strides[0] * 16, 2), C_1.strides[0], "row_major")
                for ax0_ax1_fused_0 in range(2):
                    for ax0_ax1_fused_1 in T.thread_binding(32, thread="threadIdx.x"):
                        for ax0_ax1_fused_2 in T.vectorized(4):
                            with T.sblock("C_reindex_shared"):
                                v0 = T.axis.spatial(1, 0)
                                v1 = T.axis.spatial(16, (ax0_ax1_fused_0 * 128 + ax0_ax1_fused_1 * 4 + ax0_ax1_fused_2) // 16)
                                v2 = T.axis.spatial(16, (ax0_ax1_fused_0 * 128 + ax0_ax1_fused_1 * 4 + ax0_ax1_fused_2) % 16)
                                T.reads(C_reindex_shared[v0, v1, v2])
                                T.writes(C[v1, v2])
                                T.sblock_attr({"buffer_dim_align": [[0, 1, 16, 4]]})
                                C[v1, v2] = C_reindex_shared[v0, v1, v2]


def _ptx_instructions(source: str) -> set[str]:
    return set(re.findall(r"(?:wmma\.mma|mma)\.sync[\w.]*", compile_ptx(source)))


def _int8(mod: tvm.IRModule, **options) -> tvm.IRModule:
    return relay_amp.recast(mod, "int8", "int32", ops=["relax.nn.conv2d", "relax.matmul"], **options)


def test_int8_matmul_is_tiled_staged_and_tensorized_as_expected():
    sch = TensorCoreRule().apply(_int8_matmul, targets.get_target("cuda-tensorcore"), False)
    tvm.ir.assert_structural_equal(sch.mod["main"], _int8_matmul_scheduled)


def test_rule_leaves_float32_small_and_cpu_functions_alone():
    rule = TensorCoreRule()
    assert rule.apply(_int8_matmul, targets.get_target("cpu"), False) is None
    assert rule.apply(_int8_matmul, tvm.target.Target({"kind": "cuda", "arch": "sm_61"}), False) is None
    for mod in (models.matmul(size=64), _int8(models.matmul(size=8))):  # no fp32 tensor core; a side under 16
        kernels = tensor_core_kernels(cuda_source(build(mod, "cuda-tensorcore")))
        assert kernels and not any(kernels.values()), kernels


def test_sm_version_reads_the_arch():
    assert sm_version(targets.get_target("cuda-tensorcore")) == 80
    assert sm_version(targets.get_target("cuda-tensorcore-sm90")) == 90
    assert sm_version(targets.get_target("cpu")) == 0


@pytest.mark.parametrize("layout", ["NCHW", "NHWC", "HWNC"])
def test_int8_conv_in_every_layout_runs_on_tensor_cores(layout):
    mod = _int8(models.resnet18_conv(batch=16, channels=64, image_size=14))
    if layout != "NCHW":
        mod = convert_layout(mod, {"relax.nn.conv2d": [layout]})
    source = cuda_source(build(mod, "cuda-tensorcore"))
    convs = {name: wmma for name, wmma in tensor_core_kernels(source).items() if "conv2d" in name}
    assert convs and all(convs.values()), convs
    if shutil.which("nvcc"):
        assert S8_MMA in _ptx_instructions(source)


def _two_convs() -> tvm.IRModule:
    """main(x[1, 16, 8, 8]) = conv(relu(conv(x))), 32 channels out of each 3x3 conv."""
    rng = np.random.default_rng(0)
    first, second = (relax.const(rng.normal(size=shape).astype("float32")) for shape in ((32, 16, 3, 3), (32, 32, 3, 3)))
    return single_output_module(
        lambda x: relax.op.nn.conv2d(relax.op.nn.relu(relax.op.nn.conv2d(x, first, padding=1)), second, padding=1),
        tensor("x", (1, 16, 8, 8)))


def test_an_int8_output_requantized_in_fp32_stores_vectors_cuda_has_a_type_for():
    """Calibrated int8 in NHWC: the first conv's epilogue dequantizes, applies the ReLU and rounds the second conv's
    int8 codes in fp32. Its store of 16 int8 channels made float32x16 values, which TVM's CUDA codegen cannot
    print; 8 lanes made float32x8, printed as ulonglong4 with its constants as make_ulonglong4 of 8 floats, which
    nvcc rejects (an H200 run failed there). The stores take 4 lanes: no vector value is wider than 16 bytes."""
    mod = _two_convs()
    calibration = [np.random.default_rng(1).normal(size=(1, 16, 8, 8)).astype("float32")]
    quantized = relay_amp.quantize(mod, calibration, activation_dtype="int8")
    source = cuda_source(build(convert_layout(quantized, {"relax.nn.conv2d": ["NHWC", "default"]}), "cuda-tensorcore"))
    convs = {name: wmma for name, wmma in tensor_core_kernels(source).items() if "conv2d" in name}
    assert len(convs) == 2 and all(convs.values()), convs
    assert "longlong4" not in source  # TVM's type for 32-byte vectors
    if shutil.which("nvcc"):
        assert S8_MMA in _ptx_instructions(source)


@pytest.mark.parametrize("size", [256, 200])  # 200: the GEMM is padded to whole 64x64 tiles
@needs_nvcc
def test_int8_matmul_compiles_to_s8_wmma(size):
    source = cuda_source(build(_int8(models.matmul(size=size)), "cuda-tensorcore"))
    assert list(tensor_core_kernels(source).values()).count(True) == 1
    assert S8_MMA in _ptx_instructions(source)


@needs_nvcc
def test_resnet18_int8_hwnc_runs_every_conv_but_the_skipped_stem_on_tensor_cores():
    mod = _int8(models.resnet18(batch=16, image_size=64), skip_layers=[0])
    with relay_amp.LayoutConfig(skip_layers=[0]):
        mod = convert_layout(mod, {"relax.nn.conv2d": ["HWNC"]})
    source = cuda_source(build(mod, "cuda-tensorcore"))
    kernels = tensor_core_kernels(source)
    convs = {name: wmma for name, wmma in kernels.items() if "conv2d" in name}
    assert [name for name, wmma in convs.items() if not wmma] == ["conv2d_kernel"]  # the fp32 stem
    assert len(convs) == 11  # ResNet-18's 20 conv layers have 11 distinct shapes, each one kernel
    assert S8_MMA in _ptx_instructions(source)


@needs_nvcc
def test_bert_float16_runs_every_matmul_on_tensor_cores():
    mod = relay_amp.to_mixed_precision(models.bert_encoder(), "float16")
    source = cuda_source(build(mod, "cuda-tensorcore"))
    matmuls = {name: wmma for name, wmma in tensor_core_kernels(source).items() if "matmul" in name}
    assert len(matmuls) >= 5 and all(matmuls.values()), matmuls
    assert F16_MMA in _ptx_instructions(source)


def test_a_module_taking_an_int4_input_is_refused_with_a_dtype_error():
    mod = single_output_module(relax.op.nn.relu, tensor("x", (16,), "int4"))
    with pytest.raises(relay_amp.DTypeError, match="takes x as a int4 tensor"):
        build(mod, "cuda-tensorcore")


def test_running_a_cuda_build_without_a_gpu_is_one_clear_error(capsys):
    if tvm.cuda().exist:
        pytest.skip("this machine has a GPU")
    executable = build(single_output_module(relax.op.matmul, tensor("x", (64, 64), "float16"),
                                            tensor("w", (64, 64), "float16")), "cuda-tensorcore")
    with pytest.raises(relay_amp.TargetError, match="holds CUDA kernels and this machine cannot run them"):
        run_executable(executable, [np.ones((64, 64), "float16")] * 2)
    assert main(["bench", "matmul", "--target", "cuda-tensorcore", "--repeat", "1"]) == 1
    assert capsys.readouterr().err.count("\n") == 1  # one line, no traceback
