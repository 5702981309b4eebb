"""experts: a take of rows out of a product by every expert's weight (relay_amp's mixture-of-experts form) computed
by one kernel that groups the taken rows by expert, equal to the dense product's rows."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import packed_int4
from relay_amp.backend.cpu import experts
from relay_amp.backend.cpu.experts import ExpertSpec, GroupedExpertMatmuls
from relay_amp.runtime import run_executable

from builders import expert_kernel_call, experts_through_dynamo_onnx, taken_expert_rows
from pass_checks import assert_transforms

EXPERTS, TOKENS, DEPTH, COLUMNS = 4, 6, 8, 32
AVX2 = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}  # fp32 FMAs, operands widened: any x86 host CI runs on
ZEN4 = {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}  # AVX-512 with vdpbf16ps: runs where the host has it
AMX = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}  # AMX tiles (amx_experts): runs where the host has it
RNG = np.random.default_rng(0)
WEIGHT = RNG.standard_normal((DEPTH, EXPERTS * COLUMNS)).astype("float32")  # column e * COLUMNS + n: expert e's n


def _taken(rows: int, dtype: str = "float32", stored: "str | None" = None, columns: int = COLUMNS,
           product_returned: bool = False) -> tvm.IRModule:
    """main(x: TOKENS x DEPTH, index: rows) = the rows `index` takes out of x times every expert's weight
    (`builders.taken_expert_rows`) of `columns` each."""
    weight = WEIGHT[:, :EXPERTS * columns].astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    return taken_expert_rows(weight, EXPERTS, TOKENS, rows, stored, product_returned)


def _grouped(rows: int, dtype: str, stored: str) -> tvm.IRModule:
    """What the pass writes for `_taken(rows, dtype, stored)`: one call of the kernel on x, the index and the packed
    weight."""
    spec = ExpertSpec(TOKENS, DEPTH, EXPERTS, COLUMNS, rows, dtype, stored, "int64", 2 if dtype == "bfloat16" else 1)
    weight = WEIGHT.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else WEIGHT
    return expert_kernel_call(_taken(rows, dtype, stored), spec, weight)


@pytest.mark.parametrize("dtype, stored", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_a_take_of_rows_of_every_experts_product_becomes_one_kernel_call(dtype, stored):
    """fp32 operands (FMAs) and bf16 ones cast to bf16 after the fp32 product (vdpbf16ps on pairs of depths, on a
    Zen 4 target): the matmul, cast, reshape and take are one call of the kernel on the packed weight."""
    with tvm.target.Target(ZEN4):
        assert_transforms(GroupedExpertMatmuls(), _taken(9, dtype, stored), _grouped(9, dtype, stored))


STACK = RNG.standard_normal((EXPERTS, COLUMNS, DEPTH)).astype("float32")  # (E, N, K): a decode step's gathered form


def _gathered(rows: int, dtype: str = "float32") -> tvm.IRModule:
    """main(x: rows x DEPTH, index: rows x 1) = each row times its expert's weight gathered out of STACK (GatherND,
    as the dynamo exporter writes a decode step's batched_mm experts), a column each, the products in fp32."""
    x = relax.Var("x", relax.TensorType((rows, DEPTH), dtype))
    index = relax.Var("index", relax.TensorType((rows, 1), "int64"))
    stack = relax.const(STACK.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else STACK)
    builder = relax.BlockBuilder()
    with builder.function("main", [x, index]):
        with builder.dataflow():
            weights = builder.emit(relax.op.gather_nd(stack, index))
            column = builder.emit(relax.op.expand_dims(x, 2))
            out = builder.emit_output(relax.op.matmul(weights, column, out_dtype="float32"))
        builder.emit_func_output(out)
    return builder.get()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_matmul_of_gathered_expert_weights_becomes_one_kernel_call_on_no_copies(dtype):
    """A decode step's 3 rows of 4 experts: the rows as (rows, K), index row * E + expert, every expert's weight
    side by side (K, E * N) packed; the kernel's fp32 products reshaped as the matmul's; no weight gathered."""
    before = _gathered(3, dtype)
    x, index = before["main"].params
    spec = ExpertSpec(3, DEPTH, EXPERTS, COLUMNS, 3, dtype, "float32", "int64", 2 if dtype == "bfloat16" else 1)
    every = STACK.transpose(2, 0, 1).reshape(DEPTH, EXPERTS * COLUMNS)
    builder = relax.BlockBuilder()
    with builder.function("main", [x, index]):
        with builder.dataflow():
            column = builder.emit(relax.op.expand_dims(x, 2))
            data = builder.emit(relax.op.reshape(column, [3, DEPTH]))
            flat = relax.op.astype(relax.op.reshape(index, [3]), "int64")
            rows = builder.emit(relax.op.add(relax.const(np.arange(3) * EXPERTS, "int64"), flat))
            kernel = builder.add_func(experts.expert_kernel(spec), "expert_matmul")
            packed = relax.const(experts.packed_weight(every.astype(ml_dtypes.bfloat16) if dtype == "bfloat16"
                                                       else every, spec))
            products = builder.emit(relax.call_tir(kernel, [data, rows, packed],
                                                   relax.TensorType((3, COLUMNS), "float32")))
            out = builder.emit_output(relax.op.reshape(products, [3, COLUMNS, 1]))
        builder.emit_func_output(out)
    with tvm.target.Target(ZEN4):
        assert_transforms(GroupedExpertMatmuls(), before, builder.get())


INT8_DEPTH = 64  # one 64-byte AMX tile row of codes
WEIGHT_CODES = RNG.integers(-127, 128, (INT8_DEPTH, EXPERTS * COLUMNS)).astype("int8")
COLUMN_SCALES, COLUMN_OFFSETS, LAST_OFFSETS = (RNG.random(EXPERTS * COLUMNS).astype("float32") * 0.01 + 0.001
                                               for _ in range(3))


def _int8_taken(rows: int, codes: str = "int8", row_scaled: bool = True, residual: bool = False) -> tvm.IRModule:
    """main(x: TOKENS x 64 codes, scales: TOKENS x 1, index: rows[, residual]) = the rows `index` takes out of
    quantize's int8 product by every expert's weight codes: int32 sums cast to fp32, times each column's scale, plus
    its offset, times each token's row scale (with `row_scaled`), plus a last offset per column (or, with
    `residual`, a tensor of the product's shape), reshaped."""
    x = relax.Var("x", relax.TensorType((TOKENS, INT8_DEPTH), codes))
    scales = relax.Var("scales", relax.TensorType((TOKENS, 1), "float32"))
    index = relax.Var("index", relax.TensorType((rows,), "int64"))
    added = relax.Var("residual", relax.TensorType((TOKENS, EXPERTS * COLUMNS), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x, scales, index, *([added] if residual else [])]):
        with builder.dataflow():
            sums = builder.emit(relax.op.matmul(x, relax.const(WEIGHT_CODES), out_dtype="int32"))
            real = builder.emit(relax.op.multiply(builder.emit(relax.op.astype(sums, "float32")),
                                                  relax.const(COLUMN_SCALES)))
            real = builder.emit(relax.op.add(real, relax.const(COLUMN_OFFSETS)))
            real = builder.emit(relax.op.multiply(real, scales)) if row_scaled else real
            real = builder.emit(relax.op.add(real, added if residual else relax.const(LAST_OFFSETS)))
            table = builder.emit(relax.op.reshape(real, [TOKENS * EXPERTS, COLUMNS]))
            out = builder.emit_output(relax.op.take(table, index, axis=0))
        builder.emit_func_output(out)
    return builder.get()


@pytest.mark.parametrize("target", [ZEN4, AMX], ids=["zen4", "amx"])
def test_a_take_of_rows_of_every_experts_int8_product_becomes_one_kernel_call_on_the_codes(target):
    """int8 codes on a Zen 4 target (AVX-512 VNNI): the int32 matmul, its scales and offsets, the row scales'
    multiply, reshape and take are one call of the kernel on the packed weight codes (four depths a word), the
    per-column affine (B less 128 times each column's code sum times its scale: the kernel reads the codes + 128)
    and the row scales. On Sapphire Rapids the AMX kernel's call, whose tiles multiply signed codes: B unshifted."""
    before = _int8_taken(9)
    x, scales, index = before["main"].params
    on_amx = target is AMX
    spec = ExpertSpec(TOKENS, INT8_DEPTH, EXPERTS, COLUMNS, 9, "int8", "float32", "int64", 4, amx=on_amx)
    shift = 0 if on_amx else 128 * WEIGHT_CODES.astype("int64").sum(axis=0) * COLUMN_SCALES.astype("float64")
    affine = np.stack([COLUMN_SCALES, COLUMN_OFFSETS - shift, LAST_OFFSETS]).astype("float32")
    builder = relax.BlockBuilder()
    with builder.function("main", [x, scales, index]):
        with builder.dataflow():
            kernel = builder.add_func(experts.expert_kernel(spec), "expert_matmul")
            out = builder.emit_output(relax.call_tir(
                kernel, [x, index, relax.const(experts.packed_weight(WEIGHT_CODES, spec)), relax.const(affine),
                         scales], relax.TensorType((9, COLUMNS), "float32")))
        builder.emit_func_output(out)
    with tvm.target.Target(target):
        assert_transforms(GroupedExpertMatmuls(), before, builder.get())


@pytest.mark.parametrize("target", [AVX2, ZEN4, AMX], ids=["avx2", "zen4", "amx"])
@pytest.mark.parametrize("codes, row_scaled", [("int8", True), ("uint8", True), ("uint8", False)])
def test_the_built_int8_kernel_stores_each_taken_rows_own_product(codes, row_scaled, target):
    """Built by relay_amp: 9 rows of expert 1 (two tiles and one row), none of expert 3, a token taken twice; equal
    to numpy's affine of the int32 sums within 1e-5 of the largest output (vpdpbusd on Zen 4, widened on AVX2,
    tdpbssd or tdpbusd on AMX tiles)."""
    experts_of = np.array([1, 0, 1, 1, 2, 1, 1, 1, 1, 0, 1, 1, 2, 1])
    tokens = np.array([0, 0, 1, 2, 2, 3, 4, 5, 0, 5, 2, 1, 4, 3])
    index = (tokens * EXPERTS + experts_of).astype("int64")
    executable = relay_amp.build(_int8_taken(len(index), codes, row_scaled), tvm.target.Target(target))
    assert "expert_matmul" in executable.as_text()
    instruction = {"int8": "tdpbssd", "uint8": "tdpbusd"}[codes] if target is AMX else "vpdpbusd"
    assert (instruction in executable.mod.imports[0].inspect_source("asm")) is (target is not AVX2)
    _runnable(target)
    x = RNG.integers(-128 if codes == "int8" else 0, 128 if codes == "int8" else 256, (TOKENS, INT8_DEPTH))
    scales = RNG.random((TOKENS, 1)).astype("float32") + 0.5
    real = (x.astype("float64") @ WEIGHT_CODES) * COLUMN_SCALES + COLUMN_OFFSETS
    expected = ((real * scales if row_scaled else real) + LAST_OFFSETS).reshape(TOKENS * EXPERTS, COLUMNS)[index]
    got = run_executable(executable, [x.astype(codes), scales, index])[0].astype("float64")
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("before", [
    _taken(9, product_returned=True),  # the whole product is needed anyway
    _taken(TOKENS * EXPERTS),  # every row taken: the kernel would compute what the matmul does
    _taken(9, columns=20),  # columns in no whole 16-lane blocks
    _int8_taken(9, residual=True),  # an int8 product plus a tensor: no per-column affine
], ids=["product-read-elsewhere", "every-row-taken", "partial-blocks", "int8-sums-plus-a-tensor"])
def test_takes_the_kernel_would_not_speed_up_are_left(before):
    with tvm.target.Target(ZEN4):
        assert GroupedExpertMatmuls()(before).same_as(before)


def test_a_function_the_module_lacks_is_named_in_the_error():
    with pytest.raises(relay_amp.errors.ModuleError, match="no Relax function 'decode'.*'main'"):
        GroupedExpertMatmuls("decode")(_taken(9))


def test_packed_weights_hold_each_experts_16_columns_as_one_stream_of_depths():
    """fp32: (E, N / 16, K, 16); bf16 pairs: (E, N / 16, K / 2, 16) words whose low half is the even depth."""
    spec = ExpertSpec(TOKENS, DEPTH, EXPERTS, COLUMNS, 9, "float32", "float32", "int64")
    packed = experts.packed_weight(WEIGHT, spec)
    assert packed.shape == (EXPERTS, COLUMNS // 16, DEPTH, 16)
    assert packed[2, 1, 5, 3] == WEIGHT[5, 2 * COLUMNS + 16 + 3]
    halves = WEIGHT.astype(ml_dtypes.bfloat16)
    words = experts.packed_weight(halves, ExpertSpec(TOKENS, DEPTH, EXPERTS, COLUMNS, 9, "bfloat16", "bfloat16",
                                                     "int64", 2))
    assert words.shape == (EXPERTS, COLUMNS // 16, DEPTH // 2, 16) and words.dtype == np.uint32
    low, high = (words[3, 0, 2, 7] & 0xFFFF), words[3, 0, 2, 7] >> 16
    assert low == halves[4, 3 * COLUMNS + 7].view(np.uint16) and high == halves[5, 3 * COLUMNS + 7].view(np.uint16)


def _runnable(target: dict) -> None:
    if target is ZEN4 and not relay_amp.targets.host_supports("avx512_bf16"):
        pytest.skip("the host has no AVX-512 bf16")
    if target is AMX and not relay_amp.targets.host_runs_amx():
        pytest.skip("host CPU (or kernel) has no AMX: the code is checked, not run")


@pytest.mark.parametrize("target", [AVX2, ZEN4], ids=["avx2", "zen4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_built_kernel_stores_each_taken_rows_own_product(dtype, target):
    """Built by relay_amp: 9 rows of expert 1 (two tiles and one row), none of expert 3, a token taken twice, rows
    in no order; fp32 within 1e-5 of the largest output, bf16 and fp16 (operands rounded as the kernel reads them,
    outputs rounded once) within 1e-2."""
    experts_of = np.array([1, 0, 1, 1, 2, 1, 1, 1, 1, 0, 1, 1, 2, 1])
    tokens = np.array([0, 0, 1, 2, 2, 3, 4, 5, 0, 5, 2, 1, 4, 3])
    index = (tokens * EXPERTS + experts_of).astype("int64")
    module = _taken(len(index), dtype, None if dtype == "float32" else dtype)
    executable = relay_amp.build(module, tvm.target.Target(target))
    assert "expert_matmul" in executable.as_text()
    _runnable(target)
    x = RNG.standard_normal((TOKENS, DEPTH)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    weight = WEIGHT.astype(x.dtype).astype("float64")
    expected = (x.astype("float64") @ weight).reshape(TOKENS * EXPERTS, COLUMNS)[index]
    got = run_executable(executable, [x, index])[0].astype("float64")
    assert np.abs(got - expected).max() <= (1e-5 if dtype == "float32" else 1e-2) * np.abs(expected).max()


@pytest.mark.parametrize("target", [AVX2, ZEN4], ids=["avx2", "zen4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_built_decode_step_multiplies_each_row_by_its_own_expert(dtype, target):
    """Built by relay_amp: 3 rows of 4 experts, two of one expert; equal to numpy's product of each row by its
    expert's weight within 1e-5 of the largest output in fp32, 1e-2 in bf16 (its operands rounded first)."""
    index = np.array([[2], [0], [2]], dtype="int64")
    executable = relay_amp.build(_gathered(3, dtype), tvm.target.Target(target))
    assert "expert_matmul" in executable.as_text() and "gather_nd" not in executable.as_text()
    _runnable(target)
    x = RNG.standard_normal((3, DEPTH)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    stack = STACK.astype(x.dtype).astype("float64")
    expected = np.einsum("snk,sk->sn", stack[index[:, 0]], x.astype("float64"))[:, :, None]
    got = run_executable(executable, [x, index])[0].astype("float64")
    assert np.abs(got - expected).max() <= (1e-5 if dtype == "float32" else 1e-2) * np.abs(expected).max()


def _qwen2_moe(directory) -> tuple:
    """experts_through_dynamo_onnx of a Qwen2-MoE causal LM: 2 layers, 8 experts of 32 columns, top 2, shared
    experts."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    return experts_through_dynamo_onnx("Qwen2MoeForCausalLM", config, directory)


def test_a_qwen2_moe_export_runs_its_experts_on_the_kernel_and_matches_pytorch(tmp_path):
    """A model the kernel was not written on: Qwen2-MoE (transformers, random weights, 2 layers, 8 experts of 32
    columns, top 2, shared experts; 16 tokens; batched_mm experts, the dynamo ONNX exporter), built for the host:
    its up and down projections run on the kernel; logits within 1e-5 of PyTorch's largest in fp32, and in bf16
    within 1.5x PyTorch autocast's own error."""
    imported, ids, expected, autocast = _qwen2_moe(tmp_path)
    target = relay_amp.targets.host_preset()
    scale = np.abs(expected).max()
    for dtype, bound in (("float32", 1e-5 * scale), ("bfloat16", 1.5 * np.abs(autocast - expected).max())):
        module = imported if dtype == "float32" else relay_amp.to_mixed_precision(imported, dtype)
        executable = relay_amp.build(module, target)
        calls = [line for line in executable.as_text().splitlines() if "expert_matmul" in line]
        assert len(calls) >= 4, dtype  # each layer's up and down projections
        got = run_executable(executable, [ids])[0].astype("float32")
        assert np.abs(got - expected).max() <= bound, dtype


def test_a_quantized_qwen2_moe_export_runs_its_experts_in_int8_on_the_kernel(tmp_path):
    """A model the int8 kernel was not written on: Qwen2-MoE (as above, shared experts), quantized with per-row
    codes (dynamic_matmuls, 4 random calibration prompts) for a Zen 4 target: every expert layer is int8 (none kept
    in the fallback), each layer's up and down projections run on the kernel, and the logits stay within 3% of
    PyTorch's largest fp32 logit."""
    imported, ids, expected, _ = _qwen2_moe(tmp_path)
    calibration = [[RNG.integers(0, 256, ids.shape).astype("int64")] for _ in range(4)]
    with tvm.target.Target(ZEN4):
        quantized = relay_amp.quantize(imported, calibration, dynamic_matmuls=True)
        executable = relay_amp.build(quantized, tvm.target.Target(ZEN4))
    assert not [entry for entry in relay_amp.quant_plan(quantized).entries if not entry.quantized
                and "expert" in entry.reason]
    assert sum("expert_matmul" in line for line in executable.as_text().splitlines()) >= 4
    _runnable(ZEN4)
    got = run_executable(executable, [ids])[0].astype("float32")
    assert np.abs(got - expected).max() <= 0.03 * np.abs(expected).max()


INT4_DEPTH, INT4_GROUP = 64, 32
CODES = RNG.integers(-8, 8, (INT4_DEPTH, EXPERTS * COLUMNS))
SCALES = (RNG.random((INT4_DEPTH // INT4_GROUP, EXPERTS * COLUMNS)) * 0.1 + 0.01).astype("float32")


def _int4_taken(rows: int, dtype: str) -> tvm.IRModule:
    """main(x: TOKENS x 64, index: rows) = the rows `index` takes out of x times every expert's int4 weight, as
    quantize_weights writes them: its reference kernel on the packed codes and scales, the product reshaped to one
    row per token and expert."""
    x = relax.Var("x", relax.TensorType((TOKENS, INT4_DEPTH), dtype))
    index = relax.Var("index", relax.TensorType((rows,), "int64"))
    spec = packed_int4.PackedSpec(TOKENS, INT4_DEPTH, EXPERTS * COLUMNS, INT4_GROUP, dtype, dtype)
    builder = relax.BlockBuilder()
    with builder.function("main", [x, index]):
        with builder.dataflow():
            reference = builder.add_func(packed_int4.reference_kernel(spec), "relay_amp_int4_matmul")
            product = builder.emit(relax.call_tir(reference, [x, relax.const(packed_int4.pack_int4(CODES)),
                                                              relax.const(SCALES)],
                                                  relax.TensorType((TOKENS, EXPERTS * COLUMNS), dtype)))
            table = builder.emit(relax.op.reshape(product, [TOKENS * EXPERTS, COLUMNS]))
            out = builder.emit_output(relax.op.take(table, index, axis=0))
        builder.emit_func_output(out)
    return builder.get()


def test_a_take_of_rows_of_every_experts_int4_product_becomes_one_kernel_call_on_the_codes():
    """bf16 operands on a Zen 4 target: the reference int4 kernel, reshape and take are one call of the kernel on
    the codes (the packed layout's blocks of 16 columns, one expert's after another) and the scales."""
    before = _int4_taken(9, "bfloat16")
    x, index = before["main"].params
    spec = ExpertSpec(TOKENS, INT4_DEPTH, EXPERTS, COLUMNS, 9, "bfloat16", "bfloat16", "int64", 2, INT4_GROUP)
    builder = relax.BlockBuilder()
    with builder.function("main", [x, index]):
        with builder.dataflow():
            kernel = builder.add_func(experts.expert_kernel(spec), "expert_matmul")
            codes = packed_int4.pack_int4(CODES).reshape(EXPERTS, COLUMNS // 16, INT4_DEPTH // 8, 16)
            out = builder.emit_output(relax.call_tir(kernel, [x, index, relax.const(codes), relax.const(SCALES)],
                                                     relax.TensorType((9, COLUMNS), "bfloat16")))
        builder.emit_func_output(out)
    with tvm.target.Target(ZEN4):
        assert_transforms(GroupedExpertMatmuls(), before, builder.get())


@pytest.mark.parametrize("target", [AVX2, ZEN4], ids=["avx2", "zen4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_built_int4_kernel_stores_each_taken_rows_own_product(dtype, target):
    """Built by relay_amp: 9 rows of expert 1 (two tiles and one row), none of expert 3, a token taken twice; equal
    to numpy's product by the dequantized codes within 1e-5 of the largest output in fp32, 1e-2 in bf16 (its
    operands rounded first, its outputs rounded once)."""
    experts_of = np.array([1, 0, 1, 1, 2, 1, 1, 1, 1, 0, 1, 1, 2, 1])
    tokens = np.array([0, 0, 1, 2, 2, 3, 4, 5, 0, 5, 2, 1, 4, 3])
    index = (tokens * EXPERTS + experts_of).astype("int64")
    executable = relay_amp.build(_int4_taken(len(index), dtype), tvm.target.Target(target))
    assert "expert_matmul" in executable.as_text() and "int4_matmul" not in executable.as_text()
    _runnable(target)
    x = RNG.standard_normal((TOKENS, INT4_DEPTH)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    weight = (CODES.reshape(-1, INT4_GROUP, EXPERTS * COLUMNS) * SCALES[:, None].astype("float64")).reshape(
        INT4_DEPTH, -1)
    expected = (x.astype("float64") @ weight).reshape(TOKENS * EXPERTS, COLUMNS)[index]
    got = run_executable(executable, [x, index])[0].astype("float64")
    assert np.abs(got - expected).max() <= (1e-5 if dtype == "float32" else 1e-2) * np.abs(expected).max()
