"""cast_copies: a cast that several fusible functions read is copied into each of them."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import targets
from relay_amp.backend import cast_copies
from relay_amp.backend.cast_copies import MAX_READERS, CastsPerReader
from relay_amp.compile.build import build
from relay_amp.runtime import run_executable
from relay_amp.tools.bench import variant

from builders import segformer_through_onnx, timm_through_onnx
from pass_checks import assert_transforms, prepared_function_names, prepared_module

SCALE = np.random.default_rng(0).standard_normal(16).astype("float32")


def _legalized(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` as the fusion passes give it to CastsPerReader: legalized, its functions' op patterns annotated."""
    return relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(mod))


def _pooling_mixer(copies: bool = False, matmul_reader: bool = False) -> tvm.IRModule:
    """EfficientFormer's pooling mixer on a bf16 tensor, computed in fp32: x + scale * (pool(x) - x), x's cast read
    twice (with `copies`, once by each of two casts; with `matmul_reader`, a matmul reads the cast instead of the
    add)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 16), "bfloat16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            pool = bb.emit(relax.op.nn.avg_pool2d(x, 3, padding=1, layout="NHWC", count_include_pad=False))
            pooled = bb.emit(relax.op.astype(pool, "float32"))
            wide = bb.emit(relax.op.astype(x, "float32"))
            scaled = bb.emit(relax.op.multiply(bb.emit(relax.op.subtract(pooled, wide)), relax.const(SCALE)))
            if matmul_reader:
                product = bb.emit(relax.op.matmul(wide, relax.const(np.eye(16, dtype="float32"))))
                mixed = bb.emit(relax.op.add(scaled, product))
            else:
                mixed = bb.emit(relax.op.add(bb.emit(relax.op.astype(x, "float32")) if copies else wide, scaled))
            out = bb.emit_output(bb.emit(relax.op.astype(mixed, "bfloat16")))
        bb.emit_func_output(out)
    return bb.get()


def test_a_cast_two_fusible_functions_read_is_copied_into_each():
    assert_transforms(CastsPerReader(), _legalized(_pooling_mixer()), _legalized(_pooling_mixer(copies=True)))


def test_a_cast_a_matmul_reads_stays_one_function():
    """Fusion joins no cast to a matmul's operand, so a copy for it would be a function of its own."""
    before = _legalized(_pooling_mixer(matmul_reader=True))
    tvm.ir.assert_structural_equal(CastsPerReader()(before), before)


def test_a_cast_read_more_often_than_max_readers_stays_one_function():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "bfloat16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(x, "float32"))
            sums = [bb.emit(relax.op.add(wide, relax.const(float(i)))) for i in range(MAX_READERS + 1)]
            out = bb.emit_output(bb.emit(relax.Tuple(sums)))
        bb.emit_func_output(out)
    before = _legalized(bb.get())
    tvm.ir.assert_structural_equal(CastsPerReader()(before), before)


def test_built_pooling_mixer_fuses_the_cast_and_matches_the_reference():
    """No function of the build only casts x, and its result is the reference's within two bf16 roundings of the
    largest value (the pool's bf16 result and the output may each round the other way)."""
    mod = _pooling_mixer()
    names = [gv.name_hint for gv in prepared_module(mod).get_global_vars()]
    assert not [name for name in names if name.startswith("cast")], names
    data = np.random.default_rng(1).standard_normal((1, 8, 8, 16)).astype(ml_dtypes.bfloat16)
    got = run_executable(build(mod, targets.host_preset()), [data])[0]
    expected = relay_amp.run(mod, [data])[0].astype("float32")
    np.testing.assert_allclose(got.astype("float32"), expected, atol=2 ** -7 * np.abs(expected).max())


def test_edgenext_keeps_only_casts_a_conv_reads(tmp_path):
    """timm's EdgeNeXt-XX-Small in bf16 (a model this was not written on): a cast left as a function of its own is
    read by a function fusion could not join it to (an unfused conv), never only by fused functions, which would
    have computed it where they read it."""
    pytest.importorskip("timm")
    _, imported, _, _ = timm_through_onnx("edgenext_xx_small", tmp_path)
    main = prepared_module(variant(imported, "bfloat16"))["main"]
    calls = [binding for block in main.body.blocks for binding in block.bindings
             if isinstance(binding.value, relax.Call) and isinstance(binding.value.op, tvm.ir.Op)
             and binding.value.op.name == "relax.call_tir"]
    readers = {}
    for binding in calls:
        for arg in binding.value.args[1].fields:
            readers.setdefault(arg, []).append(binding.value.args[0].name_hint)
    casts = [binding.var for binding in calls if binding.value.args[0].name_hint.startswith("cast")]
    assert casts and all(not all(name.startswith("fused_") for name in readers[var]) for var in casts)


@pytest.mark.parametrize("bits, readers, pays", [
    ((16, 32), 2, True), ((16, 32), MAX_READERS, True), ((16, 32), MAX_READERS + 1, False), ((16, 32), 1, False),
    ((32, 16), 2, True), ((32, 16), 3, False),  # rounded once, three readers read half the bytes each
    (None, 2, False),
])
def test_copies_pay(bits, readers, pays):
    assert cast_copies._copies_pay(bits, readers) == pays


@pytest.mark.parametrize("bits, pays", [((16, 32), True), ((32, 16), False)])
def test_copies_of_a_cast_its_producer_absorbs_pay_only_when_it_widens(bits, pays):
    """A rounding its producer's function computes stores half the bytes, and each reader reads half."""
    assert cast_copies._copies_pay(bits, 2, absorbed=True) == pays


def test_a_rounding_of_a_norm_two_reshapes_read_stays_in_the_norm():
    """Fusion joins the rounding to the norm (which nothing else reads): the norm stores bf16 and the reshapes are
    views, where copies would make the norm store fp32 and each reshape a function rounding it."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            norm = bb.emit(relax.op.nn.layer_norm(x, relax.const(np.ones(8, "float32")),
                                                  relax.const(np.zeros(8, "float32")), axes=[-1]))
            narrow = bb.emit(relax.op.astype(norm, "bfloat16"))
            tokens = bb.emit(relax.op.reshape(narrow, (1, 1, 16, 8)))
            image = bb.emit(relax.op.reshape(narrow, (1, 4, 4, 8)))
            out = bb.emit_output(bb.emit(relax.Tuple([tokens, image])))
        bb.emit_func_output(out)
    before = _legalized(bb.get())
    tvm.ir.assert_structural_equal(CastsPerReader()(before), before)


def test_segformer_stores_no_rounding_of_its_norms_apart(tmp_path):
    """transformers' SegFormer in bf16 (a model this was not written on): each block's norm feeds its attention's
    query projection and, as an image, its reduction conv; no function of the build only rounds and reshapes."""
    pytest.importorskip("transformers")
    imported, _, _ = segformer_through_onnx(tmp_path)
    names = prepared_function_names(variant(imported, "bfloat16"))
    tokens = {name: [token.rstrip("0123456789") for token in name.split("_")] for name in names}
    roundings = [name for name, ops in tokens.items() if "cast" in ops and set(ops) <= {"fused", "cast", "reshape"}]
    assert not roundings, names


def test_a_rounding_three_functions_read_stays_one_function():
    """Three copies of a rounding to bf16 would read the fp32 tensor three times: rounded once, each reads half."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            narrow = bb.emit(relax.op.astype(x, "bfloat16"))
            total = bb.emit(relax.op.sum(narrow, axis=1, keepdims=True))
            out = bb.emit_output(bb.emit(relax.op.add(bb.emit(relax.op.multiply(narrow, narrow)), total)))
        bb.emit_func_output(out)
    before = _legalized(bb.get())
    tvm.ir.assert_structural_equal(CastsPerReader()(before), before)
