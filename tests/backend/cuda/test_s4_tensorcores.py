"""int4 on CUDA tensor cores: operands packed eight to a word, multiplied by `mma.sync.m8n8k32 ... s4`.

No GPU here: the packing and the reference kernel (the same addressing as the tensor-core kernel) run on the CPU
against exact integer arithmetic; the kernel's lane layout is checked against PTX's m8n8k32 fragment layout by
emulating one warp; the generated CUDA and, where nvcc is installed, its PTX must hold the s4 instruction.
"""

import re
import shutil

import numpy as np
import pytest
import tvm
from tvm import relax, te

import relay_amp
from relay_amp import models
from relay_amp.backend.cuda import int4
from relay_amp.backend.cuda.int4 import PackInt4Operands, S4Spec, UseS4TensorCores
from relay_amp.backend.cuda.tensorcore import tensor_core_kernels
from relay_amp.compile.build import build, compile_ptx, cuda_source
from relay_amp.passes.layout import convert_layout
from relay_amp.passes.sub_byte import hold_sub_byte_in_bytes
from relay_amp.runtime import run

from builders import single_output_module, tensor
from pass_checks import assert_transforms

RNG = np.random.default_rng(4)
S4_MMA = "mma.sync.aligned.m8n8k32.row.col.s32.s4.s4.s32"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def _values(shape: tuple) -> np.ndarray:
    """int4 values in float32, every code included."""
    values = RNG.integers(-8, 8, shape).astype("float32")
    values.flat[:2] = -8, 7
    return values


def _unpack(words: np.ndarray) -> np.ndarray:
    nibbles = (words[..., None] >> (4 * np.arange(8, dtype="uint32"))) & 15
    return ((nibbles.astype("int32") ^ 8) - 8).reshape(*words.shape[:-1], -1)


def test_packing_round_trips_and_pads_the_last_axis_to_whole_steps():
    values = _values((3, 45)).astype("int8")
    func = te.create_prim_func([placeholder := te.placeholder((3, 45), "int8"), int4.pack_te(placeholder)])
    words = tvm.runtime.tensor(np.zeros((3, 8), "uint32"))
    tvm.compile(tvm.IRModule({"main": func}), target="llvm")["main"](tvm.runtime.tensor(values), words)
    unpacked = _unpack(words.numpy())
    assert unpacked.shape == (3, 64)  # 45 values padded to two steps of 32
    np.testing.assert_array_equal(unpacked[:, :45], values)
    assert not unpacked[:, 45:].any()


def _int4(mod: tvm.IRModule) -> tvm.IRModule:
    return relay_amp.recast(mod, "int4", "int32", ops=["relax.nn.conv2d", "relax.matmul"])


def _held_and_packed(mod: tvm.IRModule) -> tuple[tvm.IRModule, tvm.IRModule]:
    held = hold_sub_byte_in_bytes(_int4(mod))
    return held, PackInt4Operands()(held)


def _matmul_module(data_shape: tuple, columns: int, constant: bool) -> tuple[tvm.IRModule, list[np.ndarray]]:
    weight = _values((data_shape[-1], columns))
    if constant:
        return single_output_module(lambda x: relax.op.matmul(x, relax.const(weight)), tensor("x", data_shape)), []
    return single_output_module(relax.op.matmul, tensor("x", data_shape), tensor("w", weight.shape)), [weight]


@pytest.mark.parametrize("data_shape, columns, constant", [((13, 45), 11, False), ((2, 5, 64), 24, True)])
def test_packed_matmuls_equal_integer_arithmetic(data_shape, columns, constant):
    mod, weights = _matmul_module(data_shape, columns, constant)
    held, packed = _held_and_packed(mod)
    assert "relay_amp_s4_matmul" in packed.script()
    inputs = [_values(data_shape), *weights]
    np.testing.assert_array_equal(run(packed, inputs)[0], run(held, inputs)[0])


CONVS = [  # data layout, kernel layout, strides, padding, dilation, data shape, kernel shape
    ("HWNC", "HWOI", 1, 1, 1, (6, 6, 3, 40), (3, 3, 10, 40)),
    ("HWNC", "HWOI", 2, 1, 1, (7, 7, 2, 32), (3, 3, 16, 32)),
    ("NHWC", "OHWI", 1, 0, 1, (2, 5, 5, 16), (9, 1, 1, 16)),
    ("NHWC", "HWIO", 2, 2, 2, (1, 9, 9, 24), (3, 3, 24, 8)),
]


@pytest.mark.parametrize("data_layout, kernel_layout, stride, pad, dilation, data_shape, kernel_shape", CONVS)
def test_packed_convolutions_equal_integer_arithmetic(data_layout, kernel_layout, stride, pad, dilation, data_shape,
                                                      kernel_shape):
    kernel = _values(kernel_shape)
    mod = single_output_module(lambda x: relax.op.nn.conv2d(
        x, relax.const(kernel), strides=stride, padding=pad, dilation=dilation, data_layout=data_layout,
        kernel_layout=kernel_layout), tensor("x", data_shape))
    held, packed = _held_and_packed(mod)
    assert "relay_amp_s4_conv2d" in packed.script()
    data = _values(data_shape)
    np.testing.assert_array_equal(run(packed, [data])[0], run(held, [data])[0])


def _expected_matmul() -> tvm.IRModule:
    x, w = tensor("x", (16, 32)), tensor("w", (32, 8))
    spec = S4Spec((16, 4), (8, 4), (16, 8))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            held = [bb.emit(relax.op.astype(bb.emit(relax.op.clip(v, -8, 7)), "int8")) for v in (x, w)]
            rows = bb.emit(bb.call_te(int4.pack_te, held[0], primfunc_name_hint="relay_amp_pack_int4"))
            columns = bb.emit(bb.call_te(int4.pack_te, bb.emit(relax.op.permute_dims(held[1], [1, 0])),
                                         primfunc_name_hint="relay_amp_pack_int4"))
            gvar = bb.add_func(int4.reference_kernel(spec), "relay_amp_s4_matmul")
            product = bb.emit(relax.call_tir(gvar, [rows, columns], relax.TensorType((16, 8), "int32")))
            out = bb.emit_output(relax.op.astype(product, "float32"))
        bb.emit_func_output(out)
    return bb.get()


def test_an_int4_matmul_becomes_packed_operands_and_a_reference_call():
    before = hold_sub_byte_in_bytes(_int4(single_output_module(relax.op.matmul, tensor("x", (16, 32)),
                                                               tensor("w", (32, 8)))))
    assert_transforms(PackInt4Operands(), before, _expected_matmul())


def _int8_matmul() -> tvm.IRModule:
    mod = single_output_module(relax.op.matmul, tensor("x", (16, 32)), tensor("w", (32, 8)))
    return relay_amp.recast(mod, "int8", "int32", ops=["relax.matmul"])


@pytest.mark.parametrize("before", [
    _int8_matmul(),  # int8 values: not in int4's range
    hold_sub_byte_in_bytes(_int4(single_output_module(
        lambda x: relax.op.nn.conv2d(x, relax.const(_values((8, 4, 3, 3)))), tensor("x", (1, 4, 8, 8))))),  # NCHW
    hold_sub_byte_in_bytes(_int4(single_output_module(
        relax.op.matmul, tensor("x", (2, 16, 32)), tensor("w", (2, 32, 8))))),  # a batched second operand
], ids=["int8", "nchw-conv", "batched-weights"])
def test_what_it_cannot_pack_is_left_alone(before):
    tvm.ir.assert_structural_equal(PackInt4Operands()(before), before)


def _warp_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One m8n8k32 tile computed as a warp would: each lane loads the words `operand_position` names, the mma
    reads them by PTX's fragment layout, and each lane stores where `accumulator_position` says."""
    a_words, b_words = _pack(a), _pack(b.T)
    lanes = range(int4.WARP_SIZE)
    a_regs = [a_words[int4.operand_position(lane)] for lane in lanes]
    b_regs = [b_words[int4.operand_position(lane)] for lane in lanes]
    # PTX ISA, mma.m8n8k32 .s4: A[row, k] is nibble k % 8 of lane 4 row + k // 8; B[k, col] nibble k % 8 of lane
    # 4 col + k // 8; D[row, col] is register col % 2 of lane 4 row + col // 2
    a_seen = np.array([[_unpack(np.uint32(a_regs[4 * row + k // 8]))[k % 8] for k in range(32)] for row in range(8)])
    b_seen = np.array([[_unpack(np.uint32(b_regs[4 * col + k // 8]))[k % 8] for col in range(8)] for k in range(32)])
    d = a_seen @ b_seen
    out = np.zeros((8, 8), "int64")
    for lane in lanes:
        for e in range(2):
            out[int4.accumulator_position(lane, e)] = d[lane // 4, lane % 4 * 2 + e]
    return out


def _pack(values: np.ndarray) -> np.ndarray:
    nibbles = (values.astype("int64") & 15).reshape(*values.shape[:-1], -1, 8)
    return (nibbles << (4 * np.arange(8))).sum(axis=-1).astype("uint32")


def test_the_kernels_lanes_follow_ptxs_m8n8k32_fragment_layout():
    a, b = _values((8, 32)).astype("int64"), _values((32, 8)).astype("int64")
    np.testing.assert_array_equal(_warp_product(a, b), a @ b)


def test_the_cuda_pass_swaps_every_reference_for_a_scheduled_tensor_core_kernel():
    _, packed = _held_and_packed(_matmul_module((16, 64), 16, False)[0])
    specs = [int4.spec_of(func) for _, func in packed.functions_items()]
    assert [spec for spec in specs if spec is not None] == [S4Spec((16, 8), (16, 8), (16, 16))]
    after = UseS4TensorCores()(packed)
    kernels = [func for _, func in after.functions_items()
               if isinstance(func, tvm.tirx.PrimFunc) and "ptx" in func.script() and "m8n8k32" in func.script()]
    assert len(kernels) == 1 and kernels[0].attrs["tirx.is_scheduled"]
    assert int4.SPEC_ATTR not in after.script()


def _ptx_instructions(source: str) -> set[str]:
    return set(re.findall(r"(?:wmma\.mma|mma)\.sync[\w.]*", compile_ptx(source)))


@pytest.mark.parametrize("constant", [False, True])
def test_an_int4_matmul_builds_for_cuda_on_s4_tensor_cores(constant):
    source = cuda_source(build(_int4(_matmul_module((64, 64), 64, constant)[0]), "cuda-tensorcore"))
    kernels = tensor_core_kernels(source)
    assert kernels["relay_amp_s4_matmul_kernel"] and S4_MMA in source
    if shutil.which("nvcc"):
        assert S4_MMA in _ptx_instructions(source)


@needs_nvcc
def test_resnet18_int4_hwnc_runs_every_conv_but_the_skipped_stem_on_s4_tensor_cores():
    mod = relay_amp.recast(models.resnet18(batch=8, image_size=64), "int4", "int32",
                           ops=["relax.nn.conv2d", "relax.matmul"], skip_layers=[0])
    with relay_amp.LayoutConfig(skip_layers=[0]):
        mod = convert_layout(mod, {"relax.nn.conv2d": ["HWNC"]})
    kernels = tensor_core_kernels(source := cuda_source(build(mod, "cuda-tensorcore")))
    s4 = [name for name in kernels if name.startswith("relay_amp_s4_")]
    assert len([name for name in s4 if "conv2d" in name]) == 10 and all(kernels[name] for name in s4)
    assert [name for name, mma in kernels.items() if "conv2d" in name and not mma] == ["conv2d_kernel"]  # the stem
    assert _ptx_instructions(source) == {S4_MMA}
