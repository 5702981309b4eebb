"""Frontends: ONNX and PyTorch models import with weights bound as constants and compute the same."""

import gc
import re
import sys
import warnings

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import relay_amp
from relay_amp import frontend
from relay_amp.runtime import run_executable

from builders import hidden_states, mismatched_projection, positions_onnx


def conv_gemm_onnx() -> onnx.ModelProto:
    """Conv -> Relu -> Flatten -> Gemm with fixed random weights."""
    rng = np.random.default_rng(1)
    weights = {
        "w": rng.standard_normal((4, 3, 3, 3)).astype("float32"),
        "b": rng.standard_normal(4).astype("float32"),
        "fc": rng.standard_normal((5, 4 * 6 * 6)).astype("float32") * 0.1,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Flatten", ["r"], ["f"]),
        helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "conv_gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_from_onnx_binds_weights_and_matches_onnx_reference(tmp_path):
    model = conv_gemm_onnx()
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    mod = frontend.from_onnx(path)
    assert [p.name for p in mod["main"].params] == ["x"]
    assert [l.op for l in relay_amp.list_layers(mod)] == ["relax.nn.conv2d", "relax.matmul"]
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype("float32")
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(relay_amp.run(mod, [x])[0], expected, rtol=1e-5, atol=1e-5)


def test_large_weights_reach_tvms_importer_as_inputs_and_are_bound_after(monkeypatch, tmp_path):
    """TVM's importer and the simplifier see a graph without the large weights (a model over protobuf's 2 GB
    imports; a file's large weights stay on disk until each is bound), and the import is the same as with every
    weight in it; a weight no node reads is left out."""
    import tvm.relax.frontend.onnx as tvm_onnx

    model = conv_gemm_onnx()
    model.graph.initializer.append(numpy_helper.from_array(np.ones((8, 64), "float32"), "unread"))
    onnx.save(model, tmp_path / "model.onnx", save_as_external_data=True, size_threshold=0)
    whole = frontend.from_onnx(tmp_path / "model.onnx")
    monkeypatch.setattr(frontend, "WEIGHT_INPUT_VALUES", 100)  # fc (720 values) and w (108) apart, b (4) kept
    loaded = {tensor.name: tensor for tensor in frontend._load_onnx(tmp_path / "model.onnx").graph.initializer}
    assert loaded["b"].raw_data and not loaded["fc"].raw_data and not loaded["w"].raw_data  # read when bound
    reached, tvm_import = [], tvm_onnx.from_onnx

    def recording(graph, **kwargs):
        reached.append(graph)
        return tvm_import(graph, **kwargs)

    monkeypatch.setattr(tvm_onnx, "from_onnx", recording)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TVM's importer warns for each input name it changes
        apart = frontend.from_onnx(tmp_path / "model.onnx")
    tvm.ir.assert_structural_equal(apart, whole)
    (graph,) = reached
    assert "b" in {tensor.name for tensor in graph.graph.initializer}
    assert max(np.prod(tensor.dims) for tensor in graph.graph.initializer) <= 100
    assert [value.name for value in graph.graph.input] == ["x", *(f"{frontend.WEIGHT_PREFIX}{i}" for i in (1, 2))]


def test_from_onnx_accepts_model_proto_and_shape_dict():
    model = conv_gemm_onnx()
    mod = frontend.from_onnx(model, shape_dict={"x": [2, 3, 8, 8]})
    assert relay_amp.count_layers(mod) == 2


def test_from_onnx_rejects_missing_and_corrupt_files(tmp_path):
    with pytest.raises(relay_amp.ModelLoadError, match="not found"):
        frontend.from_onnx(tmp_path / "absent.onnx")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07 this is not a protobuf \xff\xff")
    with pytest.raises(relay_amp.ModelLoadError, match="corrupt.onnx"):
        frontend.from_onnx(corrupt)


def test_a_node_tvm_cannot_convert_is_named_on_one_line_and_nothing_is_printed(capfd):
    """TVM's importer printed the failing op with its inputs as TVMScript, raised a several-line error quoting
    constants as metadata references, and its BlockBuilder warned on stderr when freed; the error names the node."""
    with pytest.raises(relay_amp.ModelLoadError) as caught:
        frontend.from_onnx(mismatched_projection())
    message = str(caught.value)
    assert re.search(r"'mismatch': node 'proj' \(MatMul\): Matmul requires .* RHS \(a constant\) has shape", message)
    assert "\n" not in message and "metadata" not in message
    del caught
    gc.collect()
    printed = capfd.readouterr()
    assert printed.out == "" and "BlockBuilder" not in printed.err


def test_from_torch_matches_torch():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5),
    ).eval()
    x = torch.randn(2, 3, 8, 8)
    mod = frontend.from_torch(net, [x])
    assert len(mod["main"].params) == 1, "weights must be bound as constants, not parameters"
    assert relay_amp.count_layers(mod) == 2
    assert "R.nn.batch_norm" not in mod.script(), "the batch norm is folded into the conv"
    with torch.no_grad():
        expected = net(x).numpy()
    np.testing.assert_allclose(relay_amp.run(mod, [x.numpy()])[0], expected, rtol=1e-4, atol=1e-4)


def test_from_torch_skips_empty_tensors_in_concatenations_as_torch_cat_does():
    """torch.cat skips 1-D empty tensors whatever the other inputs' rank (a key/value cache starts as one); TVM's
    importer refused them ("Concat expects all input tensors to have same ndim")."""
    torch = pytest.importorskip("torch")

    class Cached(torch.nn.Module):
        def forward(self, x):
            empty = torch.tensor([], dtype=x.dtype)
            return torch.cat([empty, x * 2.0], dim=-2), torch.cat([empty, x, empty, x + 1.0], dim=1)

    x = torch.randn(1, 2, 3, 4)
    mod = frontend.from_torch(Cached(), [x])
    with torch.no_grad():
        expected = [value.numpy() for value in Cached()(x)]
    for got, want in zip(relay_amp.run(mod, [x.numpy()]), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_from_torch_imports_a_transformers_decoder_with_its_key_value_cache():
    """A Qwen2 decoder exported with its default cache (use_cache=True): each layer's keys and values are
    concatenated to the cache's empty start. Matches PyTorch."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = hf.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = hf.Qwen2Model(config).eval()
    ids = torch.randint(0, 128, (1, 8))
    mod = frontend.from_torch(hidden_states(model), [ids])
    with torch.no_grad():
        expected = hidden_states(model)(ids).numpy()
    np.testing.assert_allclose(relay_amp.run(mod, [ids.numpy()])[0], expected, rtol=1e-4, atol=1e-4)


def test_from_torch_imports_a_view_of_an_attention_output_whose_strides_the_decomposition_changes():
    """Heads merged after scaled_dot_product_attention with .contiguous().view(...), as GPT-2 does: decomposed to
    core ATen, the attention's output gets other strides, and the view failed ("Cannot view a tensor ...")."""
    torch = pytest.importorskip("torch")

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)
            self.out = torch.nn.Linear(16, 8)

        def forward(self, x):
            batch, tokens, _ = x.shape
            q, k, v = self.qkv(x).view(batch, tokens, 3, 2, 8).permute(2, 0, 3, 1, 4)
            heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(heads.transpose(1, 2).contiguous().view(-1, 16)).view(batch, tokens, 8)

    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 5, 16)
    mod = frontend.from_torch(model, [x])
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(relay_amp.run(mod, [x.numpy()])[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode, size, scale", [("nearest", (7, 7), None), ("nearest", None, 2.5),
                                               ("nearest", (6, 4), None), ("nearest-exact", (7, 7), None),
                                               ("bilinear", (7, 5), None)])
def test_from_torch_resizes_as_torch_interpolates(mode, size, scale):
    """F.interpolate's "nearest" takes source floor(destination * in / out); TVM's importer took half-pixel
    centres and rounding ("nearest-exact"), wrong where out / in is not whole: GhostNetV2's gate, a 3x3 pool
    resized to 7x7, was off by 0.11 of the output through torch.export."""
    torch = pytest.importorskip("torch")

    class Resize(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, size=size, scale_factor=scale, mode=mode)

    x = torch.arange(18.0).reshape(1, 2, 3, 3)
    with torch.no_grad():
        expected = Resize()(x).numpy()
    got = relay_amp.run(frontend.from_torch(Resize(), [x]), [x.numpy()])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding_mode, align_corners", [("zeros", False), ("border", True), ("reflection", False)])
def test_from_torch_samples_a_grid_as_torch_does(mode, padding_mode, align_corners):
    """F.grid_sample's grid is (N, H, W, 2) in PyTorch and (N, 2, H, W) for TVM's grid_sample: TVM's importer
    passed PyTorch's on, and sampled a 5x7 grid into a 5x2 output."""
    torch = pytest.importorskip("torch")

    class Sample(torch.nn.Module):
        def forward(self, x, grid):
            return torch.nn.functional.grid_sample(x, grid, mode=mode, padding_mode=padding_mode,
                                                   align_corners=align_corners)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 9, 11)).astype("float32")
    grid = (rng.random((2, 5, 7, 2)) * 2.4 - 1.2).astype("float32")  # some samples outside the image
    with torch.no_grad():
        expected = Sample()(torch.from_numpy(x), torch.from_numpy(grid)).numpy()
    got = relay_amp.run(frontend.from_torch(Sample(), [x, grid]), [x, grid])[0]
    assert got.shape == (2, 3, 5, 7)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


INDEXINGS = {  # aten.index.Tensor: x (2, 3, 5, 6) indexed by rows (2,) and columns (3,)
    "unfold": lambda torch, x, rows, cols: torch.nn.functional.unfold(x, 3, padding=1),  # (3, 4, 1, 1) by (3, 4)
    "adjacent_broadcast": lambda torch, x, rows, cols: x[:, :, rows.reshape(2, 1), cols.reshape(1, 3)],
    "adjacent_inside": lambda torch, x, rows, cols: x[:, rows, cols[:2]],
    "apart": lambda torch, x, rows, cols: x[rows, :, cols[:2]],  # the broadcast shape leads
    "leading": lambda torch, x, rows, cols: x[rows, cols[:2] % 3],
    "one": lambda torch, x, rows, cols: x[:, :, rows],
}


@pytest.mark.parametrize("case", sorted(INDEXINGS))
def test_from_torch_indexes_as_numpy_does(case):
    """The index tensors broadcast together and their shape replaces the indexed axes (adjacent ones) or leads:
    TVM's importer broadcast the sliced axes' positions against them instead, and F.unfold did not import."""
    torch = pytest.importorskip("torch")

    class Index(torch.nn.Module):
        def forward(self, x):
            return INDEXINGS[case](torch, x, torch.tensor([1, 0]), torch.tensor([2, 0, 1]))

    x = np.random.default_rng(0).standard_normal((2, 3, 5, 6)).astype("float32")
    with torch.no_grad():
        expected = Index()(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(relay_amp.run(frontend.from_torch(Index(), [x]), [x])[0], expected)


def test_from_torch_takes_amax_and_amin():
    """TVM's importer had no aten.amax / aten.amin: timm's Hiera did not import."""
    torch = pytest.importorskip("torch")

    class Extremes(torch.nn.Module):
        def forward(self, x):
            return x.amax(dim=(1, 3), keepdim=True) + x.amin(dim=-1).unsqueeze(-1).mean() + x.amax()

    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype("float32")
    with torch.no_grad():
        expected = Extremes()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(relay_amp.run(frontend.from_torch(Extremes(), [x]), [x])[0], expected, rtol=1e-6)


def test_from_torch_unfolds_windows_as_torch_does():
    """TVM's importer had no aten.unfold (Tensor.unfold: timm's HaloNet did not import): windows along an axis
    (overlapping, apart, the last axis counted from the end), each window's positions a new last axis."""
    torch = pytest.importorskip("torch")

    class Windows(torch.nn.Module):
        def forward(self, x):
            return x.unfold(2, 3, 2).unfold(3, 2, 1) * 2 + x.unfold(-1, 4, 4).sum()

    x = np.random.default_rng(0).standard_normal((1, 2, 9, 8)).astype("float32")
    with torch.no_grad():
        expected = Windows()(torch.from_numpy(x)).numpy()
    got = relay_amp.run(frontend.from_torch(Windows(), [x]), [x])[0]
    assert got.shape == (1, 2, 4, 7, 3, 2)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_from_torch_counts_a_histogram_as_torch_does():
    """TVM's importer had no aten.histc (transformers' grouped_mm experts count each expert's rows with it): values
    at the upper bound in the last bin, values outside the bounds uncounted, bins of a fractional width."""
    torch = pytest.importorskip("torch")

    class Histogram(torch.nn.Module):
        def forward(self, x):
            return torch.histc(x, bins=5, min=-1, max=2) + torch.histc(x.floor(), bins=3, min=0, max=2).sum()

    x = np.array([[-1.5, -1.0, -0.4, 0.2, 0.2], [0.79, 1.4, 2.0, 2.01, 0.0]], "float32")
    with torch.no_grad():
        expected = Histogram()(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(relay_amp.run(frontend.from_torch(Histogram(), [x]), [x])[0], expected)


@pytest.mark.parametrize("dtype", ["bool", "int32", "float32"])
def test_from_torch_sums_cumulatively_in_the_dtype_torch_gives(dtype):
    """cumsum of a bool or int tensor is int64 in PyTorch: TVM's importer summed bools as bools, which did not
    compile (transformers' causal mask of a decoder called without an attention mask counts a mask so)."""
    torch = pytest.importorskip("torch")

    class Positions(torch.nn.Module):
        def forward(self, x):
            return x + torch.cumsum((x > 0).to(getattr(torch, dtype)), dim=-1)

    x = np.random.default_rng(0).standard_normal((2, 7)).astype("float32")
    with torch.no_grad():
        expected = Positions()(torch.from_numpy(x)).numpy()
    got = relay_amp.build(frontend.from_torch(Positions(), [x]), "cpu")
    np.testing.assert_allclose(run_executable(got, [x])[0], expected, rtol=1e-6)


def test_from_torch_takes_an_unsorted_topk():
    """torch.topk(..., sorted=False), which TVM's importer refused (DeepSeek-V3-style routers): the k largest
    values and their indices, in some order (sorted here)."""
    torch = pytest.importorskip("torch")

    class Router(torch.nn.Module):
        def forward(self, x):
            values, indices = torch.topk(x, k=3, dim=-1, sorted=False)
            return values + indices.to(torch.float32) * 100

    x = np.random.default_rng(0).standard_normal((4, 9)).astype("float32")
    got = relay_amp.run(frontend.from_torch(Router(), [x]), [x])[0]
    order = np.argsort(-x, axis=-1)[:, :3]
    np.testing.assert_allclose(got, np.take_along_axis(x, order, axis=-1) + order * 100, rtol=1e-6)


def test_from_torch_computes_a_complex_rotary_embedding_on_real_pairs():
    """Llama 4's and DeepSeek-V2's rotary embedding: frequencies as torch.polar, the query's pairs viewed as complex,
    multiplied, viewed as real again (TVM's importer had no complex ops). Built, within 1e-5 of PyTorch."""
    torch = pytest.importorskip("torch")

    class Rotary(torch.nn.Module):
        def forward(self, x):
            angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001])
            frequencies = torch.polar(torch.ones_like(angles), angles).to(x.device) * 1.0
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * frequencies.unsqueeze(0)).flatten(2) + x

    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype("float32")
    with torch.no_grad():
        expected = Rotary()(torch.from_numpy(x)).numpy()
    got = run_executable(relay_amp.build(frontend.from_torch(Rotary(), [x]), "cpu"), [x])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


SPECTRAL = {  # torch.fft's transforms as models use them, of a (2, 6, 8) input
    "FNet's token mixing": lambda x: torch_module().fft.fftn(x, dim=(1, 2)).real,
    "ifft over a middle axis": lambda x: torch_module().fft.ifft(x, dim=1).imag,
    "ifftn, ortho": lambda x: torch_module().fft.ifftn(x, dim=(1, 2), norm="ortho").real,
    "fft of an fft": lambda x: torch_module().fft.fft(torch_module().fft.fft2(x), dim=0).imag,
    "rfft's magnitudes": lambda x: torch_module().fft.rfftn(x).abs(),
    "rfft2 then irfft2, forward norm": lambda x: torch_module().fft.irfft2(
        torch_module().fft.rfft2(x, norm="forward"), s=(6, 8), norm="forward"),
    "irfft of an odd length": lambda x: torch_module().fft.irfft(torch_module().fft.rfft(x[..., :7]), n=7),
}


def torch_module():
    """torch, imported where a test runs (the torch extra is optional)."""
    return pytest.importorskip("torch")


@pytest.mark.parametrize("case", list(SPECTRAL))
def test_from_torch_computes_torch_fft_transforms_as_torch_does(case):
    """torch.fft's transforms (complex values TVM's importer lacks) as matmuls of real pairs by their DFT basis:
    FNet did not import through torch.export."""
    torch = torch_module()

    class Spectral(torch.nn.Module):
        def forward(self, x):
            return SPECTRAL[case](x)

    x = np.random.default_rng(0).standard_normal((2, 6, 8)).astype("float32")
    with torch.no_grad():
        expected = Spectral()(torch.from_numpy(x)).resolve_neg().numpy()
    got = relay_amp.run(frontend.from_torch(Spectral(), [x]), [x])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_from_torch_filters_an_image_globally_as_gfnet_does_and_refuses_padded_transforms():
    """GFNet's global filter: rfft2, a product by a complex weight, irfft2 back (ortho); a transform padding its
    input is refused, naming the op."""
    torch = torch_module()

    class GlobalFilter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(6, 5, 4, 2) * 0.1)

        def forward(self, x):
            spectrum = torch.fft.rfft2(x, dim=(1, 2), norm="ortho")
            return torch.fft.irfft2(spectrum * torch.view_as_complex(self.weight), s=(6, 8), dim=(1, 2), norm="ortho")

    class Padded(torch.nn.Module):
        def forward(self, x):
            return torch.fft.rfft2(x, s=(12, 8), dim=(1, 2)).real

    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((1, 6, 8, 4)).astype("float32")
    module = GlobalFilter()
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(relay_amp.run(frontend.from_torch(module, [x]), [x])[0], expected, rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(relay_amp.ModelLoadError, match=r"fft_rfft2.* of sizes \[12, 8\] other than its input's"):
        frontend.from_torch(Padded(), [x])


def test_from_torch_refuses_complex_values_it_cannot_hold_naming_the_op():
    torch = pytest.importorskip("torch")

    class Exponential(torch.nn.Module):
        def forward(self, x):
            return torch.view_as_real(torch.view_as_complex(x.reshape(4, 2)).exp())

    with pytest.raises(relay_amp.ModelLoadError, match="complex values reach aten.exp"):
        frontend.from_torch(Exponential(), [np.ones(8, "float32")])


def test_from_torch_writes_a_slice_back_as_a_concatenation_that_builds_in_bf16():
    """DeepSeek-V2's query: its rotary half written back with slice_scatter, whose TVM form (a select per element)
    failed TVM's lowering in bf16; the input's parts around the source, concatenated, build and compute it. Also a
    zeros_like of a runtime tensor, whose TVM legalization failed without a dtype."""
    torch = pytest.importorskip("torch")

    class WriteBack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.rotary = torch.nn.Linear(16, 16), torch.nn.Linear(8, 8)

        def forward(self, x):
            query = self.query(x)  # bf16 in a bf16 model, as DeepSeek-V2's is
            return torch.slice_scatter(query, self.rotary(query[..., 8:]), dim=-1, start=8) + torch.zeros_like(x)

    torch.manual_seed(0)
    write_back = WriteBack().eval()
    x = np.random.default_rng(0).standard_normal((2, 4, 16)).astype("float32")
    with torch.no_grad():
        expected = write_back(torch.from_numpy(x)).numpy()
    module = frontend.from_torch(write_back, [x])
    for dtype in ("float32", "bfloat16"):
        converted = module if dtype == "float32" else relay_amp.to_mixed_precision(module, dtype)
        got = run_executable(relay_amp.build(converted, relay_amp.targets.host_preset()), [x])[0]
        np.testing.assert_allclose(got, expected, rtol=2e-2 if dtype == "bfloat16" else 1e-5, atol=2e-2)


@pytest.mark.parametrize("bounds", [(64, -64, -1), (5, -6, -2), (0.5, 3.0, 0.75), (7,)])
def test_from_torch_counts_an_arange_as_torch_does(bounds):
    """TVM's relax.arange(64, -64, -1) had 130 values: Funnel's relative positions did not import."""
    torch = pytest.importorskip("torch")

    class Positions(torch.nn.Module):
        def forward(self, x):
            return x + torch.arange(*bounds).unsqueeze(1).expand(-1, 3)  # Funnel's: shapes checked by broadcast_to

    x = np.ones((len(torch.arange(*bounds)), 3), dtype="float32")
    with torch.no_grad():
        expected = Positions()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(relay_amp.run(frontend.from_torch(Positions(), [x]), [x])[0], expected, rtol=1e-6)


DIVISIONS = {  # torch.export's spellings of a division (aten.div.Tensor, div.Tensor_mode), x a float tensor
    "float_floor_by_int": lambda torch, x: x // 2,
    "float_trunc_by_int": lambda torch, x: torch.div(x, 2, rounding_mode="trunc"),
    "int_true_by_int": lambda torch, x: torch.arange(-4, 4) / 3 + x,
    "int_floor_by_int": lambda torch, x: torch.div(torch.arange(-4, 4), 3, rounding_mode="floor") + x,
    "int_trunc_by_int": lambda torch, x: torch.div(torch.arange(-4, 4), 3, rounding_mode="trunc") + x,
    "int_by_int_tensor": lambda torch, x: torch.arange(8) / torch.arange(1, 9) + x,
    # EdgeNeXt's positional encoding
    "float_floor_in_a_power": lambda torch, x: 10000 ** (2 * torch.div(torch.arange(8).to(torch.float32), 2,
                                                                  rounding_mode="floor") / 8) * x,
}


@pytest.mark.parametrize("case", sorted(DIVISIONS))
def test_from_torch_divides_as_torch_promotes(case):
    """Both operands of a division in the dtype PyTorch gives its result: TVM's importer made Python ints int32
    constants beside float tensors (refused by Relax: x // 2 did not import) and divided int tensors as ints."""
    torch = pytest.importorskip("torch")

    class Divide(torch.nn.Module):
        def forward(self, x):
            return DIVISIONS[case](torch, x)

    x = torch.linspace(-7.5, 7.5, 8)
    with torch.no_grad():
        expected = Divide()(x).numpy()
    got = relay_amp.run(frontend.from_torch(Divide(), [x]), [x.numpy()])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_from_torch_computes_ops_tvm_lacks_on_weights_with_torch(capfd):
    """An op TVM's importer lacks (an antialiased bicubic resize), reading weights only (a position embedding sized
    to the input, as timm's NaFlexViT does), is computed by PyTorch at import; on a runtime tensor it is named."""
    torch = pytest.importorskip("torch")

    class Resized(torch.nn.Module):
        def __init__(self, runtime: bool):
            super().__init__()
            self.runtime = runtime
            self.position = torch.nn.Parameter(torch.randn(1, 3, 4, 4))

        def forward(self, x):
            grid = x if self.runtime else self.position
            return x + torch.nn.functional.interpolate(grid * 2, size=(6, 6), mode="bicubic", antialias=True)

    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((1, 3, 6, 6)).astype("float32")
    with torch.no_grad():
        expected = Resized(False)(torch.from_numpy(x)).numpy()
    torch.manual_seed(0)
    np.testing.assert_allclose(relay_amp.run(frontend.from_torch(Resized(False), [x]), [x])[0], expected,
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(relay_amp.ModelLoadError, match=r"node '_upsample_bicubic2d_aa' \(aten._upsample_bicubic2d_aa"
                                                       r".*no converter for _upsample_bicubic2d_aa.default .*runtime"):
        frontend.from_torch(Resized(True), [x])
    gc.collect()
    assert "BlockBuilder" not in capfd.readouterr().err


def test_from_torch_names_a_module_it_cannot_import():
    torch = pytest.importorskip("torch")

    class DataDependent(torch.nn.Module):
        def forward(self, x):
            return x[x > 0]  # an output shape that depends on the data

    with pytest.raises(relay_amp.ModelLoadError, match="DataDependent"):
        frontend.from_torch(DataDependent(), [torch.randn(4)])


def test_from_torch_exports_in_eval_mode_and_leaves_a_training_module_training():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5)).train()
    net(torch.randn(8, 4))  # running statistics other than the initial ones
    x = torch.randn(2, 4)
    mod = frontend.from_torch(net, [x])
    assert net.training and all(layer.training for layer in net)
    with torch.no_grad():
        expected = net.eval()(x).numpy()
    np.testing.assert_allclose(relay_amp.run(mod, [x.numpy()])[0], expected, rtol=1e-5, atol=1e-6)


def test_from_torch_without_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(relay_amp.MissingDependencyError, match=r"relay_amp\[torch\]"):
        frontend.from_torch(object(), [])


def scalar_constant_of_shape_onnx() -> onnx.ModelProto:
    """y = x + ConstantOfShape([]) (a scalar 2.5), the way the TorchScript exporter spells a scalar mask fill."""
    empty_shape = numpy_helper.from_array(np.zeros(0, dtype="int64"), "empty_shape")
    fill = numpy_helper.from_array(np.array([2.5], dtype="float32"), "fill")
    nodes = [
        helper.make_node("Constant", [], ["shape"], value=empty_shape),
        helper.make_node("ConstantOfShape", ["shape"], ["scalar"], value=fill),
        helper.make_node("Add", ["x", "scalar"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "scalar_fill", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_constant_subgraphs_are_folded_before_tvm_imports_them():
    model = scalar_constant_of_shape_onnx()
    folded = frontend.simplify_onnx(model)
    assert "ConstantOfShape" not in [node.op_type for node in folded.graph.node]
    x = np.arange(6, dtype="float32").reshape(2, 3)
    got = relay_amp.run(frontend.from_onnx(model), [x])[0]
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, {"x": x})[0])  # exact: one fp32 add


def spelled_out_layer_norm_onnx(epsilon: float) -> onnx.ModelProto:
    """A layer norm as exports before opset 17 write BERT's: the epsilon a scalar Constant node added to the
    variance (1e-12 in BERT)."""
    rng = np.random.default_rng(2)
    scalars = {"two": 2.0, "eps": epsilon}
    nodes = [helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, "float32")))
             for name, value in scalars.items()]
    nodes += [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
              helper.make_node("Sub", ["x", "mean"], ["centred"]),
              helper.make_node("Pow", ["centred", "two"], ["squares"]),
              helper.make_node("ReduceMean", ["squares"], ["variance"], axes=[-1]),
              helper.make_node("Add", ["variance", "eps"], ["shifted"]),
              helper.make_node("Sqrt", ["shifted"], ["deviation"]),
              helper.make_node("Div", ["centred", "deviation"], ["normed"]),
              helper.make_node("Mul", ["normed", "gamma"], ["scaled"]),
              helper.make_node("Add", ["scaled", "beta"], ["y"])]
    weights = [numpy_helper.from_array(rng.standard_normal(8).astype("float32"), name) for name in ("gamma", "beta")]
    graph = helper.make_graph(nodes, "layer_norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def test_a_tiny_epsilon_survives_the_optimizer_so_a_row_of_zero_variance_normalizes_to_zero():
    """onnxscript's no-op rule takes `variance + 1e-12` for `variance` (scalar constants within 1e-8 of zero):
    the row of equal values below normalized to NaN. Given shape [1] the epsilon stays; zero is still dropped."""
    model = spelled_out_layer_norm_onnx(1e-12)
    x = np.stack([np.full(8, 3.0, "float32"), np.linspace(-1, 1, 8, dtype="float32")])
    got = relay_amp.run(frontend.from_onnx(model), [x])[0]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
    kept = frontend.simplify_onnx(model)
    assert any(node.op_type == "Add" and "variance" in node.input for node in kept.graph.node)
    dropped = frontend.simplify_onnx(spelled_out_layer_norm_onnx(0.0))
    assert not any(node.op_type == "Add" and "variance" in node.input for node in dropped.graph.node)


def shared_flatten_onnx() -> onnx.ModelProto:
    """A mask flattened, cast to bool and flattened again along two branches, as the TorchScript exporter writes
    DETR's encoder and decoder masks: onnxscript rewrites both flattens into reshapes whose shapes share a name."""
    nodes = [helper.make_node("Flatten", ["m"], ["f"], axis=1),
             helper.make_node("Cast", ["f"], ["c1"], to=TensorProto.BOOL),
             helper.make_node("Flatten", ["c1"], ["e"], axis=2),
             helper.make_node("Cast", ["c1"], ["c2"], to=TensorProto.BOOL),
             helper.make_node("Flatten", ["c2"], ["d"], axis=2),
             helper.make_node("Concat", ["e", "d"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "shared_flatten", [helper.make_tensor_value_info("m", TensorProto.FLOAT, [1, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.BOOL, [16, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_constants_the_optimizer_left_unregistered_become_initializers():
    model = shared_flatten_onnx()
    folded = frontend.simplify_onnx(model)
    defined = {tensor.name for tensor in folded.graph.initializer} | {"m"}
    for node in folded.graph.node:
        assert set(node.input) <= defined, node
        defined |= set(node.output)
    mask = np.arange(16, dtype="float32").reshape(1, 4, 4) % 3
    got = relay_amp.run(frontend.from_onnx(model), [mask])[0]
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, {"m": mask})[0])


def standardized_conv_onnx(weight: np.ndarray, standardize: bool = True) -> onnx.ModelProto:
    """Conv over a weight standardized in the graph, as the TorchScript exporter writes BiT's and timm's StdConv2d:
    BatchNormalization in training mode over the weight reshaped to [1, O, I*KH*KW], its first output reshaped
    back (or, `standardize` False, over the weight as it is)."""
    out_ch = weight.shape[0]
    consts = {"w": weight, "flat": np.array([1, out_ch, -1], "int64"), "shape": np.array(weight.shape, "int64"),
              "one": np.ones(out_ch, "float32"), "zero": np.zeros(out_ch, "float32")}
    nodes = [helper.make_node("Conv", ["x", "ws" if standardize else "w"], ["y"], pads=[1, 1, 1, 1])]
    if standardize:
        nodes[:0] = [helper.make_node("Reshape", ["w", "flat"], ["wf"]),
                     helper.make_node("BatchNormalization", ["wf", "one", "zero", "zero", "one"], ["wn", "m", "v"],
                                      epsilon=1e-6, training_mode=1),
                     helper.make_node("Reshape", ["wn", "shape"], ["ws"])]
    graph = helper.make_graph(nodes, "std_conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weight.shape[1], 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out_ch, 6, 6])],
                              [numpy_helper.from_array(v, k) for k, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_weight_standardized_in_the_graph_imports_as_a_constant():
    weight = np.random.default_rng(4).standard_normal((8, 4, 3, 3)).astype("float32")
    mod = frontend.from_onnx(standardized_conv_onnx(weight))
    from relay_amp.passes.layers import layer_bindings
    conv = layer_bindings(mod, ["relax.nn.conv2d"], "main")[0].value
    assert isinstance(conv.args[1], tvm.ir.expr.Constant)  # AMP casts it once, dispatch packs it
    flat = weight.reshape(8, -1).astype("float64")
    standardized = ((flat - flat.mean(1, keepdims=True)) / np.sqrt(flat.var(1, keepdims=True) + 1e-6))
    x = np.random.default_rng(5).standard_normal((1, 4, 6, 6)).astype("float32")
    expected = ReferenceEvaluator(standardized_conv_onnx(standardized.reshape(weight.shape).astype("float32"),
                                                         standardize=False)).run(None, {"x": x})[0]
    np.testing.assert_allclose(relay_amp.run(mod, [x])[0], expected, rtol=1e-4, atol=1e-4)


def test_a_qdq_models_weight_dequantizes_are_not_folded():
    """realize_qdq reads a QDQ model's int8 weight codes from their DequantizeLinear: folding stops short of them."""
    codes = np.random.default_rng(6).integers(-127, 128, (8, 4, 3, 3)).astype("int8")
    consts = {"codes": codes, "scale": np.float32(0.02), "zero": np.int8(0)}
    nodes = [helper.make_node("DequantizeLinear", ["codes", "scale", "zero"], ["w"]),
             helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "qdq_weight",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 6, 6])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    mod = frontend.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert "R.dequantize" in mod.script()


def relu6_conv_onnx() -> onnx.ModelProto:
    """Conv -> Clip(0, 6) (ReLU6, as MobileNetV2 exports it) -> Conv."""
    rng = np.random.default_rng(3)
    weights = {"w1": rng.standard_normal((8, 3, 3, 3)).astype("float32"),
               "w2": rng.standard_normal((4, 8, 1, 1)).astype("float32"),
               "low": np.array(0.0, "float32"), "high": np.array(6.0, "float32")}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c", "low", "high"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "relu6", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_onnx_clip_imports_as_maximum_and_minimum_and_an_nhwc_build_keeps_no_transposes_around_it():
    """TVM's importer writes Clip as two TE functions, which ConvertLayout cannot see through."""
    model = relu6_conv_onnx()
    mod = frontend.from_onnx(model)
    ops = [b.value.op.name for b in mod["main"].body.blocks[0].bindings]
    assert ops == ["relax.nn.conv2d", "relax.maximum", "relax.minimum", "relax.nn.conv2d"]
    nhwc = relay_amp.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(mod)
    transposes = [b for b in nhwc["main"].body.blocks[0].bindings if b.value.op.name == "relax.permute_dims"]
    assert len(transposes) == 4  # the input, two weights and the output: the graph's edges only
    x = np.random.default_rng(4).standard_normal((1, 3, 8, 8)).astype("float32")
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(relay_amp.run(mod, [x])[0], expected, rtol=1e-5, atol=1e-4)


def test_from_onnx_sizes_dynamic_axes_by_name_before_shapes_fold():
    model = positions_onnx()
    assert frontend.onnx_symbolic_dims(model) == ["batch", "seq"]
    assert relay_amp.symbolic_dims(frontend.from_onnx(model)) == ["batch", "seq"]
    mod = frontend.from_onnx(model, dims={"batch": 2, "seq": 5})
    assert relay_amp.symbolic_dims(mod) == []
    assert "R.arange" not in mod.script()  # the positions folded to a constant
    x = np.random.default_rng(3).standard_normal((2, 5)).astype("float32")
    np.testing.assert_allclose(relay_amp.run(mod, [x])[0], ReferenceEvaluator(model).run(None, {"x": x})[0])
    assert frontend.onnx_symbolic_dims(model) == ["batch", "seq"], "from_onnx changed its input model"


def test_dims_size_an_exporters_value_infos_of_the_same_names_too():
    """GenAI's builder writes value infos in the inputs' dim names (["batch_size", "sequence_length", 384]); left
    symbolic, shape inference kept them unknown, and the rewrites that need shapes refused the nodes."""
    from relay_amp._onnx_graph import inferred_values

    model = positions_onnx()
    model.graph.value_info.append(helper.make_tensor_value_info("as_float", TensorProto.FLOAT, ["seq"]))
    assert inferred_values(frontend._with_dims(model, {"batch": 2, "seq": 5}))["as_float"][0] == [5]
    assert model.graph.value_info[0].type.tensor_type.shape.dim[0].dim_param == "seq", "the input model changed"


def test_an_import_failure_of_a_model_with_symbolic_dims_says_how_to_size_them():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence"])
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"])], "unknown_op", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(relay_amp.ModelLoadError,
                       match=r"symbolic dims \['batch', 'sequence'\].*dims=\{\"batch\": \.\.\., \"sequence\": \.\.\.\}"):
        frontend.from_onnx(model)


def _best_scores_above(threshold: float, cap: int) -> onnx.ModelProto:
    """A detector's post-processing: the best of at most `cap` scores above `threshold` (NonZero, then a TopK of
    k = min(cap, how many there are)), its nodes named as the test expects."""
    nodes = [
        helper.make_node("Constant", [], ["threshold"],
                         value=helper.make_tensor("t", TensorProto.FLOAT, [], [threshold])),
        helper.make_node("Constant", [], ["cap"], value=helper.make_tensor("c", TensorProto.INT64, [1], [cap])),
        helper.make_node("Greater", ["scores", "threshold"], ["above"]),
        helper.make_node("NonZero", ["above"], ["where"], name="candidates"),
        helper.make_node("Transpose", ["where"], ["rows"], perm=[1, 0]),
        helper.make_node("GatherND", ["scores", "rows"], ["kept"]),
        helper.make_node("Shape", ["kept"], ["count"]),
        helper.make_node("Concat", ["cap", "count"], ["limits"], axis=0),
        helper.make_node("ReduceMin", ["limits"], ["k"], keepdims=1),
        helper.make_node("TopK", ["kept", "k"], ["best", "order"]),
    ]
    scores = helper.make_tensor_value_info("scores", TensorProto.FLOAT, [20])
    best = helper.make_tensor_value_info("best", TensorProto.FLOAT, ["k"])
    graph = helper.make_graph(nodes, "post_processing", [scores], [best])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_import_failure_of_a_graph_sized_by_its_values_names_those_nodes_and_says_what_to_import():
    """TVM's importer fails on the shapes a detector's post-processing computes from its values; the error names
    the nodes that size tensors by values (a computed k's TopK without a name by its output) and the way out."""
    with pytest.raises(relay_amp.ModelLoadError, match=r"sizes tensors by their values: NonZero node 'candidates', "
                                                       r"TopK node 'best'.*onnx.utils.extract_model"):
        frontend.from_onnx(_best_scores_above(0.5, 5))


def test_from_onnx_rejects_dims_the_file_does_not_have():
    with pytest.raises(relay_amp.OptionError, match="no symbolic input dim 'sequence'; its symbolic dims: batch, seq"):
        frontend.from_onnx(positions_onnx(), dims={"sequence": 5})


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_an_exported_group_norm_imports_as_one_op_and_matches_torch(tmp_path, dynamo):
    """Both ONNX exporters write GroupNorm as Reshape, InstanceNormalization, Reshape, Mul, Add."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.ReLU())
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5), model[1].bias.uniform_(-1, 1)
    x = torch.randn(1, 3, 8, 8)
    path = tmp_path / "group_norm.onnx"
    torch.onnx.export(model.eval(), (x,), path, opset_version=18 if dynamo else 17, dynamo=dynamo)
    mod = frontend.from_onnx(path)
    ops = [b.value.op.name for b in mod["main"].body.blocks[0].bindings]
    assert ops.count("relax.nn.group_norm") == 1 and "relax.variance" not in ops
    with torch.no_grad():
        np.testing.assert_allclose(relay_amp.run(mod, [x.numpy()])[0], model(x).numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("affine", [True, False])
def test_an_exported_instance_norm_imports_as_a_group_norm_of_one_channel_groups(tmp_path, affine):
    """TVM's importer spells InstanceNormalization as mean, variance, subtract, divide, scale and shift: three passes
    over the input, each kept fp32 by AMP. It becomes one group norm of C groups; two images of other scales."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.InstanceNorm2d(16, affine=affine))
    if affine:
        with torch.no_grad():
            model[1].weight.uniform_(0.5, 1.5), model[1].bias.uniform_(-1, 1)
    x = torch.randn(2, 3, 8, 8) * torch.tensor([1.0, 4.0]).reshape(2, 1, 1, 1)
    path = tmp_path / "instance_norm.onnx"
    torch.onnx.export(model.eval(), (x,), path, opset_version=17, dynamo=False)
    mod = frontend.from_onnx(path)
    norms = [b.value for b in mod["main"].body.blocks[0].bindings if b.value.op.name == "relax.nn.group_norm"]
    assert len(norms) == 1 and int(norms[0].attrs.num_groups) == 16
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(relay_amp.run(mod, [x.numpy()])[0], expected, rtol=1e-4, atol=1e-4)
    built = run_executable(relay_amp.build(mod, relay_amp.targets.host_preset()), [x.numpy()])[0]
    np.testing.assert_allclose(built, expected, rtol=1e-4, atol=1e-4)


def test_an_exported_pad_imports_as_relax_pad_and_an_nhwc_build_keeps_no_transposes_around_it(tmp_path):
    """BiT's stem: conv, F.pad, GroupNorm, ReLU, max pool, conv. TVM's importer writes Pad as a TE function, and
    Relax's pad has no layout rule: the transposes around it move down past the norm and the pool and cancel."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Stem(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = torch.nn.Conv2d(3, 16, 3, 2, 1), torch.nn.GroupNorm(4, 16)
            self.head = torch.nn.Conv2d(16, 8, 1)

        def forward(self, x):
            padded = torch.nn.functional.pad(self.conv(x), (1, 1, 1, 1))
            return self.head(torch.nn.functional.max_pool2d(torch.relu(self.norm(padded)), 3, 2))

    model, x = Stem().eval(), torch.randn(1, 3, 16, 16)
    path = tmp_path / "stem.onnx"
    torch.onnx.export(model, (x,), path, opset_version=17, dynamo=False)
    mod = frontend.from_onnx(path)
    assert "relax.nn.pad" in [b.value.op.name for b in mod["main"].body.blocks[0].bindings]
    nhwc = tvm.transform.Sequential(relay_amp.passes.layout.conv_layout_passes(["NHWC", "HWIO"]))(mod)
    moves = [b for b in nhwc["main"].body.blocks[0].bindings if b.value.op.name == "relax.permute_dims"]
    assert len(moves) == 2  # the input and the output
    with torch.no_grad():
        expected = model(x).numpy()
    executable = relay_amp.build(mod, relay_amp.targets.host_preset())
    np.testing.assert_allclose(relay_amp.runtime.run_executable(executable, [x.numpy()])[0], expected,
                               rtol=1e-4, atol=1e-4)


def test_a_swin_transformers_window_pads_fold_to_constants_and_it_matches_torch(tmp_path):
    """torchvision's Swin pads each stage to whole windows with pads computed from shapes, through a
    ConstantOfShape whose shape onnxscript folds only after its first round: the folding repeats until the graph
    stops shrinking, or TVM's importer refused the model ("Dynamic pads are not supported yet")."""
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                               window_size=[3, 3], num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)  # 8x8 patches in windows of 3: padded to 9x9
    path = tmp_path / "swin.onnx"
    torch.onnx.export(model, (x,), path, opset_version=17, dynamo=False)
    folded = frontend.simplify_onnx(onnx.load(path))
    constants = {init.name for init in folded.graph.initializer}
    pads = [node for node in folded.graph.node if node.op_type == "Pad"]
    assert pads and all(node.input[1] in constants for node in pads)
    with torch.no_grad():
        expected = model(x).numpy()
    got = relay_amp.runtime.run_executable(relay_amp.build(frontend.from_onnx(path), "cpu"), [x.numpy()])[0]
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()  # fp32, sums in another order



def test_rules_that_list_the_whole_graph_at_each_node_are_left_out(monkeypatch):
    """SlicesSplit's matcher lists every node of the graph at each candidate node (90 of 96 s importing a small
    Sequencer2D): onnxscript's optimizer runs without it while relay_amp simplifies, and gets its rules back."""
    import onnxscript.optimizer
    from onnxscript import rewriter
    rules, optimize_ir, seen = rewriter._DEFAULT_REWRITE_RULES, onnxscript.optimizer.optimize_ir, []

    def recording(model, **options):
        seen.append([rule.name for rule in rewriter._DEFAULT_REWRITE_RULES])
        return optimize_ir(model, **options)

    monkeypatch.setattr(onnxscript.optimizer, "optimize_ir", recording)
    frontend.simplify_onnx(shared_flatten_onnx())
    assert seen and all("SlicesSplit" not in names and len(names) == len(rules) - 1 for names in seen)
    assert rewriter._DEFAULT_REWRITE_RULES is rules
