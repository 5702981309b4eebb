"""norms: a channels-last group norm as one pass of per-channel sums, a function of its scale and shift, and one
multiply-add per element."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import relay_amp
from relay_amp._ir import tensor_dtype, tensor_shape
from relay_amp.backend.cpu.norms import GroupNormsOverChannels
from relay_amp.runtime import run_executable

from builders import timm_through_onnx
from pass_checks import assert_transforms, prepared_module


def _bits_widened(value):
    """A bf16 value as fp32, its bits shifted into place (called as the TVMScript below is parsed)."""
    return T.reinterpret("float32", T.Cast("uint32", T.reinterpret("uint16", value)) << T.uint32(16))


def test_a_channels_last_group_norm_takes_its_sums_in_one_pass_and_its_scale_and_shift_in_one_function():
    """The sums of each channel's deviations from its first value and their squares in one reduction; each group's
    mean and variance, and each channel's scale and shift, in one small function; one multiply-add per element."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 2, 8), "float32"), gamma: R.Tensor((8,), "float32"),
                 beta: R.Tensor((8,), "float32")) -> R.Tensor((1, 2, 2, 8), "float32"):
            with R.dataflow():
                gv = R.nn.group_norm(x, gamma, beta, num_groups=2, channel_axis=3, axes=[1, 2], epsilon=1e-5)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def moments(x: T.Buffer((T.int64(1), T.int64(2), T.int64(2), T.int64(8)), "float32"),
                    sums: T.Buffer((T.int64(1), T.int64(8)), "float32"),
                    squares: T.Buffer((T.int64(1), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for image, channel, k0, k1 in T.grid(T.int64(1), T.int64(8), T.int64(2), T.int64(2)):
                with T.sblock("moments"):
                    v_image, v_channel, v_k0, v_k1 = T.axis.remap("SSRR", [image, channel, k0, k1])
                    with T.init():
                        sums[v_image, v_channel] = T.float32(0.0)
                        squares[v_image, v_channel] = T.float32(0.0)
                    # deviations from the channel's first value
                    v_sums: T.let[T.float32] = sums[v_image, v_channel] + (
                        x[v_image, v_k0, v_k1, v_channel] - x[v_image, T.int64(0), T.int64(0), v_channel])
                    v_squares: T.let[T.float32] = squares[v_image, v_channel] + (
                        x[v_image, v_k0, v_k1, v_channel] - x[v_image, T.int64(0), T.int64(0), v_channel]) * (
                        x[v_image, v_k0, v_k1, v_channel] - x[v_image, T.int64(0), T.int64(0), v_channel])
                    sums[v_image, v_channel] = v_sums
                    squares[v_image, v_channel] = v_squares

        @T.prim_func(private=True, s_tir=True)
        def scale_and_shift(sums: T.Buffer((1, 8), "float32"), squares: T.Buffer((1, 8), "float32"),
                            values: T.Buffer((1, 2, 2, 8), "float32"), gamma: T.Buffer((8,), "float32"),
                            beta: T.Buffer((8,), "float32"), scale: T.Buffer((1, 1, 1, 8), "float32"),
                            shift: T.Buffer((1, 1, 1, 8), "float32")):
            T.func_attr({"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True})
            channel_mean = T.sblock_alloc_buffer((1, 8))
            group_mean = T.sblock_alloc_buffer((1, 2))
            group_variance = T.sblock_alloc_buffer((1, 2))
            for image, channel in T.grid(1, 8):
                with T.sblock("channel_mean"):
                    v_image, v_channel = T.axis.remap("SS", [image, channel])
                    # 4 pixels a channel
                    channel_mean[v_image, v_channel] = (values[v_image, 0, 0, v_channel]
                                                        + sums[v_image, v_channel] * T.float32(0.25))
            for image, group, member in T.grid(1, 2, 4):
                with T.sblock("group_mean"):
                    v_image, v_group, v_member = T.axis.remap("SSR", [image, group, member])
                    with T.init():
                        group_mean[v_image, v_group] = T.float32(0.0)
                    group_mean[v_image, v_group] = (group_mean[v_image, v_group]
                                                    + channel_mean[v_image, v_group * 4 + v_member] * T.float32(0.25))
            for image, group, member in T.grid(1, 2, 4):
                with T.sblock("group_variance"):
                    v_image, v_group, v_member = T.axis.remap("SSR", [image, group, member])
                    with T.init():
                        group_variance[v_image, v_group] = T.float32(0.0)
                    # the channel's squared deviations from its mean, and 4 pixels' of its mean's from the group's
                    group_variance[v_image, v_group] = group_variance[v_image, v_group] + (
                        squares[v_image, v_group * 4 + v_member]
                        - sums[v_image, v_group * 4 + v_member] * sums[v_image, v_group * 4 + v_member]
                        * T.float32(0.25) + T.float32(4.0)
                        * (channel_mean[v_image, v_group * 4 + v_member] - group_mean[v_image, v_group])
                        * (channel_mean[v_image, v_group * 4 + v_member] - group_mean[v_image, v_group])
                    ) * T.float32(0.0625)
            for image, i0, i1, i2 in T.grid(1, 1, 1, 8):
                with T.sblock("scale"):
                    v_image, v_i0, v_i1, v_i2 = T.axis.remap("SSSS", [image, i0, i1, i2])
                    scale[v_image, v_i0, v_i1, v_i2] = gamma[v_i2] * T.rsqrt(group_variance[v_image, v_i2 // 4]
                                                                             + T.float32(1e-05))
            for image, i0, i1, i2 in T.grid(1, 1, 1, 8):
                with T.sblock("shift"):
                    v_image, v_i0, v_i1, v_i2 = T.axis.remap("SSSS", [image, i0, i1, i2])
                    shift[v_image, v_i0, v_i1, v_i2] = (beta[v_i2] - group_mean[v_image, v_i2 // 4]
                                                        * scale[v_image, v_i0, v_i1, v_i2])

        @R.function
        def main(x: R.Tensor((1, 2, 2, 8), "float32"), gamma: R.Tensor((8,), "float32"),
                 beta: R.Tensor((8,), "float32")) -> R.Tensor((1, 2, 2, 8), "float32"):
            cls = Expected
            with R.dataflow():
                moments = R.call_tir(cls.moments, (x,), out_ty=[R.Tensor((1, 8), "float32"),
                                                               R.Tensor((1, 8), "float32")])
                sums: R.Tensor((1, 8), "float32") = moments[0]
                squares: R.Tensor((1, 8), "float32") = moments[1]
                affine = R.call_tir(cls.scale_and_shift, (sums, squares, x, gamma, beta),
                                    out_ty=[R.Tensor((1, 1, 1, 8), "float32"), R.Tensor((1, 1, 1, 8), "float32")])
                scale: R.Tensor((1, 1, 1, 8), "float32") = affine[0]
                scaled = R.multiply(x, scale)
                shift: R.Tensor((1, 1, 1, 8), "float32") = affine[1]
                gv = R.add(scaled, shift)
                R.output(gv)
            return gv

    assert_transforms(GroupNormsOverChannels(), Before, Expected)


def test_the_sums_of_a_widened_bf16_tensor_read_it_as_stored():
    """The moments and the first values read the bf16 tensor, widened by its bits as they load it (TVM's bf16
    legalization got a cast inside a reduction of two values wrong); only the multiply-add reads the cast."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 2, 8), "bfloat16"), gamma: R.Tensor((8,), "float32"),
                 beta: R.Tensor((8,), "float32")) -> R.Tensor((1, 2, 2, 8), "float32"):
            with R.dataflow():
                wide = R.astype(x, "float32")
                gv = R.nn.group_norm(wide, gamma, beta, num_groups=2, channel_axis=3, axes=[1, 2], epsilon=1e-5)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def moments(x: T.Buffer((T.int64(1), T.int64(2), T.int64(2), T.int64(8)), "bfloat16"),
                    sums: T.Buffer((T.int64(1), T.int64(8)), "float32"),
                    squares: T.Buffer((T.int64(1), T.int64(8)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for image, channel, k0, k1 in T.grid(T.int64(1), T.int64(8), T.int64(2), T.int64(2)):
                with T.sblock("moments"):
                    v_image, v_channel, v_k0, v_k1 = T.axis.remap("SSRR", [image, channel, k0, k1])
                    with T.init():
                        sums[v_image, v_channel] = T.float32(0.0)
                        squares[v_image, v_channel] = T.float32(0.0)
                    v_sums: T.let[T.float32] = sums[v_image, v_channel] + (
                        _bits_widened(x[v_image, v_k0, v_k1, v_channel])
                        - _bits_widened(x[v_image, T.int64(0), T.int64(0), v_channel]))
                    v_squares: T.let[T.float32] = squares[v_image, v_channel] + (
                        _bits_widened(x[v_image, v_k0, v_k1, v_channel])
                        - _bits_widened(x[v_image, T.int64(0), T.int64(0), v_channel])) * (
                        _bits_widened(x[v_image, v_k0, v_k1, v_channel])
                        - _bits_widened(x[v_image, T.int64(0), T.int64(0), v_channel]))
                    sums[v_image, v_channel] = v_sums
                    squares[v_image, v_channel] = v_squares

        @T.prim_func(private=True, s_tir=True)
        def scale_and_shift(sums: T.Buffer((1, 8), "float32"), squares: T.Buffer((1, 8), "float32"),
                            values: T.Buffer((1, 2, 2, 8), "bfloat16"), gamma: T.Buffer((8,), "float32"),
                            beta: T.Buffer((8,), "float32"), scale: T.Buffer((1, 1, 1, 8), "float32"),
                            shift: T.Buffer((1, 1, 1, 8), "float32")):
            T.func_attr({"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True})
            channel_mean = T.sblock_alloc_buffer((1, 8))
            group_mean = T.sblock_alloc_buffer((1, 2))
            group_variance = T.sblock_alloc_buffer((1, 2))
            for image, channel in T.grid(1, 8):
                with T.sblock("channel_mean"):
                    v_image, v_channel = T.axis.remap("SS", [image, channel])
                    channel_mean[v_image, v_channel] = (_bits_widened(values[v_image, 0, 0, v_channel])
                                                        + sums[v_image, v_channel] * T.float32(0.25))
            for image, group, member in T.grid(1, 2, 4):
                with T.sblock("group_mean"):
                    v_image, v_group, v_member = T.axis.remap("SSR", [image, group, member])
                    with T.init():
                        group_mean[v_image, v_group] = T.float32(0.0)
                    group_mean[v_image, v_group] = (group_mean[v_image, v_group]
                                                    + channel_mean[v_image, v_group * 4 + v_member] * T.float32(0.25))
            for image, group, member in T.grid(1, 2, 4):
                with T.sblock("group_variance"):
                    v_image, v_group, v_member = T.axis.remap("SSR", [image, group, member])
                    with T.init():
                        group_variance[v_image, v_group] = T.float32(0.0)
                    # the channel's squared deviations from its mean, and 4 pixels' of its mean's from the group's
                    group_variance[v_image, v_group] = group_variance[v_image, v_group] + (
                        squares[v_image, v_group * 4 + v_member]
                        - sums[v_image, v_group * 4 + v_member] * sums[v_image, v_group * 4 + v_member]
                        * T.float32(0.25) + T.float32(4.0)
                        * (channel_mean[v_image, v_group * 4 + v_member] - group_mean[v_image, v_group])
                        * (channel_mean[v_image, v_group * 4 + v_member] - group_mean[v_image, v_group])
                    ) * T.float32(0.0625)
            for image, i0, i1, i2 in T.grid(1, 1, 1, 8):
                with T.sblock("scale"):
                    v_image, v_i0, v_i1, v_i2 = T.axis.remap("SSSS", [image, i0, i1, i2])
                    scale[v_image, v_i0, v_i1, v_i2] = gamma[v_i2] * T.rsqrt(group_variance[v_image, v_i2 // 4]
                                                                             + T.float32(1e-05))
            for image, i0, i1, i2 in T.grid(1, 1, 1, 8):
                with T.sblock("shift"):
                    v_image, v_i0, v_i1, v_i2 = T.axis.remap("SSSS", [image, i0, i1, i2])
                    shift[v_image, v_i0, v_i1, v_i2] = (beta[v_i2] - group_mean[v_image, v_i2 // 4]
                                                        * scale[v_image, v_i0, v_i1, v_i2])

        @R.function
        def main(x: R.Tensor((1, 2, 2, 8), "bfloat16"), gamma: R.Tensor((8,), "float32"),
                 beta: R.Tensor((8,), "float32")) -> R.Tensor((1, 2, 2, 8), "float32"):
            cls = Expected
            with R.dataflow():
                wide = R.astype(x, "float32")  # read by the multiply-add alone
                moments = R.call_tir(cls.moments, (x,), out_ty=[R.Tensor((1, 8), "float32"),
                                                               R.Tensor((1, 8), "float32")])
                sums: R.Tensor((1, 8), "float32") = moments[0]
                squares: R.Tensor((1, 8), "float32") = moments[1]
                affine = R.call_tir(cls.scale_and_shift, (sums, squares, x, gamma, beta),
                                    out_ty=[R.Tensor((1, 1, 1, 8), "float32"), R.Tensor((1, 1, 1, 8), "float32")])
                scale: R.Tensor((1, 1, 1, 8), "float32") = affine[0]
                scaled = R.multiply(wide, scale)
                shift: R.Tensor((1, 1, 1, 8), "float32") = affine[1]
                gv = R.add(scaled, shift)
                R.output(gv)
            return gv

    assert_transforms(GroupNormsOverChannels(), Before, Expected)


def _conv_group_norm(shared: bool) -> tvm.IRModule:
    """A bf16 conv whose fp32 result a group norm reads (`shared`: and an add too)."""
    x = relax.Var("x", relax.TensorType((1, 4, 4, 8), "bfloat16"))
    weight = relax.const(np.ones((8, 3, 3, 8), "bfloat16"))
    gamma, beta = relax.const(np.ones(8, "float32")), relax.const(np.zeros(8, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = bb.emit(relax.op.nn.conv2d(x, weight, padding=1, data_layout="NHWC", kernel_layout="OHWI",
                                              out_dtype="float32"))
            out = bb.emit(relax.op.nn.group_norm(conv, gamma, beta, 2, 3, [1, 2]))
            if shared:
                out = bb.emit(relax.op.add(out, conv))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("shared", [False, True], ids=["norm-only", "read-by-an-add-too"])
def test_a_bf16_convs_result_is_rounded_for_its_norm_only_where_the_norm_alone_reads_it(shared):
    """Rounded to bf16 for the sums, the conv's result is stored in bf16 by its kernel; where another op reads the
    fp32 result too, the kernel stores fp32 anyway, and a rounded copy would only add a pass."""
    after = GroupNormsOverChannels()(_conv_group_norm(shared))
    relax.analysis.well_formed(after)
    bindings = after["main"].body.blocks[0].bindings
    casts = [b.value.attrs.dtype for b in bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.astype"]
    moments = [b.value.args[1].fields[0] for b in bindings if isinstance(b.value, relax.Call)
               and b.value.op.name == "relax.call_tir" and b.value.args[0].name_hint == "moments"]
    assert (casts, [tensor_dtype(read) for read in moments]) == (
        ([], ["float32"]) if shared else (["bfloat16", "float32"], ["bfloat16"]))


@I.ir_module
class ChannelsFirst:
    @R.function
    def main(x: R.Tensor((1, 8, 2, 2), "float32"), gamma: R.Tensor((8,), "float32"),
             beta: R.Tensor((8,), "float32")) -> R.Tensor((1, 8, 2, 2), "float32"):
        with R.dataflow():
            gv = R.nn.group_norm(x, gamma, beta, num_groups=2, channel_axis=1, axes=[2, 3])
            R.output(gv)
        return gv


@I.ir_module
class HalfPrecision:
    @R.function
    def main(x: R.Tensor((1, 2, 2, 8), "float16"), gamma: R.Tensor((8,), "float16"),
             beta: R.Tensor((8,), "float16")) -> R.Tensor((1, 2, 2, 8), "float16"):
        with R.dataflow():
            gv = R.nn.group_norm(x, gamma, beta, num_groups=2, channel_axis=3, axes=[1, 2])
            R.output(gv)
        return gv


@I.ir_module
class DynamicBatch:
    @R.function
    def main(x: R.Tensor(("n", 2, 2, 8), "float32"), gamma: R.Tensor((8,), "float32"),
             beta: R.Tensor((8,), "float32")) -> R.Tensor(("n", 2, 2, 8), "float32"):
        with R.dataflow():
            gv = R.nn.group_norm(x, gamma, beta, num_groups=2, channel_axis=3, axes=[1, 2])
            R.output(gv)
        return gv


@pytest.mark.parametrize("mod", [ChannelsFirst, HalfPrecision, DynamicBatch],
                         ids=["channels-first", "float16", "dynamic-batch"])
def test_other_group_norms_are_left_to_tvm(mod):
    tvm.ir.assert_structural_equal(GroupNormsOverChannels()(mod), mod)


def _nhwc_group_norm(x: np.ndarray, groups: int, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """GroupNorm of NHWC `x` in float64, the variance from squared deviations."""
    grouped = x.astype("float64").reshape(x.shape[0], -1, groups, x.shape[-1] // groups)
    mean, variance = grouped.mean((1, 3), keepdims=True), grouped.var((1, 3), keepdims=True)
    return ((grouped - mean) / np.sqrt(variance + 1e-5)).reshape(x.shape) * gamma + beta


def _group_norm_module(shape: tuple, gamma: np.ndarray, beta: np.ndarray, groups: int) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            norm = bb.emit_output(relax.op.nn.group_norm(x, relax.const(gamma), relax.const(beta), groups, 3, [1, 2]))
        bb.emit_func_output(norm)
    return bb.get()


def test_a_built_channels_last_group_norm_keeps_its_digits_where_the_mean_dwarfs_the_deviation():
    """Mean 300, deviation 1 (a pre-norm activation after a bias): squared deviations keep the variance's digits,
    which E[x^2] - E[x]^2 in fp32 (TVM's legalization) loses."""
    rng = np.random.default_rng(0)
    data = (300 + rng.standard_normal((1, 14, 14, 64))).astype("float32")
    gamma, beta = rng.uniform(0.5, 1.5, 64).astype("float32"), rng.standard_normal(64).astype("float32")
    mod = _group_norm_module(data.shape, gamma, beta, 8)
    built = run_executable(relay_amp.build(mod, relay_amp.targets.host_preset()), [data])[0]
    reference = _nhwc_group_norm(data, 8, gamma, beta)
    np.testing.assert_allclose(built, reference, atol=1e-3)  # TVM's legalization: 0.35 off


@pytest.mark.parametrize("groups", [4, 64])
def test_a_built_channels_last_group_norm_normalizes_each_image_of_a_batch_apart(groups):
    """Three images of other scales; 64 groups of one channel: an instance norm. The shift was reshaped to the
    batch's size, which failed to build for any batch over 1."""
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((3, 6, 6, 64)) * np.array([1.0, 5.0, 0.2]).reshape(3, 1, 1, 1)).astype("float32")
    gamma, beta = rng.uniform(0.5, 1.5, 64).astype("float32"), rng.standard_normal(64).astype("float32")
    built = run_executable(relay_amp.build(_group_norm_module(data.shape, gamma, beta, groups)), [data])[0]
    np.testing.assert_allclose(built, _nhwc_group_norm(data, groups, gamma, beta), atol=1e-4)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_a_group_norm_between_convs_builds_in_nhwc_and_matches_tvms_build(dtype, tolerance):
    """conv, GroupNorm(4, 32), ReLU, conv from an NCHW model, built on the host (NHWC, the kernels) against TVM's
    plain build of the fp32 model; bf16 within bf16's rounding (relative to the largest output)."""
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(shape).astype("float32") * 0.2 for shape in [(32, 8, 3, 3), (16, 32, 1, 1)]]
    gamma, beta = rng.uniform(0.5, 1.5, 32).astype("float32"), rng.standard_normal(32).astype("float32")
    x = relax.Var("x", relax.TensorType((1, 8, 12, 12), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            first = bb.emit(relax.op.nn.conv2d(x, relax.const(weights[0]), padding=1))
            norm = bb.emit(relax.op.nn.group_norm(first, relax.const(gamma), relax.const(beta), 4, 1, [2, 3]))
            out = bb.emit_output(relax.op.nn.conv2d(bb.emit(relax.op.nn.relu(norm)), relax.const(weights[1])))
        bb.emit_func_output(out)
    fp32 = bb.get()
    mod = fp32 if dtype == "float32" else relay_amp.to_mixed_precision(fp32, dtype)
    data = rng.standard_normal((1, 8, 12, 12)).astype("float32")
    built = run_executable(relay_amp.build(mod, relay_amp.targets.host_preset()), [data])[0]
    reference = relay_amp.run(fp32, [data])[0]
    np.testing.assert_allclose(built.astype("float32"), reference, atol=tolerance * np.abs(reference).max())


def test_a_timm_group_norm_model_in_bf16_sums_its_convs_outputs_as_stored(tmp_path):
    """timm's EfficientNet-B0 with group norms (conv, GroupNorm, SiLU): every per-channel sum over an image (and
    the first values the scale and shift read) reads a bf16 tensor, so no kernel stores its output in fp32 for a
    norm, and the bf16 build is as close to PyTorch's fp32 as PyTorch's own bf16."""
    pytest.importorskip("timm")
    _, imported, x, expected = timm_through_onnx("efficientnet_b0_gn", tmp_path)
    mod = relay_amp.to_mixed_precision(imported, "bfloat16")
    main = prepared_module(mod)["main"]
    image_reads = [read for block in main.body.blocks for binding in block.bindings
                   if isinstance(binding.value, relax.Call) and binding.value.op.name == "relax.call_tir"
                   and binding.value.args[0].name_hint.startswith(("moments", "scale_and_shift"))
                   for read in binding.value.args[1].fields if len(tensor_shape(read)) == 4]
    assert len(image_reads) == 2 * 49 and {tensor_dtype(read) for read in image_reads} == {"bfloat16"}
    built = run_executable(relay_amp.build(mod, relay_amp.targets.host_preset()), [x])[0].astype("float32")
    # random weights: PyTorch's own bf16 autocast is 0.085 of the largest logit off its fp32 here (this build 0.057)
    assert np.abs(built - expected).max() <= 0.1 * np.abs(expected).max()


def test_a_built_group_norm_of_bf16_sequences_matches_float64():
    """A batch of two [T, C] bf16 sequences (wav2vec2's conv front end normalizes NWC so), widened for the norm,
    mean 50 and deviation 2: the moments read the bf16 values by their bits, each image apart, within fp32's
    rounding of the float64 norm of the same bf16 values."""
    rng = np.random.default_rng(2)
    data = (50 + 2 * rng.standard_normal((2, 40, 32))).astype(ml_dtypes.bfloat16)
    gamma, beta = rng.uniform(0.5, 1.5, 32).astype("float32"), rng.standard_normal(32).astype("float32")
    x = relax.Var("x", relax.TensorType(data.shape, "bfloat16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(x, "float32"))
            norm = bb.emit_output(relax.op.nn.group_norm(wide, relax.const(gamma), relax.const(beta), 4, 2, [1]))
        bb.emit_func_output(norm)
    built = run_executable(relay_amp.build(bb.get(), relay_amp.targets.host_preset()), [data])[0]
    images = data.astype("float64").reshape(2, 40, 4, 8)
    mean, variance = images.mean((1, 3), keepdims=True), images.var((1, 3), keepdims=True)
    reference = ((images - mean) / np.sqrt(variance + 1e-5)).reshape(data.shape) * gamma + beta
    np.testing.assert_allclose(built, reference, atol=1e-4)
