"""kernels: the vdpbf16ps / vpdpbusd kernels are in the generated code and match numpy."""

import ml_dtypes
import numpy as np
import pytest
import tvm

import relay_amp
from relay_amp import kernels, targets

CASES = {
    # name: (spec, weight layout, host feature needed to run it)
    "bf16_matmul": (kernels.ConvSpec((1, 1, 24, 64), (1, 1), 48, (1, 1), "bfloat16", "float32"), "avx512_bf16"),
    "int8_conv_stride2": (kernels.ConvSpec((1, 9, 9, 8), (3, 3), 32, (2, 2), "int8", "int32"), "avx512_vnni"),
    "uint8_conv": (kernels.ConvSpec((2, 6, 6, 4), (3, 3), 16, (1, 1), "uint8", "int32"), "avx512_vnni"),
    "fp32_conv": (kernels.ConvSpec((1, 8, 8, 5), (3, 3), 32, (1, 1), "float32", "float32"), "avx512f"),
}
INSTRUCTION = {"bfloat16": "vdpbf16ps", "int8": "vpdpbusd", "uint8": "vpdpbusd", "float32": "vfmadd"}


def _random(spec: kernels.ConvSpec, rng):
    weight_shape = (spec.out_channels, spec.data_shape[-1], *spec.kernel_size)
    if spec.data_dtype in ("bfloat16", "float32"):
        dtype = ml_dtypes.bfloat16 if spec.data_dtype == "bfloat16" else "float32"
        return rng.standard_normal(spec.data_shape).astype(dtype), rng.standard_normal(weight_shape).astype(dtype)
    low = 0 if spec.data_dtype == "uint8" else -128
    return (rng.integers(low, low + 256, spec.data_shape).astype(spec.data_dtype),
            rng.integers(-128, 128, weight_shape).astype("int8"))


def _reference(data, weight_oihw, spec: kernels.ConvSpec) -> np.ndarray:
    data, weight = data.astype("float64"), weight_oihw.astype("float64")
    _, out_h, out_w, _ = spec.out_shape
    stride_h, stride_w = spec.strides
    out = np.zeros(spec.out_shape)
    for row in range(spec.kernel_size[0]):
        for col in range(spec.kernel_size[1]):
            window = data[:, row:row + (out_h - 1) * stride_h + 1:stride_h, col:col + (out_w - 1) * stride_w + 1:stride_w]
            out += np.einsum("nhwc,oc->nhwo", window, weight[:, :, row, col])
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_uses_the_instruction_and_matches_numpy(case):
    spec, feature = CASES[case]
    func = kernels.conv2d_nhwc(spec).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=targets.get_target("cpu-avx512-bf16"))
    assert INSTRUCTION[spec.data_dtype] in lib.mod.inspect_source("asm")
    if not targets.host_supports(feature):
        pytest.skip(f"host CPU lacks {feature}: the code is checked, not run")
    data, weight = _random(spec, np.random.default_rng(0))
    packed = kernels.pack_weight(weight, "OIHW", spec.dot)
    args = [data, packed] + ([kernels.weight_sums(packed)] if spec.shifted else [])
    tensors = [tvm.runtime.tensor(a) for a in args] + [tvm.runtime.empty(spec.out_shape, spec.out_dtype, tvm.cpu())]
    lib["main"](*tensors)
    got, expected = tensors[-1].numpy().astype("float64"), _reference(data, weight, spec)
    tolerance = 0 if "int" in spec.data_dtype else 1e-5  # fp32 sums in another order; integers are exact
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def test_packing_does_not_depend_on_the_source_layout():
    weight = np.arange(32 * 8 * 3 * 3, dtype="float32").reshape(32, 8, 3, 3)
    from_oihw = kernels.pack_weight(weight, "OIHW", kernels.BF16_DOT)
    from_hwio = kernels.pack_weight(weight.transpose(2, 3, 1, 0), "HWIO", kernels.BF16_DOT)
    np.testing.assert_array_equal(from_oihw, from_hwio)
    assert from_oihw.shape == (2, 3, 3, 4, 16, 2)
    np.testing.assert_array_equal(from_oihw[1, 2, 0, 3, 5, 1], weight[16 + 5, 3 * 2 + 1, 2, 0])


def test_matmul_weights_pack_like_a_1x1_conv():
    weight = np.arange(8 * 16, dtype="float32").reshape(8, 16)
    np.testing.assert_array_equal(kernels.pack_weight(weight, "IO", kernels.INT8_DOT),
                                  kernels.pack_weight(weight.T[:, :, None, None], "OIHW", kernels.INT8_DOT))


def test_unsupported_dtype_and_channel_counts_are_dtype_errors():
    with pytest.raises(relay_amp.DTypeError, match="float16"):
        kernels.intrinsic_for("float16")
    with pytest.raises(relay_amp.DTypeError, match="input channels by 2; got 16 and 3"):
        kernels.conv2d_nhwc(kernels.ConvSpec((1, 4, 4, 3), (1, 1), 16))
    with pytest.raises(relay_amp.DTypeError, match="divisible by 16"):
        kernels.conv2d_nhwc(kernels.ConvSpec((1, 4, 4, 8), (1, 1), 24))


def test_amx_kernel_uses_tile_instructions_and_matches_numpy():
    spec = kernels.ConvSpec((1, 1, 64, 96), (1, 1), 64)
    func = kernels.amx_matmul(spec).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=targets.get_target("cpu-amx"))
    assembly = lib.mod.inspect_source("asm")
    assert "tdpbf16ps" in assembly and "ldtilecfg" in assembly
    if not (targets.host_supports("amx_bf16") and kernels.request_amx_permission()):
        pytest.skip("host CPU (or kernel) has no AMX: the code is checked, not run")
    rng = np.random.default_rng(0)
    data = rng.standard_normal(spec.data_shape).astype(ml_dtypes.bfloat16)
    weight = rng.standard_normal((96, 64)).astype(ml_dtypes.bfloat16)
    out = tvm.runtime.empty(spec.out_shape, "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(data), tvm.runtime.tensor(kernels.pack_weight(weight, "IO", spec.dot)), out)
    expected = data.astype("float64")[0, 0] @ weight.astype("float64")
    assert np.abs(out.numpy()[0, 0] - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("spec", [
    kernels.ConvSpec((1, 1, 48, 64), (1, 1), 64),  # rows not a multiple of 32
    kernels.ConvSpec((1, 1, 64, 64), (1, 1), 64, out_dtype="bfloat16"),  # the tiles accumulate fp32
    kernels.ConvSpec((1, 3, 3, 64), (3, 3), 64),  # a 3x3 conv
    kernels.ConvSpec((1, 1, 64, 64), (1, 1), 64, data_dtype="int8", out_dtype="int32"),
])
def test_amx_kernel_takes_only_bf16_matmuls_in_32_blocks(spec):
    assert not kernels.amx_supports(spec)
    with pytest.raises(relay_amp.DTypeError, match="AMX kernel"):
        kernels.amx_matmul(spec)
