"""winograd: 3x3 stride-1 fp32 convolutions on AVX2, Zen 4 and AMX hosts as Winograd's F(2x2, 3x3), 16 matmuls in
one kernel call between an input and an output transform, matching the direct convolution within fp32 rounding."""

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp._ir import OPAQUE_PATTERN
from relay_amp.backend.cpu import winograd
from relay_amp.backend.cpu.winograd import WinogradConvs
from relay_amp.dtypes import cast_array
from relay_amp.runtime import run_executable

from builders import seeded_torchvision_through_onnx, torchvision_through_onnx
from pass_checks import assert_transforms

AVX2 = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}  # FMA and AVX2, no AVX-512: any x86 host CI runs on
ZEN4 = {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}  # AVX-512, each FMA in two halves: runs where the host has it


def _weight(kernel: int, channels: int, outputs: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((kernel, kernel, channels, outputs)) / np.sqrt(9 * channels)).astype("float32")


def _constant(array: np.ndarray, dtype: str = "float32") -> relax.Expr:
    return relax.const(tvm.runtime.tensor(cast_array(array, dtype)))


def _convs(shape=(1, 8, 8, 128), outputs: int = 128, padding=(1, 1, 1, 1), dtype: str = "float32") -> tvm.IRModule:
    """A conv Winograd takes, then one of stride 2 (it does not), each NHWC by a constant HWIO weight."""
    data = relax.Var("data", relax.TensorType(shape, dtype))
    builder = relax.BlockBuilder()
    with builder.function("main", [data]):
        with builder.dataflow():
            taken = builder.emit(relax.op.nn.conv2d(data, _constant(_weight(3, shape[3], outputs), dtype),
                                                    padding=padding, data_layout="NHWC", kernel_layout="HWIO"))
            strided = builder.emit(relax.op.nn.conv2d(taken, _constant(_weight(3, outputs, outputs, 1), dtype),
                                                      strides=2, padding=1, data_layout="NHWC", kernel_layout="HWIO"))
            out = builder.emit_output(strided)
        builder.emit_func_output(out)
    return builder.get()


def _transformed_windows(builder: relax.BlockBuilder, data: relax.Var, padded_shape: tuple, tiles_across: int,
                         tiles: int, dtype: str = "float32") -> relax.Var:
    """The expected pad by 1 on each side and the call of the scheduled input transform, opaque to fusion, over
    `tiles_across` x `tiles_across` tiles computed as `tiles` (an odd count)."""
    windows = tvm.te.placeholder(padded_shape, dtype, "padded")
    func = winograd.windows_schedule(tvm.te.create_prim_func(
        [windows, winograd.transformed_windows(windows, tiles_across, tiles_across)]))
    padded = builder.emit(relax.op.nn.pad(data, [0, 0, 1, 1, 1, 1, 0, 0]))
    input_transform = builder.add_func(func.without_attr("global_symbol").with_attrs(
        {"tirx.is_scheduled": True, "op_pattern": OPAQUE_PATTERN}), "winograd_input")
    windows_type = relax.TensorType((16, tiles, padded_shape[3]), dtype)
    return builder.emit(relax.call_tir(input_transform, [padded], windows_type))


def test_a_3x3_stride_1_conv_becomes_a_pad_an_input_transform_one_batched_matmul_and_an_output_transform():
    """8x8 outputs are 4x4 tiles of 2x2 (16 x 128 x 128 products in each of the 16 products: MIN_PRODUCTS), read
    from the input padded by 1 on each side, 16 tiles computed as 17 (an odd count); the input transform is
    scheduled and opaque to fusion; the stride-2 conv stays."""
    before = _convs()
    (data,), weight = before["main"].params, _weight(3, 128, 128)
    builder = relax.BlockBuilder()
    with builder.function("main", [data]):
        with builder.dataflow():
            transformed = _transformed_windows(builder, data, (1, 10, 10, 128), 4, 17)
            products = builder.emit(relax.op.matmul(transformed, relax.const(winograd.transformed_weights(weight))))
            taken = builder.emit(builder.call_te(winograd.output_tiles, products, (1, 8, 8, 128), 4, 4,
                                                 primfunc_name_hint="winograd_output"))
            strided = builder.emit(relax.op.nn.conv2d(taken, relax.const(_weight(3, 128, 128, 1)), strides=2, padding=1,
                                                      data_layout="NHWC", kernel_layout="HWIO"))
            out = builder.emit_output(strided)
        builder.emit_func_output(out)
    assert_transforms(WinogradConvs(), before, builder.get())


def test_a_bf16_conv_takes_it_with_bf16_windows_and_weights_fp32_products_and_its_output_cast_back():
    """With `bf16` (Zen 4 with fast math): 14x14 outputs (BF16_MIN_EXTENT) as 7x7 tiles (49, odd already); the
    transformed windows stored in bf16, the transformed weights rounded to bf16, their products accumulated in fp32,
    the output transform in fp32 and its result cast to the conv's bf16; the stride-2 conv stays."""
    before = _convs(shape=(1, 14, 14, 128), dtype="bfloat16")
    (data,) = before["main"].params
    weight = cast_array(_weight(3, 128, 128), "bfloat16")
    builder = relax.BlockBuilder()
    with builder.function("main", [data]):
        with builder.dataflow():
            transformed = _transformed_windows(builder, data, (1, 16, 16, 128), 7, 49, "bfloat16")
            products = builder.emit(relax.op.matmul(
                transformed, _constant(winograd.transformed_weights(weight), "bfloat16"), out_dtype="float32"))
            outputs = builder.emit(builder.call_te(winograd.output_tiles, products, (1, 14, 14, 128), 7, 7,
                                                   primfunc_name_hint="winograd_output"))
            taken = builder.emit(relax.op.astype(outputs, "bfloat16"))
            strided = builder.emit(relax.op.nn.conv2d(taken, _constant(_weight(3, 128, 128, 1), "bfloat16"),
                                                      strides=2, padding=1, data_layout="NHWC", kernel_layout="HWIO"))
            out = builder.emit_output(strided)
        builder.emit_func_output(out)
    assert_transforms(WinogradConvs(bf16=True), before, builder.get())


def test_bf16_convs_stay_direct_without_bf16_or_below_14x14():
    """Without `bf16` (other targets, or fast math off) a bf16 conv keeps its direct kernel, as does one whose
    output is below BF16_MIN_EXTENT (session 83: 8x8x128 ran 1.25x the direct conv's time) while fp32 takes it."""
    bf16 = _convs(shape=(1, 14, 14, 128), dtype="bfloat16")
    tvm.ir.assert_structural_equal(WinogradConvs()(bf16), bf16)
    small = _convs(shape=(1, 8, 8, 128), dtype="bfloat16")
    tvm.ir.assert_structural_equal(WinogradConvs(bf16=True)(small), small)
    assert "winograd_input" in WinogradConvs(bf16=True)(_convs(shape=(1, 8, 8, 128))).script()


def test_the_transformed_windows_are_bt_d_b_of_each_tile_and_the_extra_tile_repeats_the_last():
    """Two images of 3x2 tiles (12, computed as 13), each tile's 4x4 window d of the padded input as B^T d B, on the
    scheduled function (each tile's 16 elements unrolled over vectors of its channels)."""
    rng = np.random.default_rng(0)
    padded = rng.standard_normal((2, 8, 6, 32)).astype("float32")
    data = tvm.te.placeholder(padded.shape, "float32", "padded")
    windows = winograd.transformed_windows(data, 3, 2)
    lib = tvm.compile(winograd.windows_schedule(tvm.te.create_prim_func([data, windows])), "llvm")
    got = tvm.runtime.tensor(np.zeros((16, 13, 32), "float32"))
    lib(tvm.runtime.tensor(padded), got)
    bt = winograd.INPUT_TRANSFORM
    expected = np.stack([np.einsum("ai,ijc,bj->abc", bt, padded[n, 2 * r:2 * r + 4, 2 * c:2 * c + 4], bt)
                         for n in range(2) for r in range(3) for c in range(2)]).reshape(12, 16, 32).transpose(1, 0, 2)
    np.testing.assert_allclose(got.numpy()[:, :12], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got.numpy()[:, 12], got.numpy()[:, 11])


@pytest.mark.parametrize("reason, module", [
    ("32 channels in", _convs(shape=(1, 16, 16, 32))),
    ("6 outputs high", _convs(shape=(1, 6, 32, 128))),
    ("7x7 outputs by 64 channels in and out (under MIN_PRODUCTS)", _convs(shape=(1, 7, 7, 64), outputs=64)),
    ("a bf16 input", relay_amp.to_mixed_precision(_convs(), "bfloat16")),
])
def test_convs_outside_what_was_measured_keep_the_direct_kernels(reason, module):
    assert WinogradConvs()(module).script().count("winograd") == 0, reason


def test_a_14x14_conv_of_64_channels_takes_it():
    """49 tiles x 64 x 64 products in each matmul (over MIN_PRODUCTS: 0.74-0.82x the direct conv's time)."""
    assert "winograd_input" in WinogradConvs()(_convs(shape=(1, 14, 14, 64), outputs=64)).script()


def test_the_transformed_weights_are_g_g_gt_of_each_filter():
    weight = _weight(3, 2, 3)
    expected = [winograd.WEIGHT_TRANSFORM @ weight[:, :, c, k] @ winograd.WEIGHT_TRANSFORM.T for c in range(2)
                for k in range(3)]
    got = winograd.transformed_weights(weight).reshape(4, 4, 2, 3)
    np.testing.assert_allclose([got[:, :, c, k] for c in range(2) for k in range(3)], expected, rtol=1e-6)


def _runnable(target: dict) -> None:
    """Skip a test whose build for `target` this host cannot run (AVX-512 code on an AVX2 host)."""
    if target is ZEN4 and not relay_amp.targets.host_supports("avx512f"):
        pytest.skip("the host has no AVX-512")


@pytest.mark.parametrize("target", [AVX2, ZEN4], ids=["avx2", "zen4"])
@pytest.mark.parametrize("shape, padding", [((2, 9, 7, 128), (1, 1, 1, 1)), ((1, 10, 12, 128), (0, 0, 0, 0))])
def test_a_built_winograd_conv_computes_what_the_direct_one_does(shape, padding, target):
    """Odd output sizes (tiles past the edge), a batch of two, no padding; bias, ReLU and a residual add after it
    (fused into the output transform). fp32, within 1e-5 of the largest output: Winograd rounds otherwise."""
    rng = np.random.default_rng(0)
    data = relax.Var("data", relax.TensorType(shape, "float32"))
    weight, bias = _weight(3, 128, 128), rng.standard_normal(128).astype("float32")
    out_shape = (shape[0], shape[1] + padding[0] + padding[2] - 2, shape[2] + padding[1] + padding[3] - 2, 128)
    residual = rng.standard_normal(out_shape).astype("float32")
    builder = relax.BlockBuilder()
    with builder.function("main", [data]):
        with builder.dataflow():
            conv = builder.emit(relax.op.nn.conv2d(data, relax.const(weight), padding=padding, data_layout="NHWC",
                                                   kernel_layout="HWIO"))
            biased = builder.emit(relax.op.nn.relu(relax.op.add(conv, relax.const(bias))))
            out = builder.emit_output(relax.op.add(biased, relax.const(residual)))
        builder.emit_func_output(out)
    executable = relay_amp.build(builder.get(), tvm.target.Target(target))
    assert "winograd" in executable.as_text()
    _runnable(target)
    x = rng.standard_normal(shape).astype("float32")
    padded = np.pad(x, [(0, 0), (padding[0], padding[2]), (padding[1], padding[3]), (0, 0)]).astype("float64")
    direct = sum(np.einsum("nhwc,ck->nhwk", padded[:, i:i + out_shape[1], j:j + out_shape[2]], weight[i, j])
                 for i in range(3) for j in range(3))
    expected = np.maximum(direct + bias, 0) + residual
    got = run_executable(executable, [x])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_torchvisions_resnet18_on_avx2_runs_its_3x3_convs_as_winograd_and_matches_pytorch():
    """A model nobody here wrote (random weights, 112x112: the first three stages' 3x3 convs take it, the last
    stage's 4x4 maps do not), exported by PyTorch to ONNX; fp32 within 1e-5 of PyTorch's largest output."""
    mod, x, expected = seeded_torchvision_through_onnx("resnet18", 112)
    executable = relay_amp.build(mod, tvm.target.Target(AVX2))
    transforms = {line.split()[1] for line in executable.as_text().splitlines()
                  if line.strip().startswith("call ") and "winograd_output" in line}
    assert len(transforms) >= 3, transforms  # a function per stage's shape at least
    got = run_executable(executable, [x])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_torchvisions_vgg11_on_zen4_runs_its_3x3_convs_as_winograd_and_matches_pytorch():
    """A model the Zen 4 measurements did not use (VGG-11's convolutions at 64x64, random weights): its convs from
    32x32 to 8x8 take it (the first reads 3 channels, the last 4x4 maps); fp32 within 1e-5 of PyTorch's largest
    output where the host runs AVX-512."""
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    mod, x, expected = torchvision_through_onnx(torchvision.models.vgg11(weights=None).features, 64)
    executable = relay_amp.build(mod, tvm.target.Target(ZEN4))
    calls = [line for line in executable.as_text().splitlines() if line.strip().startswith("call ")]
    assert sum("winograd_output" in line for line in calls) == 5
    _runnable(ZEN4)
    got = run_executable(executable, [x])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("target, takes, least_extent", [
    (AVX2, True, 7),
    (ZEN4, True, 7),
    ({"kind": "llvm", "mcpu": relay_amp.targets.BF16_CPU, "model": "znver4"}, True, 7),  # cpu-avx512-bf16 on Zen 4
    ({"kind": "llvm", "mcpu": relay_amp.targets.BF16_CPU, "model": "znver5"}, False, 14),  # whole AVX-512 FMAs
    ({"kind": "llvm", "mcpu": "skylake-avx512"}, False, 14),
    ({"kind": "llvm", "mcpu": relay_amp.targets.AMX_CPU}, True, 14),  # measured: ResNets faster, but not at 7x7
])
def test_cpu_targets_whose_fp32_fmas_are_256_bits_wide_or_amx_hosts_take_winograd(target, takes, least_extent):
    assert winograd.suits(tvm.target.Target(target)) == takes
    assert winograd.min_extent(tvm.target.Target(target)) == least_extent


def test_where_fmas_are_whole_a_7x7_conv_keeps_the_direct_kernel_and_a_14x14_one_takes_winograd():
    """Sapphire Rapids: 7x7x512 -> 512 as Winograd's ran 1.28x the direct conv's time, 14x14x256 0.76x."""
    wide = WinogradConvs(least_extent=winograd.WIDE_MIN_EXTENT)
    assert "winograd" not in wide(_convs(shape=(1, 7, 7, 512), outputs=512)).script()
    assert "winograd_input" in wide(_convs(shape=(1, 14, 14, 256), outputs=256)).script()
    assert "winograd_input" in WinogradConvs()(_convs(shape=(1, 7, 7, 512), outputs=512)).script()


def test_a_gpu_target_does_not_take_winograd():
    assert not winograd.suits(relay_amp.targets.get_target("cuda-tensorcore"))


@pytest.mark.parametrize("target, takes", [
    (ZEN4, True),
    ({"kind": "llvm", "mcpu": relay_amp.targets.BF16_CPU, "model": "znver4"}, True),  # cpu-avx512-bf16 on Zen 4
    ({"kind": "llvm", "mcpu": relay_amp.targets.BF16_CPU, "model": "znver5"}, False),  # whole FMAs: no Winograd
    ({"kind": "llvm", "mcpu": relay_amp.targets.AMX_CPU}, False),  # AMX tiles compute bf16 convs
    (AVX2, False),  # no avx512_bf16: its bf16 convs are widened to fp32 first (and take fp32's Winograd)
])
def test_bf16_convs_take_winograd_on_zen4_only(target, takes):
    assert winograd.bf16_suits(tvm.target.Target(target)) == takes


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_a_built_bf16_winograd_conv_computes_the_conv_to_bf16s_precision_and_fast_math_off_keeps_it_direct(
        out_dtype):
    """A bf16 conv (bias and ReLU after) built for Zen 4 takes Winograd's form, and with fast_math=False keeps the
    direct kernel; where the host runs avx512_bf16, both within 1e-2 of the largest output of the direct conv of the
    same bf16 values in float64 (the windows and weights rounded to bf16 once more; bf16 itself holds 3.9e-3)."""
    rng = np.random.default_rng(0)
    shape = (1, 15, 14, 128)
    weight, bias = cast_array(_weight(3, 128, 128), "bfloat16"), rng.standard_normal(128).astype("float32")
    data = relax.Var("data", relax.TensorType(shape, "bfloat16"))
    builder = relax.BlockBuilder()
    with builder.function("main", [data]):
        with builder.dataflow():
            conv = builder.emit(relax.op.nn.conv2d(data, relax.const(tvm.runtime.tensor(weight)), padding=1,
                                                   data_layout="NHWC", kernel_layout="HWIO", out_dtype=out_dtype))
            wide = builder.emit(relax.op.astype(conv, "float32"))
            out = builder.emit_output(relax.op.nn.relu(relax.op.add(wide, relax.const(bias))))
        builder.emit_func_output(out)
    builds = {fast_math: relay_amp.build(builder.get(), tvm.target.Target(ZEN4), fast_math=fast_math)
              for fast_math in (True, False)}
    assert "winograd" in builds[True].as_text() and "winograd" not in builds[False].as_text()
    if not relay_amp.targets.host_supports("avx512_bf16"):
        pytest.skip("the host has no avx512_bf16")
    x = cast_array(rng.standard_normal(shape).astype("float32"), "bfloat16")
    padded = np.pad(x.astype("float64"), [(0, 0), (1, 1), (1, 1), (0, 0)])
    direct = sum(np.einsum("nhwc,ck->nhwk", padded[:, i:i + 15, j:j + 14], weight[i, j].astype("float64"))
                 for i in range(3) for j in range(3))
    expected = np.maximum(direct + bias, 0)
    for executable in builds.values():
        got = run_executable(executable, [x])[0]
        assert np.abs(got - expected).max() <= 1e-2 * np.abs(expected).max()


def test_torchvisions_vgg11_in_bf16_on_zen4_runs_its_wide_3x3_convs_as_winograd_and_matches_pytorch():
    """A model the bf16 measurements did not use (VGG-11's convolutions at 64x64, random weights, through AMP): its
    convs with 32x32 and 16x16 outputs take bf16 Winograd, the 8x8 and 4x4 ones and the first (3 channels) do not;
    within 2e-2 of PyTorch fp32's largest output where the host runs avx512_bf16."""
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    mod, x, expected = torchvision_through_onnx(torchvision.models.vgg11(weights=None).features, 64)
    executable = relay_amp.build(relay_amp.to_mixed_precision(mod, "bfloat16"), tvm.target.Target(ZEN4))
    calls = [line for line in executable.as_text().splitlines() if line.strip().startswith("call ")]
    assert sum("winograd_output" in line for line in calls) == 3
    if not relay_amp.targets.host_supports("avx512_bf16"):
        pytest.skip("the host has no avx512_bf16")
    got = run_executable(executable, [x])[0]
    assert np.abs(got - expected).max() <= 2e-2 * np.abs(expected).max()
