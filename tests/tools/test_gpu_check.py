"""gpu-check: the CUDA path's variants build without a GPU; without one the command is one line and exit 1."""

import pytest
import tvm

import relay_amp
from relay_amp import models
from relay_amp.backend.cuda.tensorcore import tensor_core_kernels
from relay_amp.compile.build import build, cuda_source
from relay_amp.tools import gpu_check
from relay_amp.tools.cli import main

NO_GPU = not tvm.cuda(0).exist


# 64x64: float16's 16-pixel convs once failed to lower
@pytest.mark.parametrize("name", ["float16", "int8", "int4", "int8q"])
def test_every_variant_builds_for_tensor_cores(name):
    mod = gpu_check.variant(models.resnet18(image_size=64, classes=7), name)
    kernels = tensor_core_kernels(cuda_source(build(mod, gpu_check.TARGET)))
    assert sum(kernels.values()) >= 7  # the convs with 16+ output pixels on wmma; the fp32 stem on dlight


@pytest.mark.parametrize("name", ["float32", "int8"])
def test_a_transformer_builds_for_tensor_cores_with_every_matmul_recast(name):
    mod = models.bert_encoder(seq_len=16, hidden=64, heads=2, layers=1)
    variant_mod = gpu_check.variant(mod, name)
    matmuls = relay_amp.passes.layers.layer_bindings(variant_mod, ["relax.matmul"])
    dtypes = {str(binding.value.args[1].ty.dtype) for binding in matmuls}
    assert dtypes == {"float32" if name == "float32" else "int8"}
    kernels = tensor_core_kernels(cuda_source(build(variant_mod, gpu_check.TARGET)))
    assert (sum(kernels.values()) > 0) == (name == "int8")


def test_the_target_follows_the_gpus_compute_capability():
    assert gpu_check.target_for("8.6") == "cuda-tensorcore"
    assert gpu_check.target_for("9.0") == "cuda-tensorcore-sm90"
    with pytest.raises(relay_amp.TargetError, match="7.5"):
        gpu_check.target_for("7.5")


def test_int_variants_lay_convolutions_out_in_hwnc_except_the_stem():
    mod = gpu_check.variant(models.small_cnn(), "int4")
    convs = [binding.value for binding in relay_amp.passes.layers.layer_bindings(mod, ["relax.nn.conv2d"])]
    assert [str(conv.attrs.data_layout) for conv in convs] == ["NCHW", "HWNC"]
    assert [str(conv.args[0].ty.dtype) for conv in convs] == ["float32", "int4"]


def test_unknown_variant_is_an_option_error():
    with pytest.raises(relay_amp.OptionError, match="int2"):
        gpu_check.variant(models.small_cnn(), "int2")


def test_rows_format_as_a_markdown_table():
    rows = [gpu_check.GpuRow("resnet18", "int8", "NVIDIA H200", 1.5, 0.2, 3e-3, False, 3.0),
            gpu_check.GpuRow("bert", "float16", "NVIDIA H200", 2.0, 0.001, None, True, None)]
    table = gpu_check.format_rows(rows)
    assert table.startswith("| model") and "2.00x" in table and "| yes" in table and "| NO" in table
    assert "H200" in table and "3.00e-03" in table


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_without_a_gpu_the_command_prints_one_line_and_exits_1(capsys, tmp_path):
    assert main(["gpu-check", "--results", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no NVIDIA GPU" in err and not list(tmp_path.iterdir())
    with pytest.raises(relay_amp.TargetError):
        gpu_check.check_model("resnet18")


def test_rows_judge_float_variants_and_int8q_against_fp32_and_recasts_against_the_cpu(monkeypatch):
    # the GPU replaced by the CPU: every variant then equals its CPU twin, and the judgement is what is tested
    real_build = build
    monkeypatch.setattr(gpu_check, "require_gpu", lambda: type("Gpu", (), {"compute_version": "9.0",
                                                                          "device_name": "a CPU"})())
    monkeypatch.setattr(gpu_check, "build", lambda mod, target: real_build(mod, "cpu"))
    monkeypatch.setattr(gpu_check, "_run_on_gpu", lambda executable, inputs, device, repeat: (
        gpu_check.run_executable(executable, inputs)[0].astype("float64"), 1.0))
    monkeypatch.setattr(gpu_check, "_torch_fp16_ms", lambda name, repeat: None)
    monkeypatch.setattr(gpu_check, "get_model", lambda name: models.small_cnn())
    rows = {row.variant: row for row in gpu_check.check_model("small_cnn", ["float32", "int8", "int8q"])}
    assert rows["float32"].cpu_twin_error is None and rows["float32"].max_rel_error == 0 and rows["float32"].passed
    assert rows["int8"].cpu_twin_error == 0 and rows["int8"].max_rel_error > 0.5 and rows["int8"].passed
    assert rows["int8q"].cpu_twin_error == 0 and 0 < rows["int8q"].max_rel_error < 0.05 and rows["int8q"].passed
