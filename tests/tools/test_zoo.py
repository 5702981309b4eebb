"""The model zoo: every family exports, converts, builds and matches PyTorch on a tiny config."""

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
zoo = pytest.importorskip("relay_amp.tools.zoo")

import relay_amp  # noqa: E402
from relay_amp.runtime import run_executable  # noqa: E402
from pass_checks import prepared_calls, prepared_function_names  # noqa: E402

FP32_TOLERANCE = 2e-5  # relative to the largest output: fp32 sums in another order, fast-math polynomials
BF16_FLOOR = 1e-2  # bf16 AMP may be this far off, or as far off as PyTorch's own bf16 autocast (x1.5)
# on average over these inputs' seeds: a tiny model's bf16 error swings with its input (MixNet-S's, relay_amp's and
# PyTorch's alike: 0.01 to 0.09 over 32 inputs, a mean of 0.03 and 0.04)
BF16_SEEDS = range(4)


def _reference(name: str, inputs: list[np.ndarray]) -> tuple[np.ndarray, float]:
    """PyTorch's fp32 output, and the relative error of PyTorch's bf16 autocast against it."""
    return _references(name, [inputs])[0]


def _references(name: str, input_sets: list[list[np.ndarray]]) -> list[tuple[np.ndarray, float]]:
    """`_reference` for each set of inputs, of one module."""
    module = zoo.torch_module(name, tiny=True)
    references = []
    for inputs in input_sets:
        tensors = [torch.from_numpy(x) for x in inputs]
        with torch.no_grad():
            fp32 = module(*tensors).numpy()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                bf16 = module(*tensors).float().numpy()
        references.append((fp32, _relative_error(bf16, fp32)))
    return references


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got.astype("float64") - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_zoo_model_converts_builds_and_matches_pytorch(name):
    seeded = [zoo.example_inputs(name, tiny=True, seed=seed) for seed in BF16_SEEDS]  # seed 0: the example input
    references = _references(name, seeded)
    inputs, (expected, _) = seeded[0], references[0]
    assert np.abs(expected).max() > 0, "the reference output is all zeros: nothing to compare"
    mod = zoo.load(name, tiny=True)
    target = relay_amp.targets.host_preset()
    fp32 = run_executable(relay_amp.build(mod, target), inputs)[0]
    assert _relative_error(fp32, expected) <= FP32_TOLERANCE
    bf16 = relay_amp.build(relay_amp.to_mixed_precision(mod, "bfloat16"), target)
    errors = [(_relative_error(run_executable(bf16, x)[0], reference), torch_bf16_error)
              for x, (reference, torch_bf16_error) in zip(seeded, references)]
    bf16_error, torch_bf16_error = np.mean(errors, axis=0)
    assert bf16_error <= max(BF16_FLOOR, 1.5 * torch_bf16_error)


@pytest.mark.parametrize("name, exporter", [("resnet50", "dynamo"), ("bert", "dynamo"),
                                            ("convnext_tiny", "torch.export"), ("t5_encoder", "torch.export"),
                                            ("gpt2", "torch.export"), ("llama", "torch.export"),
                                            ("qwen3_moe", "dynamo"), ("qwen3_moe", "torch.export")])
def test_other_export_paths_import_and_match(name, exporter):
    inputs = zoo.example_inputs(name, tiny=True)
    expected, _ = _reference(name, inputs)
    got = run_executable(relay_amp.build(zoo.load(name, tiny=True, exporter=exporter), "cpu"), inputs)[0]
    assert _relative_error(got, expected) <= FP32_TOLERANCE


def test_unknown_names_and_exporters_are_option_errors():
    with pytest.raises(relay_amp.OptionError, match="unknown zoo model 'resnet9'"):
        zoo.entry("resnet9")
    with pytest.raises(relay_amp.OptionError, match="exporter must be one of"):
        zoo.load("bert", tiny=True, exporter="tflite")
    with pytest.raises(relay_amp.OptionError, match="dynamic axes take the torchscript exporter"):
        zoo.export_onnx("bert", "unused.onnx", tiny=True, exporter="dynamo", dynamic=True)


ACTIVATION_OPS = ("relax.erf", "relax.tanh", "relax.sigmoid", "relax.exp")


@pytest.mark.parametrize("name,every_one", [("gpt2", True), ("vit_s16", True), ("efficientnet_b0", False)])
def test_exported_activations_after_kernels_land_in_their_epilogues(name, every_one):
    """GPT-2's tanh GELU (with pow(x, 3)) and ViT's erf GELU, as the exporter wrote them, leave no activation op
    behind once the CPU pipeline has dispatched kernels; EfficientNet's Sigmoid-Mul SiLUs after its 1x1 kernels
    go too (those after depthwise convolutions, which have no kernel, stay)."""
    from relay_amp.backend.cpu import amx, dispatch, pipeline
    from relay_amp.passes.moves import HoistOverMoves

    target = relay_amp.targets.get_target("cpu-amx")
    kernels = dispatch.UseDotKernels(dispatch.target_dtypes(target), amx_dtypes=amx.target_dtypes(target))
    passes = [*pipeline.layout_passes(), kernels, HoistOverMoves(), relay_amp.transform.FuseKernelEpilogues()]
    mod = relay_amp.to_mixed_precision(zoo.load(name, tiny=True), "bfloat16")
    before = _activation_count(mod)
    for each in passes:
        mod = each(mod)
    after = _activation_count(mod)
    assert before > 0 and (after == 0 if every_one else 0 < after < before), (before, after)


def _activation_count(mod) -> int:
    from tvm import relax
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", None) in ACTIVATION_OPS else None)
    return len(found)


def _kernel_calls(mod) -> int:
    """How many dot-product kernels the host's CPU pipeline dispatches in `mod`."""
    return sum("dot_kernel" in name for name in prepared_function_names(mod))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_regnets_grouped_convs_get_kernels_like_its_other_convs(dtype):
    """RegNetY's 3x3 convs in groups of 8 channels run on the dot-product kernels (two groups per 16-lane block;
    on AMX four per 32-channel panel), as its 1x1 and squeeze-excitation convs do: no convolution is left to a
    fused function, and each is a kernel call (alike ones share a kernel)."""
    from tvm import relax

    mod = zoo.load("regnet_y", tiny=True)
    groups = []
    relax.analysis.post_order_visit(mod["main"], lambda e: groups.append(int(e.attrs.groups))
                                    if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.nn.conv2d"
                                    else None)
    assert max(groups) > 1
    mod = mod if dtype == "float32" else relay_amp.to_mixed_precision(mod, dtype)
    assert not [name for name in prepared_function_names(mod) if "conv2d" in name]
    assert len(prepared_calls(mod, "dot_kernel")) >= len(groups)


def test_wav2vec2s_conv1ds_and_group_norm_run_channels_last_on_the_kernels():
    """wav2vec2's feature encoder (conv1d, GroupNorm(C, C), conv1ds) and its grouped positional conv1d: every conv
    becomes a dot-product kernel, and the group norm imports as one op and is computed over the channels (its sums
    in one pass)."""
    mod = zoo.load("wav2vec2", tiny=True)
    ops = [b.value.op.name for b in mod["main"].body.blocks[0].bindings if hasattr(b.value, "op")]
    assert ops.count("relax.nn.conv1d") == 4 and ops.count("relax.nn.group_norm") == 1
    functions = prepared_function_names(relay_amp.to_mixed_precision(mod, "bfloat16"))
    assert not [name for name in functions if "conv" in name or "group_norm" in name]
    assert sum("dot_kernel" in name for name in functions) >= 4 and "moments" in functions


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_mixture_of_experts_exports_batched_experts_that_run_on_the_expert_kernel(dtype):
    """Qwen3-MoE as the zoo exports it (transformers' batched_mm experts; PyTorch's own module keeps its default):
    each layer's up and down projections over the experts run on the grouped expert kernel, the up projection
    reading each token once (the exporter's Tile of each token per routed expert read as a broadcast)."""
    from relay_amp._ir import tensor_shape

    assert zoo.torch_module("qwen3_moe", tiny=True).model.config._experts_implementation != "batched_mm"
    mod = zoo.load("qwen3_moe", tiny=True)
    mod = mod if dtype == "float32" else relay_amp.to_mixed_precision(mod, dtype)
    layers, shape = zoo.entry("qwen3_moe").config(True).num_hidden_layers, zoo.entry("qwen3_moe").tiny
    calls = prepared_calls(mod, "expert_matmul")
    assert len(calls) == 2 * layers
    assert tensor_shape(calls[0].args[1].fields[0])[0] == shape.batch * shape.size


def test_the_mixture_of_experts_through_torch_export_runs_transformers_default_experts_on_the_expert_kernel():
    """transformers' default experts (grouped_mm: rows sorted by expert, counted by histc, multiplied by
    transformers' grouped matmul op) through torch.export: each layer's up and down projections on the grouped
    expert kernel (their matching PyTorch: test_other_export_paths_import_and_match)."""
    mod = zoo.load("qwen3_moe", tiny=True, exporter="torch.export")
    assert len(prepared_calls(mod, "expert_matmul")) == 2 * zoo.entry("qwen3_moe").config(True).num_hidden_layers


@pytest.mark.parametrize("name", ["resnet50", "bert"])
def test_dynamic_axes_sized_at_import_reach_the_kernels_and_match_pytorch(name, tmp_path):
    """An export with dynamic batch (and sequence) axes, as exports for serving are: sized at import, it gets as
    many kernels as a static export and matches PyTorch; unsized, a CNN still builds, with a warning."""
    inputs = zoo.example_inputs(name, tiny=True)
    expected, _ = _reference(name, inputs)
    path = zoo.export_onnx(name, tmp_path / f"{name}.onnx", tiny=True, dynamic=True)
    axes = list(zoo.DYNAMIC_AXES[zoo.entry(name).kind].values())
    assert relay_amp.frontend.onnx_symbolic_dims(onnx.load(path)) == axes
    mod = relay_amp.frontend.from_onnx(path, dims=dict(zip(axes, inputs[0].shape)))
    assert relay_amp.symbolic_dims(mod) == []
    assert _kernel_calls(mod) == _kernel_calls(zoo.load(name, tiny=True))
    target = relay_amp.targets.host_preset()
    assert _relative_error(run_executable(relay_amp.build(mod, target), inputs)[0], expected) <= FP32_TOLERANCE
    if name == "resnet50":
        dynamic = relay_amp.frontend.from_onnx(path)
        with pytest.warns(UserWarning, match=r"symbolic dims \(batch\)"):
            executable = relay_amp.build(dynamic, target)
        assert _relative_error(run_executable(executable, inputs)[0], expected) <= FP32_TOLERANCE


def _tiny_quantized(name: str) -> tuple:
    """(the zoo's tiny `name`, it quantized on four random inputs, the generator that drew them, for more)."""
    mod = zoo.load(name, tiny=True)
    rng = np.random.default_rng(0)
    shape = zoo.example_inputs(name, tiny=True)[0].shape
    return mod, relay_amp.quantize(mod, [rng.standard_normal(shape).astype("float32") for _ in range(4)]), rng


@pytest.mark.parametrize("name, depthwise_dtype", [("mobilenet_v2", "uint8"), ("efficientnet_b0", "fallback")])
def test_quantized_depthwise_convs_follow_their_input_sign_and_stay_close_to_fp32(name, depthwise_dtype):
    """MobileNetV2's depthwise convs read ReLU6 outputs: int8q makes them uint8 layers; EfficientNet's read SiLU
    outputs and stay in the bf16 fallback. Both builds (requantize runs folded) keep close to fp32 over four inputs
    (a wrong scale or fold would not: cosine near 0; one input of a tiny config's few channels swings: tiny
    MobileNetV2's, over 24, from 0.93 to 0.996, mean 0.98)."""
    from relay_amp.passes.layers import layer_bindings
    from relay_amp.passes.quantize.realize import prepared

    mod, quantized, rng = _tiny_quantized(name)
    shape = zoo.example_inputs(name, tiny=True)[0].shape
    entries = relay_amp.quant_plan(quantized).entries
    calls = [binding.value for binding in layer_bindings(prepared(mod), ["relax.nn.conv2d", "relax.matmul"])]
    depthwise = {entry.dtype for entry, call in zip(entries, calls) if getattr(call.attrs, "groups", 1) != 1}
    assert depthwise == {depthwise_dtype}
    target = relay_amp.targets.host_preset()
    fp32, int8 = relay_amp.build(mod, target), relay_amp.build(quantized, target)
    cosines = []
    for _ in range(4):
        inputs = [rng.standard_normal(shape).astype("float32")]
        cosines.append(relay_amp.metrics.cosine_similarity(run_executable(int8, inputs)[0],
                                                           run_executable(fp32, inputs)[0]))
    assert np.mean(cosines) >= 0.95, cosines


def test_quantized_residuals_in_offset_codes_are_read_by_the_kernels():
    """MobileNetV2's signed bottleneck outputs are uint8 codes less a zero point (a model the epilogue's rule was not
    written on): each residual add reads them in the next kernel's write-back, so no function dequantizes them to
    fp32 (cast, subtract, multiply) for the kernel to read (10 did). The build's accuracy is the test above's."""
    functions = prepared_function_names(_tiny_quantized("mobilenet_v2")[1])
    assert sum("dot_kernel" in name for name in functions) > 10
    assert not [name for name in functions if "subtract" in name]


def test_tiny_mixnet_keeps_one_block_of_each_stage_with_every_kind_of_block():
    """Its tiny model is the full architecture cut to each stage's first block (what builds in the tests)."""
    kinds = {type(block).__name__ for stage in zoo.torch_module("mixnet_s").model.blocks for block in stage}
    tiny = zoo.torch_module("mixnet_s", tiny=True).model.blocks
    assert [len(stage) for stage in tiny] == [1] * 6
    assert {type(block).__name__ for stage in tiny for block in stage} == kinds
