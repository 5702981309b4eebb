"""epilogue: the bias, scale, residual, clamp, cast and reshape ops after an AMX kernel become its epilogue."""

import math

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import targets
from relay_amp._ir import tensor_shape
from relay_amp.backend.cpu import amx, dispatch, formula, kernels
from relay_amp.backend.cpu.affine import FoldAffineClamps
from relay_amp.backend.cpu.epilogue import FuseKernelEpilogues
from relay_amp.compile.build import build
from relay_amp.ops import call_op_name
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor
from conv_cases import reference_conv
from pass_checks import assert_transforms

BF16, F32 = "bfloat16", "float32"
SHAPE = (1, 14, 14, 64)  # NHWC; a 3x3 conv with padding 1 keeps it, and its rows fill whole tiles (2 x 7)
RNG = np.random.default_rng(0)
WEIGHT = RNG.standard_normal((3, 3, 64, 64)).astype(ml_dtypes.bfloat16) / 8  # HWIO
BIAS = RNG.standard_normal(64).astype("float32")
SCALE = RNG.uniform(0.5, 2.0, 64).astype("float32")


def _conv(x: relax.Expr) -> relax.Expr:
    return relax.op.nn.conv2d(x, relax.const(WEIGHT), padding=1, data_layout="NHWC", kernel_layout="HWIO",
                              out_dtype=F32)


def _chain_module(*ops, residual_dtype: str = F32) -> tvm.IRModule:
    """main(x, r): a bf16 conv's fp32 result through `ops` (each a function of the value and r), one binding each."""
    x, r = tensor("x", SHAPE, BF16), tensor("r", SHAPE, residual_dtype)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r]):
        with bb.dataflow():
            value = bb.emit(_conv(x))
            for op in ops[:-1]:
                value = bb.emit(op(value, r))
            out = bb.emit_output(ops[-1](value, r))
        bb.emit_func_output(out)
    return bb.get()


def _dispatched(mod: tvm.IRModule) -> tvm.IRModule:
    return dispatch.UseDotKernels({BF16}, amx_dtypes={BF16})(mod)


def _spec() -> kernels.ConvSpec:
    return kernels.ConvSpec((1, 16, 16, 64), (3, 3), 64)


def _expected(epilogue: kernels.Epilogue, operands, residual_dtype: str = F32, reshape=None) -> tvm.IRModule:
    """main(x, r) as the pass should leave it: the padded input into one AMX kernel with `epilogue`."""
    x, r = tensor("x", SHAPE, BF16), tensor("r", SHAPE, residual_dtype)
    spec = _spec()
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r]):
        with bb.dataflow():
            padded = bb.emit(relax.op.nn.pad(x, [0, 0, 1, 1, 1, 1, 0, 0]))
            gvar = bb.add_func(amx.conv2d_nhwc(spec, epilogue), "relay_amp_dot_kernel")
            packed = relax.const(kernels.pack_weight(WEIGHT, "HWIO", kernels.BF16_DOT))
            call = relax.call_tir(gvar, [padded, packed, *(operand(r) for operand in operands)],
                                  relax.TensorType(spec.out_shape, epilogue.out_dtype))
            out = bb.emit_output(call if reshape is None else relax.op.reshape(bb.emit(call), reshape))
        bb.emit_func_output(out)
    return bb.get()


def test_bias_residual_relu_and_cast_become_the_kernels_epilogue():
    before = _dispatched(_chain_module(
        lambda v, r: relax.op.add(v, relax.const(BIAS.reshape(1, 1, 1, 64))),
        lambda v, r: relax.op.add(r, v),
        lambda v, r: relax.op.nn.relu(v),
        lambda v, r: relax.op.astype(v, BF16)))
    steps = (kernels.Step(kernels.BIAS), kernels.Step(kernels.RESIDUAL), kernels.Step(kernels.CLIP, low=0.0))
    expected = _expected(kernels.Epilogue(steps, F32, BF16), [lambda r: relax.const(BIAS), lambda r: r])
    assert_transforms(FuseKernelEpilogues(), before, expected)
    assert_transforms(relay_amp.transform.FuseKernelEpilogues(), before, expected)


def test_scale_and_clip_then_a_reshape_keeping_the_channels():
    before = _dispatched(_chain_module(
        lambda v, r: relax.op.multiply(relax.const(SCALE), v),
        lambda v, r: relax.op.clip(v, 0.0, 6.0),
        lambda v, r: relax.op.reshape(v, (196, 64))))
    steps = (kernels.Step(kernels.SCALE), kernels.Step(kernels.CLIP, 0.0, 6.0))
    expected = _expected(kernels.Epilogue(steps, "", F32), [lambda r: relax.const(SCALE)], reshape=(196, 64))
    assert_transforms(FuseKernelEpilogues(), before, expected)


def test_maximum_and_minimum_by_scalars_are_a_clip():
    """ReLU6 as relay_amp's frontends write it (relay_amp._ir.clamps_as_max_min)."""
    before = _dispatched(_chain_module(
        lambda v, r: relax.op.maximum(v, relax.const(0.0, F32)),
        lambda v, r: relax.op.minimum(relax.const(6.0, F32), v)))
    steps = (kernels.Step(kernels.CLIP, low=0.0), kernels.Step(kernels.CLIP, high=6.0))
    assert_transforms(FuseKernelEpilogues(), before, _expected(kernels.Epilogue(steps, "", F32), []))


@pytest.mark.parametrize("reason,ops", [
    ("a reduction is not elementwise", [lambda v, r: relax.op.sum(v, axis=[3])]),
    ("a constant that varies by pixel", [lambda v, r: relax.op.add(v, relax.const(np.ones(SHAPE, F32)))]),
    ("a reshape that moves the channels", [lambda v, r: relax.op.reshape(v, (1, 14, 112, 8))]),
    ("a maximum by a tensor", [lambda v, r: relax.op.maximum(v, r)]),
])
def test_ops_the_epilogue_cannot_take_are_left_alone(reason, ops):
    before = _dispatched(_chain_module(*ops))
    assert_transforms(FuseKernelEpilogues(), before, before)


def test_a_value_also_read_outside_the_epilogue_ends_the_chain_and_is_stored():
    x = tensor("x", SHAPE, BF16)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            biased = bb.emit(relax.op.add(bb.emit(_conv(x)), relax.const(BIAS)))
            relu = bb.emit(relax.op.nn.relu(biased))
            doubled = bb.emit(relax.op.add(relu, relax.op.astype(relax.op.astype(relu, BF16), F32)))
            out = bb.emit_output(relax.Tuple([doubled, relax.op.sum(relu, axis=[3])]))
        bb.emit_func_output(out)
    after = FuseKernelEpilogues()(_dispatched(bb.get()))
    relax.analysis.well_formed(after)
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    kernel = next(c for c in calls if c.op.name == "relax.call_tir")
    assert len(kernel.args[1].fields) == 3 and kernel.ty.dtype == F32  # data, weight, bias; relu stored in fp32
    assert [c.op.name for c in calls[-4:]] == ["relax.astype", "relax.astype", "relax.add", "relax.sum"]


# x * sigmoid(x) as formula.of_call reads it under fast math
SILU = ("fast_divide", ("x",), ("add", ("fast_exp_negative", ("x",)), ("const", 1.0)))  # x * sigmoid(x): x / (1 + e^-x)


def test_an_activation_reading_its_input_twice_becomes_one_map_step():
    """SiLU as ONNX spells it (Sigmoid, then Mul by the input) after the bias, then the cast AMP adds."""
    before = _dispatched(_chain_module(
        lambda v, r: relax.op.add(v, relax.const(BIAS)),
        lambda v, r: relax.op.multiply(v, relax.op.sigmoid(v)),
        lambda v, r: relax.op.astype(v, BF16)))
    steps = (kernels.Step(kernels.BIAS), kernels.Step(kernels.MAP, formula=SILU))
    expected = _expected(kernels.Epilogue(steps, "", BF16), [lambda r: relax.const(BIAS)])
    assert_transforms(FuseKernelEpilogues(), before, expected)


def _exported_gelu(v: relax.Expr, r: relax.Expr) -> relax.Expr:
    """GELU as torch.onnx.export spells it, on a bf16 value AMP casts up twice."""
    erf = relax.op.erf(relax.op.divide(relax.op.astype(v, F32), relax.const(1.4142135, F32)))
    product = relax.op.multiply(relax.op.astype(v, F32), relax.op.add(erf, relax.const(1.0, F32)))
    return relax.op.multiply(product, relax.const(0.5, F32))


def test_an_exported_gelu_after_amps_casts_becomes_one_map_step():
    before = _dispatched(_chain_module(lambda v, r: relax.op.add(v, relax.const(BIAS)),
                                       lambda v, r: relax.op.astype(v, BF16), _exported_gelu,
                                       lambda v, r: relax.op.astype(v, BF16)))
    erf = ("fast_erf", ("multiply", ("x",), ("const", 1.0 / float(np.float32(1.4142135)))))  # x / sqrt(2)
    gelu = ("multiply", ("multiply", ("x",), ("add", erf, ("const", 1.0))), ("const", 0.5))
    steps = (kernels.Step(kernels.BIAS), kernels.Step(kernels.MAP, formula=gelu))
    assert_transforms(FuseKernelEpilogues(), before,
                      _expected(kernels.Epilogue(steps, "", BF16), [lambda r: relax.const(BIAS)]))


@pytest.mark.parametrize("preset,feature", [("cpu-amx", "amx_bf16"), ("cpu-avx512-bf16", "avx512_bf16")])
def test_an_exported_gelu_in_the_epilogue_matches_numpy(preset, feature):
    if not targets.host_supports(feature) or (preset == "cpu-amx" and not _amx_host()):
        pytest.skip(f"host CPU (or kernel) cannot run {preset}")
    mod = _chain_module(lambda v, r: relax.op.add(v, relax.const(BIAS)), lambda v, r: relax.op.astype(v, BF16),
                        _exported_gelu, lambda v, r: relax.op.astype(v, BF16))
    executable = build(mod, preset)
    x = RNG.standard_normal(SHAPE).astype(ml_dtypes.bfloat16)
    got = run_executable(executable, [x, np.zeros(SHAPE, F32)])[0].astype("float64")
    conv = reference_conv(np.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)]), WEIGHT.transpose(3, 2, 0, 1), _spec()) + BIAS
    expected = conv * 0.5 * (1.0 + np.vectorize(math.erf)(conv / math.sqrt(2.0)))
    # the GELU of the fp32 sum (the epilogue skips AMP's bf16 rounding before it), rounded once to bf16
    assert np.all(np.abs(got - expected) <= 2 ** -8 * np.abs(expected) + 1e-4)


def test_a_leaky_relu_becomes_one_map_step():
    before = _dispatched(_chain_module(lambda v, r: relax.op.add(v, relax.const(BIAS)),
                                       lambda v, r: relax.op.nn.leakyrelu(v, 0.1),
                                       lambda v, r: relax.op.astype(v, BF16)))
    leaky = ("add", ("maximum", ("x",), ("const", 0.0)),
             ("multiply", ("minimum", ("x",), ("const", 0.0)), ("const", 0.1)))
    steps = (kernels.Step(kernels.BIAS), kernels.Step(kernels.MAP, formula=leaky))
    assert_transforms(FuseKernelEpilogues(), before,
                      _expected(kernels.Epilogue(steps, "", BF16), [lambda r: relax.const(BIAS)]))


def test_a_darknets_leaky_relus_all_run_in_its_kernels(tmp_path):
    """timm's DarkNet-17 through ONNX (a model the rule was not written on): every one of its 17 LeakyReLUs runs in
    the write-back of the conv before it, in fp32 and in bf16 (each was a function of its own, with a transpose
    back to NCHW and forth around it), and the fp32 build matches PyTorch. Where a conv takes Winograd's form (fp32
    on AVX2, Zen 4 and AMX hosts), its LeakyReLU runs in the output transform, the conv's write-back there."""
    from builders import timm_through_onnx
    from pass_checks import prepared_function_names

    _, imported, x, expected = timm_through_onnx("darknet17", tmp_path)
    for model in (imported, relay_amp.to_mixed_precision(imported, BF16)):
        names = prepared_function_names(model)
        assert not [name for name in names if "leaky" in name and "winograd_output_leaky" not in name]
    got = run_executable(relay_amp.build(imported, targets.host_preset()), [x])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def _unit_layer_scales(module) -> None:
    """timm's layer scales start at 1e-6, which hides what the blocks' MLPs compute: 1 instead."""
    for name, parameter in module.named_parameters():
        if name.endswith("gamma"):
            parameter.data.fill_(1.0)


def test_gelus_requantized_to_8_bits_take_the_narrow_erf_in_a_quantized_model(tmp_path):
    """timm's InceptionNeXt-Atto (a model the rule was not written on), quantized: each ConvMlp's GELU runs in the
    write-back of its first 1x1 conv, which requantizes it to uint8 for the second, with the division-free erf; the
    model stays within int8's error of PyTorch (0.027 of the largest logit here, 0.023 with TVM's fast_erf)."""
    from builders import timm_through_onnx
    from pass_checks import prepared_module

    _, imported, x, expected = timm_through_onnx("inception_next_atto", tmp_path, edit=_unit_layer_scales)
    rng = np.random.default_rng(0)
    quantized = relay_amp.quantize(imported, [rng.standard_normal(x.shape).astype(F32) for _ in range(4)])
    requantizing = [func.script() for gv, func in prepared_module(quantized).functions.items()
                    if gv.name_hint.startswith("relay_amp_dot_kernel")
                    and func.params[-1].dtype in kernels.QUANTIZED_DTYPES]  # uint8 codes here (GELUs are signed)
    narrow_erf_constant = f"{formula.NARROW_ERF_POLYNOMIAL[0]:.6f}"[:7]
    assert len([text for text in requantizing if narrow_erf_constant in text]) == 12  # one per block's MLP
    assert not [text for text in requantizing if " / " in text]
    got = run_executable(relay_amp.build(quantized, targets.host_preset()), [x])[0]
    assert np.abs(got - expected).max() <= 0.05 * np.abs(expected).max()


def test_exact_math_keeps_libm_in_the_activation():
    before = _dispatched(_chain_module(lambda v, r: relax.op.nn.gelu(v)))
    after = FuseKernelEpilogues(fast_math=False)(before)
    (call,) = [b.value for b in after["main"].body.blocks[0].bindings
               if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    script = after[call.args[0]].script()
    assert "T.erf(" in script and "T.float32(-2.72614" not in script  # libm's erf, not fast_erf's polynomial


def test_a_module_without_amx_kernels_is_returned_as_it_is():
    mod = _chain_module(lambda v, r: relax.op.nn.relu(v))
    assert FuseKernelEpilogues()(mod).same_as(mod)


def _amx_host() -> bool:
    return targets.host_runs_amx()


@pytest.mark.parametrize("residual_dtype", [F32, BF16])
def test_fused_build_matches_fp32_numpy(residual_dtype):
    if not _amx_host():
        pytest.skip("host CPU (or kernel) has no AMX")
    mod = _chain_module(lambda v, r: relax.op.add(v, relax.const(BIAS)),
                        lambda v, r: relax.op.add(v, relax.op.astype(r, F32)) if residual_dtype == BF16
                        else relax.op.add(v, r),
                        lambda v, r: relax.op.clip(v, 0.0, 6.0),
                        lambda v, r: relax.op.astype(v, BF16), residual_dtype=residual_dtype)
    executable = build(mod, "cpu-amx")
    x = RNG.standard_normal(SHAPE).astype(ml_dtypes.bfloat16)
    r = RNG.standard_normal(SHAPE).astype(F32 if residual_dtype == F32 else ml_dtypes.bfloat16)
    got = run_executable(executable, [x, r])[0].astype("float64")
    conv = reference_conv(np.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)]), WEIGHT.transpose(3, 2, 0, 1), _spec())
    expected = np.clip(conv + BIAS + r.astype("float64"), 0.0, 6.0)
    # fp32 sums of the bf16 products (1e-5 of numpy's), rounded once to bf16 (2^-8 relative)
    assert np.all(np.abs(got - expected) <= 2 ** -8 * np.abs(expected) + 1e-4)


def test_int8_accumulators_are_dequantized_in_the_epilogue():
    x = tensor("x", SHAPE, "int8")
    weight = RNG.integers(-128, 128, (1, 1, 64, 64)).astype("int8")
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            acc = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), data_layout="NHWC", kernel_layout="HWIO",
                                             out_dtype="int32"))
            wide = bb.emit(relax.op.astype(acc, F32))
            scaled = bb.emit(relax.op.multiply(wide, relax.const(SCALE)))
            out = bb.emit_output(relax.op.astype(relax.op.add(scaled, relax.const(BIAS)), BF16))
        bb.emit_func_output(out)
    before = bb.get()
    after = FuseKernelEpilogues()(dispatch.UseDotKernels({"int8"}, amx_dtypes={"int8"})(before))
    relax.analysis.well_formed(after)
    (call,) = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert len(call.args[1].fields) == 4 and call.ty.dtype == BF16  # data, weight, scale, bias
    if _amx_host():
        data = RNG.integers(-128, 128, SHAPE).astype("int8")
        got = run_executable(build(after, "cpu-amx"), [data])[0].astype(F32)
        expected = relay_amp.run(before, [data])[0].astype(F32)  # the generic build, unfused
        assert np.all(np.abs(got - expected) <= 2 ** -8 * np.abs(expected))  # exact sums; one bf16 rounding apart


def test_avx512_kernels_take_the_same_epilogue():
    before = dispatch.UseDotKernels({BF16})(_chain_module(
        lambda v, r: relax.op.add(v, relax.const(BIAS)),
        lambda v, r: relax.op.add(v, r),
        lambda v, r: relax.op.nn.relu(v),
        lambda v, r: relax.op.astype(v, BF16)))
    after = FuseKernelEpilogues()(before)
    relax.analysis.well_formed(after)
    (call,) = [b.value for b in after["main"].body.blocks[0].bindings
               if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    epilogue = kernels.Epilogue((kernels.Step(kernels.BIAS), kernels.Step(kernels.RESIDUAL),
                                 kernels.Step(kernels.CLIP, low=0.0)), F32, BF16)
    spec = kernels.ConvSpec((1, 16, 16, 64), (3, 3), 64)
    tvm.ir.assert_structural_equal(after[call.args[0]], kernels.conv2d_nhwc_compute(spec, epilogue))
    if targets.host_supports("avx512_bf16"):
        x = RNG.standard_normal(SHAPE).astype(ml_dtypes.bfloat16)
        r = RNG.standard_normal(SHAPE).astype(F32)
        got = run_executable(build(after, "cpu-avx512-bf16"), [x, r])[0].astype("float64")
        conv = reference_conv(np.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)]), WEIGHT.transpose(3, 2, 0, 1), spec)
        expected = np.maximum(conv + BIAS + r, 0.0)
        assert np.all(np.abs(got - expected) <= 2 ** -8 * np.abs(expected) + 1e-4)


def test_a_residual_widened_from_bf16_is_read_in_bf16():
    """A bf16 residual stream: the kernel reads the bf16 tensor and widens it itself, not AMP's fp32 copy of it."""
    x, r = tensor("x", SHAPE, BF16), tensor("r", SHAPE, BF16)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(r, F32))
            value = bb.emit(relax.op.add(bb.emit(_conv(x)), wide))
            out = bb.emit_output(relax.op.astype(value, BF16))
        bb.emit_func_output(out)
    expected = _expected(kernels.Epilogue((kernels.Step(kernels.RESIDUAL),), BF16, BF16), [lambda r: r],
                         residual_dtype=BF16)
    assert_transforms(FuseKernelEpilogues(), _dispatched(bb.get()), expected)


def test_a_bf16_round_trip_read_only_by_its_cast_back_stays_in_fp32():
    before = _dispatched(_chain_module(
        lambda v, r: relax.op.add(v, relax.const(BIAS)),
        lambda v, r: relax.op.astype(v, BF16),
        lambda v, r: relax.op.astype(v, F32),  # TVM dropped this rounding inside one fused function too
        lambda v, r: relax.op.add(v, r)))
    steps = (kernels.Step(kernels.BIAS), kernels.Step(kernels.RESIDUAL))
    expected = _expected(kernels.Epilogue(steps, F32, F32), [lambda r: relax.const(BIAS), lambda r: r])
    assert_transforms(FuseKernelEpilogues(), before, expected)


def test_a_residual_is_not_narrowed_to_a_cast_another_chain_absorbed():
    """One fp32 copy of a round trip read by two ops (identical casts merged): the first kernel's chain takes the
    round trip and stores the fp32 copy, so the second reads that copy, not the bf16 binding the first removed."""
    x = tensor("x", SHAPE, BF16)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            stored = bb.emit(relax.op.astype(bb.emit(relax.op.astype(bb.emit(_conv(x)), BF16)), F32))
            summed = bb.emit(relax.op.add(bb.emit(_conv(x)), stored))
            out = bb.emit_output(relax.Tuple([summed, bb.emit(relax.op.nn.relu(stored))]))
        bb.emit_func_output(out)
    after = FuseKernelEpilogues()(_dispatched(bb.get()))
    relax.analysis.well_formed(after)
    first, second = [binding for binding in after["main"].body.blocks[0].bindings
                     if isinstance(binding.value, relax.Call) and binding.value.op.name == "relax.call_tir"]
    assert first.var.ty.dtype == F32  # the round trip, stored in fp32 by the first kernel
    assert second.value.args[1].fields[-1].same_as(first.var)  # the second kernel's residual


def test_a_bias_added_in_bf16_after_the_cast_joins_the_epilogue_in_fp32():
    """AMP may leave a bias add in bf16 after the kernel's cast (a tiny ViT does): it is added to the fp32 sum."""
    bias = BIAS.astype(ml_dtypes.bfloat16)
    before = _dispatched(_chain_module(lambda v, r: relax.op.astype(v, BF16),
                                       lambda v, r: relax.op.add(relax.const(bias), v)))
    expected = _expected(kernels.Epilogue((kernels.Step(kernels.BIAS),), "", BF16),
                         [lambda r: relax.const(bias.astype(F32))])
    assert_transforms(FuseKernelEpilogues(), before, expected)


def test_a_function_the_module_lacks_is_a_module_error():
    with pytest.raises(relay_amp.ModuleError, match="no Relax function 'forward'"):
        FuseKernelEpilogues(func="forward")(_chain_module(lambda v, r: relax.op.nn.relu(v)))


def _requantize(v: relax.Expr, r: relax.Expr, low: float = 0.0, high: float = 255.0, dtype: str = "uint8") -> list:
    """What quantize writes between two int8 layers: scale, floor(x + 0.5), clamp, cast."""
    return [lambda v, r: relax.op.multiply(v, relax.const(0.25, F32)),
            lambda v, r: relax.op.add(v, relax.const(0.5, F32)),
            lambda v, r: relax.op.floor(v),
            lambda v, r: relax.op.maximum(v, relax.const(low, F32)),
            lambda v, r: relax.op.minimum(v, relax.const(high, F32)),
            lambda v, r: relax.op.astype(v, dtype)]


def test_a_requantize_to_uint8_is_the_kernels_last_step():
    before = _dispatched(_chain_module(*_requantize(None, None)))
    steps = (kernels.Step(kernels.SCALE), kernels.Step(kernels.BIAS),
             kernels.Step(kernels.MAP, formula=("minimum", ("maximum", ("floor", ("x",)), ("const", 0.0)),
                                                ("const", 255.0))))
    expected = _expected(kernels.Epilogue(steps, "", "uint8"),
                         [lambda r: relax.const(np.full(64, 0.25, F32)), lambda r: relax.const(np.full(64, 0.5, F32))])
    assert_transforms(FuseKernelEpilogues(), before, expected)


def _relu6(v: relax.Expr, r: relax.Expr) -> list:
    """A bias and a ReLU6, as the frontends write them."""
    return [lambda v, r: relax.op.add(v, relax.const(BIAS)),
            lambda v, r: relax.op.maximum(v, relax.const(0.0, F32)),
            lambda v, r: relax.op.minimum(v, relax.const(6.0, F32))]


def test_a_requantize_after_relu6_folded_first_is_a_multiply_add_before_the_codes():
    """bias, ReLU6, x 0.25, + 0.5, floor, clamp, folded (relay_amp.backend.cpu.affine): the clamp to [0, 6] moves
    after the multiply-add and the floor, as [0, 2], within the codes' own, and the uint8 cast's truncation is the
    floor there: the epilogue's MAP clamps."""
    before = _dispatched(_chain_module(*_relu6(None, None), *_requantize(None, None)))
    steps = (kernels.Step(kernels.SCALE), kernels.Step(kernels.BIAS),
             kernels.Step(kernels.MAP, formula=("minimum", ("maximum", ("x",), ("const", 0.0)), ("const", 2.0))))
    expected = _expected(kernels.Epilogue(steps, "", "uint8"),
                         [lambda r: relax.const(np.full(64, 0.25, F32)), lambda r: relax.const(BIAS * 0.25 + 0.5)])
    assert_transforms(lambda mod: FuseKernelEpilogues()(FoldAffineClamps()(mod)), before, expected)


def test_nothing_after_an_integer_cast_joins_the_epilogue():
    """uint8 -> fp32 after the cast is not a round trip to drop: the integer is the value."""
    ops = [lambda v, r: relax.op.astype(v, "uint8"), lambda v, r: relax.op.astype(v, F32)]
    after = FuseKernelEpilogues()(_dispatched(_chain_module(*ops)))
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert calls[-2].ty.dtype == "uint8" and calls[-1].op.name == "relax.astype"


def _int8_layer(ops: list) -> tvm.IRModule:
    """main(x): a uint8 x int8 1x1 conv's int32 sums as fp32, through `ops` (each a function of the value and r)."""
    x = tensor("x", SHAPE, "uint8")
    weight = RNG.integers(-128, 128, (1, 1, 64, 64)).astype("int8")
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            value = bb.emit(relax.op.astype(bb.emit(relax.op.nn.conv2d(
                x, relax.const(weight), data_layout="NHWC", kernel_layout="HWIO", out_dtype="int32")), F32))
            for op in ops[:-1]:
                value = bb.emit(op(value, None))
            out = bb.emit_output(ops[-1](value, None))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("preset,feature", [("cpu-amx", "amx_int8"), ("cpu-avx512-bf16", "avx512_vnni")])
@pytest.mark.parametrize("low,high,dtype", [(0.0, 255.0, "uint8"), (-128.0, 127.0, "int8")])
def test_int8_layers_store_their_requantized_output_exactly(preset, feature, low, high, dtype):
    if not targets.host_supports(feature) or (preset == "cpu-amx" and not _amx_host()):
        pytest.skip(f"host CPU has no {feature}")
    before = _int8_layer(_requantize(None, None, low, high, dtype))
    target = targets.get_target(preset)
    fused = FuseKernelEpilogues()(dispatch.UseDotKernels(dispatch.target_dtypes(target),
                                                         amx_dtypes=amx.target_dtypes(target))(before))
    assert [b.value.ty.dtype for b in fused["main"].body.blocks[0].bindings] == [dtype]  # one kernel, storing ints
    executable = build(before, preset)
    data = RNG.integers(0, 256, SHAPE).astype("uint8")
    np.testing.assert_array_equal(run_executable(executable, [data])[0], relay_amp.run(before, [data])[0])


def test_an_int8_layer_with_relu6_stores_the_codes_of_the_unfused_ops():
    """The folded requantize rounds differently only where a value sits within fp32 rounding of a half code."""
    if not targets.host_supports("avx512_vnni"):
        pytest.skip("host CPU has no avx512_vnni")
    before = _int8_layer([lambda v, r: relax.op.multiply(v, relax.const(SCALE / 4096)), *_relu6(None, None),
                          *_requantize(None, None)])
    data = RNG.integers(0, 256, SHAPE).astype("uint8")
    built = run_executable(build(before, "cpu-avx512-bf16"), [data])[0].astype("int32")
    unfused = relay_amp.run(before, [data])[0].astype("int32")
    assert np.abs(built - unfused).max() <= 1 and (built == unfused).mean() > 0.999
    assert len(np.unique(unfused)) > 2  # the codes span the clamp, not only its ends


def _two_matmuls(rows: int) -> tvm.IRModule:
    """x @ W1 + bias, ReLU, cast to bf16, @ W2: an MLP over `rows` tokens, as AMP leaves it for the kernels."""
    x = tensor("x", (1, rows, 64), BF16)
    first, second = (RNG.standard_normal((64, 64)).astype(ml_dtypes.bfloat16) / 8 for _ in range(2))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            hidden = bb.emit(relax.op.matmul(x, relax.const(first), out_dtype=F32))
            hidden = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(hidden, relax.const(BIAS)))))
            narrow = bb.emit(relax.op.astype(hidden, BF16))
            out = bb.emit_output(relax.op.matmul(narrow, relax.const(second), out_dtype=F32))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("rows", [9, 197])  # one tile of 9 rows; 13 tiles, the last overlapping the one before
def test_a_built_mlp_over_tile_rows_matches_numpy(rows):
    if not _amx_host():
        pytest.skip("host CPU (or kernel) has no AMX")
    mod = _two_matmuls(rows)
    x = RNG.standard_normal((1, rows, 64)).astype(ml_dtypes.bfloat16)
    got = run_executable(build(mod, "cpu-amx"), [x])[0].astype("float64")
    expected = relay_amp.run(mod, [x])[0].astype("float64")  # the generic build
    assert np.abs(got - expected).max() <= 2 ** -7 * np.abs(expected).max()  # bf16 hidden values, rounded apart


def test_a_spatial_pad_after_an_fp32_kernel_ends_its_chain():
    """ResNet's fp32 kernels: a conv's output padded for the next 3x3 conv stays a pad (no AMX tiles to ask)."""
    x = tensor("x", SHAPE, F32)
    weight = RNG.standard_normal((1, 1, 64, 64)).astype(F32)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), data_layout="NHWC", kernel_layout="HWIO"))
            out = bb.emit_output(relax.op.nn.pad(bb.emit(relax.op.nn.relu(conv)), [0, 0, 1, 1, 1, 1, 0, 0]))
        bb.emit_func_output(out)
    after = FuseKernelEpilogues()(dispatch.UseDotKernels({F32})(bb.get()))
    relax.analysis.well_formed(after)
    assert call_op_name(after["main"].body.blocks[0].bindings[-1].value) == "relax.nn.pad"


def _codes_residual_module(zero_point: float = 0.0) -> tvm.IRModule:
    """main(x, c): a bf16 conv plus uint8 codes `c` (less `zero_point`, where not 0: offset codes of a signed
    tensor) times their step (a residual quantize left in codes), ReLU."""
    x, codes = tensor("x", SHAPE, BF16), tensor("c", SHAPE, "uint8")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, codes]):
        with bb.dataflow():
            widened = bb.emit(relax.op.astype(codes, F32))
            if zero_point:
                widened = bb.emit(relax.op.subtract(widened, relax.const(np.float32(zero_point))))
            real = bb.emit(relax.op.multiply(widened, relax.const(0.125)))
            value = bb.emit(relax.op.add(bb.emit(_conv(x)), real))
            out = bb.emit_output(relax.op.nn.relu(value))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("zero_point", [0.0, 128.0])
def test_a_residual_of_uint8_codes_is_read_in_bytes_and_scaled_in_the_epilogue(zero_point):
    steps = (kernels.Step(kernels.RESIDUAL, scale=0.125, zero_point=zero_point), kernels.Step(kernels.CLIP, low=0.0))
    x, codes = tensor("x", SHAPE, BF16), tensor("c", SHAPE, "uint8")
    spec = _spec()
    bb = relax.BlockBuilder()
    with bb.function("main", [x, codes]):
        with bb.dataflow():
            padded = bb.emit(relax.op.nn.pad(x, [0, 0, 1, 1, 1, 1, 0, 0]))
            gvar = bb.add_func(amx.conv2d_nhwc(spec, kernels.Epilogue(steps, "uint8", F32)), "relay_amp_dot_kernel")
            packed = relax.const(kernels.pack_weight(WEIGHT, "HWIO", kernels.BF16_DOT))
            out = bb.emit_output(relax.call_tir(gvar, [padded, packed, codes], relax.TensorType(spec.out_shape, F32)))
        bb.emit_func_output(out)
    assert_transforms(FuseKernelEpilogues(), _dispatched(_codes_residual_module(zero_point)), bb.get())


def test_a_residual_less_a_tensor_is_not_read_as_codes():
    """Only a scalar constant zero point makes the residual offset codes; a per-pixel subtrahend stays a function."""
    x, codes = tensor("x", SHAPE, BF16), tensor("c", SHAPE, "uint8")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, codes]):
        with bb.dataflow():
            widened = bb.emit(relax.op.astype(codes, F32))
            real = bb.emit(relax.op.multiply(bb.emit(relax.op.subtract(widened, widened)), relax.const(0.125)))
            out = bb.emit_output(relax.op.add(bb.emit(_conv(x)), real))
        bb.emit_func_output(out)
    assert _residual_dtype(FuseKernelEpilogues()(_dispatched(bb.get()))) == F32


def _residual_dtype(fused: tvm.IRModule) -> str:
    """The dtype of the last operand of `fused`'s one kernel call: the residual it reads."""
    (kernel,) = [b.value for b in fused["main"].body.blocks[0].bindings if call_op_name(b.value) == "relax.call_tir"]
    return str(kernel.args[1].fields[-1].ty.dtype)


@pytest.mark.parametrize("zero_point", [0.0, 128.0])
def test_a_codes_residual_matches_the_unfused_ops(zero_point):
    if not targets.host_supports("avx512_bf16"):
        pytest.skip("host CPU has no avx512_bf16")
    before = _codes_residual_module(zero_point)
    assert _residual_dtype(FuseKernelEpilogues()(dispatch.UseDotKernels({BF16})(before))) == "uint8"
    x = RNG.standard_normal(SHAPE).astype(ml_dtypes.bfloat16)
    codes = RNG.integers(0, 256, SHAPE).astype("uint8")
    got = run_executable(build(before, "cpu-avx512-bf16"), [x, codes])[0]
    expected = relay_amp.run(before, [x, codes])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)  # fp32 sums in another order


def _dynamic_matmul(rows: int = 28) -> tvm.IRModule:
    """main(x, s): int8 row codes `x` by an int8 weight, dequantized as quantize's dynamic matmuls are (int32 sums
    as fp32, times the weight's per-channel scales, times the runtime row scales `s`), plus a bias."""
    x, s = tensor("x", (1, rows, 64), "int8"), tensor("s", (1, rows, 1), F32)
    weight = RNG.integers(-127, 128, (64, 64)).astype("int8")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, s]):
        with bb.dataflow():
            sums = bb.emit(relax.op.matmul(x, relax.const(weight), out_dtype="int32"))
            scaled = bb.emit(relax.op.multiply(bb.emit(relax.op.astype(sums, F32)), relax.const(SCALE / 4096)))
            rows_scaled = bb.emit(relax.op.multiply(scaled, s))
            out = bb.emit_output(relax.op.add(rows_scaled, relax.const(BIAS)))
        bb.emit_func_output(out)
    return bb.get()


def test_a_dynamic_matmuls_row_scales_join_its_epilogue_through_the_int32_reshape():
    """The kernel's int32 sums reshaped back to the matmul's shape, their cast, both scales and the bias become its
    epilogue; the row scales are read reshaped to one value per output pixel."""
    dispatched = dispatch.UseDotKernels({"int8"})(_dynamic_matmul())
    (kernel,) = [gv for gv in dispatched.get_global_vars() if gv.name_hint.startswith("relay_amp_dot_kernel")]
    spec = kernels.fusable_spec(dispatched[kernel], kernels.FUSABLE_ATTR)
    after = FuseKernelEpilogues()(dispatched)
    relax.analysis.well_formed(after)
    bindings = after["main"].body.blocks[0].bindings
    assert [call_op_name(b.value) for b in bindings][-3:] == ["relax.reshape", "relax.call_tir", "relax.reshape"]
    call = bindings[-2].value
    assert [int(d) for d in call.args[1].fields[-2].ty.shape] == [1, 1, 28, 1]  # s, one value per output pixel
    steps = (kernels.Step(kernels.SCALE), kernels.Step(kernels.ROW_SCALE), kernels.Step(kernels.BIAS))
    tvm.ir.assert_structural_equal(after[call.args[0]],
                                   kernels.conv2d_nhwc_compute(spec, kernels.Epilogue(steps, "", F32)))


def test_a_matmul_whose_rows_are_off_its_tiles_takes_its_epilogue_on_the_rows_it_stores():
    """32 rows in tiles of 3: the kernel computes 33 and stores 32, so nothing slices its result and the dequantizing
    ops, row scales included (one per stored row), join its epilogue."""
    after = FuseKernelEpilogues()(dispatch.UseDotKernels({"int8"})(_dynamic_matmul(32)))
    relax.analysis.well_formed(after)
    bindings = after["main"].body.blocks[0].bindings
    assert [call_op_name(b.value) for b in bindings] == ["relax.reshape", "relax.reshape", "relax.call_tir",
                                                         "relax.reshape"]
    call = bindings[-2].value
    assert tensor_shape(call) == (1, 1, 32, 64) and tensor_shape(call.args[1].fields[0]) == (1, 1, 32, 64)
    assert [int(d) for d in call.args[1].fields[-2].ty.shape] == [1, 1, 32, 1]  # s, one value per stored row


def test_a_multiply_by_a_tensor_of_other_rows_stays_out_of_the_epilogue():
    """A (1, 1, 1) tensor is one value for every row, not a row scale: the multiply is left to a function."""
    x, s = tensor("x", (1, 32, 64), "int8"), tensor("s", (1, 1, 1), F32)
    weight = RNG.integers(-127, 128, (64, 64)).astype("int8")
    before = single_output_module(lambda x, s: relax.op.multiply(relax.op.astype(
        relax.op.matmul(x, relax.const(weight), out_dtype="int32"), F32), s), x, s)
    after = FuseKernelEpilogues()(dispatch.UseDotKernels({"int8"})(relax.transform.Normalize()(before)))
    assert "relax.multiply" in [call_op_name(b.value) for b in after["main"].body.blocks[0].bindings]


def test_a_built_dynamic_matmul_matches_the_unfused_ops():
    if not targets.host_supports("avx512_vnni"):
        pytest.skip("host CPU has no avx512_vnni")
    mod = _dynamic_matmul(32)  # computed in whole tiles of 3 rows, 32 stored: the row scales read at the stored rows
    x = RNG.integers(-127, 128, (1, 32, 64)).astype("int8")
    s = RNG.uniform(0.01, 0.1, (1, 32, 1)).astype(F32)
    got = run_executable(build(mod, "cpu-avx512-bf16"), [x, s])[0]
    expected = relay_amp.run(mod, [x, s])[0]  # the generic build, unfused
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())  # exact sums, fp32 ops


def test_an_amx_dynamic_matmul_reads_its_row_scales_in_the_tiles_write_back():
    after = FuseKernelEpilogues()(dispatch.UseDotKernels({"int8"}, amx_dtypes={"int8"})(_dynamic_matmul()))
    relax.analysis.well_formed(after)
    call = after["main"].body.blocks[0].bindings[-2].value
    assert [int(d) for d in call.args[1].fields[-2].ty.shape] == [1, 1, 28, 1]
    kernel = after[call.args[0]]
    assert amx.PRODUCTS["int8"].symbol in kernel.script()
    tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=targets.get_target("cpu-amx"))


def _linear_head(classes: int) -> tvm.IRModule:
    """main(x): a bf16 classifier head of `classes` outputs, with a bias: the model's output."""
    x = tensor("x", (1, 32, 64), BF16)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            logits = bb.emit(relax.op.matmul(x, relax.const(WEIGHT[0, 0, :, :classes]), out_dtype=F32))
            out = bb.emit_output(relax.op.add(logits, relax.const(BIAS[:classes])))
        bb.emit_func_output(out)
    return bb.get()


def test_a_kernel_whose_weight_was_padded_stores_only_the_leading_channels():
    """45 classes: dispatch pads the weight to 48 channels and slices the result back; the slice (after the bias,
    which dispatch moves before it) is the epilogue's last step, so the kernel stores 45 channels and nothing
    copies them. Its bias operand keeps all 48 channels the kernel computes."""
    after = FuseKernelEpilogues()(dispatch.UseDotKernels({BF16})(_linear_head(45)))
    relax.analysis.well_formed(after)
    bindings = after["main"].body.blocks[0].bindings
    assert [call_op_name(b.value) for b in bindings] == ["relax.reshape", "relax.call_tir", "relax.reshape"]
    call = bindings[1].value
    sch = tvm.s_tir.Schedule(after[call.args[0]])
    spec = kernels.kernel_spec(sch, sch.get_sblock("acc"))
    assert (spec.out_channels, spec.stored_channels, tensor_shape(call)) == (48, 45, (1, 1, 32, 45))
    assert tensor_shape(call.args[1].fields[-1]) == (48,)


def test_a_built_head_storing_its_leading_channels_matches_numpy():
    x = RNG.standard_normal((1, 32, 64)).astype(ml_dtypes.bfloat16)
    got = run_executable(build(_linear_head(45), targets.host_preset()), [x])[0]
    expected = x.astype(F32) @ WEIGHT[0, 0, :, :45].astype(F32) + BIAS[:45]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
