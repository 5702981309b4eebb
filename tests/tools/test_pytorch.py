"""pytorch: the twins have the built-in models' input and output shapes, and time in both dtypes."""

import pytest

import relay_amp
from relay_amp import models
from relay_amp.tools import pytorch

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["matmul", "resnet18_conv", "bert"])
def test_twin_matches_the_built_in_model_shapes(name):
    module, example = pytorch.twin(name)
    relax_main = models.get_model(name)["main"]
    assert list(example.shape) == [int(d) for d in relax_main.params[0].ty.shape.values]
    with torch.inference_mode():
        out = module(example)
    assert list(out.shape) == [int(d) for d in relax_main.ret_ty.shape.values]


def test_twin_runner_runs_fp32_and_bf16_under_autocast():
    outputs = {dtype: pytorch.twin_runner("resnet18_conv", dtype, threads=1)() for dtype in pytorch.TORCH_DTYPES}
    assert outputs["float32"].dtype == torch.float32 and outputs["bfloat16"].dtype == torch.bfloat16
    assert outputs["float32"].shape == outputs["bfloat16"].shape == (1, 128, 28, 28)


def test_bf16_conv_twins_run_channels_last_as_pytorch_runs_them_best():
    _, bf16_input = pytorch.best_twin("resnet18_conv", "bfloat16")
    _, fp32_input = pytorch.best_twin("resnet18_conv", "float32")
    assert bf16_input.is_contiguous(memory_format=torch.channels_last)
    assert not fp32_input.is_contiguous(memory_format=torch.channels_last)
    _, tokens = pytorch.best_twin("bert", "bfloat16")  # not an image: as it is
    assert tokens.dim() == 2


def test_unknown_twin_and_dtype_are_option_errors():
    with pytest.raises(relay_amp.OptionError, match="small_cnn"):
        pytorch.twin("small_cnn")
    with pytest.raises(relay_amp.OptionError, match="int8"):
        pytorch.twin_runner("matmul", "int8", threads=1)


class _Probe:
    def __init__(self, returncode):
        self.returncode, self.commands = returncode, []

    def __call__(self, command, **kwargs):
        self.commands.append(command)
        return type("Result", (), {"returncode": self.returncode})()


@pytest.mark.parametrize(("amx_flag", "probe_status", "capped"), [(False, -4, False), (True, 0, False), (True, -4, True)])
def test_onednn_is_capped_below_amx_only_where_its_amx_dies(monkeypatch, amx_flag, probe_status, capped):
    probe = _Probe(probe_status)
    monkeypatch.setattr(pytorch, "host_supports", lambda feature: amx_flag)
    monkeypatch.setattr(pytorch.subprocess, "run", probe)
    monkeypatch.delenv(pytorch.ONEDNN_ISA_ENV, raising=False)
    if capped:
        with pytest.warns(UserWarning, match="AMX kernels die"):
            assert pytorch.avoid_broken_onednn_amx.__wrapped__()
    else:
        assert not pytorch.avoid_broken_onednn_amx.__wrapped__()
    assert (pytorch.os.environ.get(pytorch.ONEDNN_ISA_ENV) == pytorch.AMX_FREE_ISA) == capped
    assert len(probe.commands) == int(amx_flag) and all("autocast" in command[-1] for command in probe.commands)


def test_an_isa_the_user_set_is_left_alone(monkeypatch):
    probe = _Probe(-4)
    monkeypatch.setattr(pytorch, "host_supports", lambda feature: True)
    monkeypatch.setattr(pytorch.subprocess, "run", probe)
    monkeypatch.setenv(pytorch.ONEDNN_ISA_ENV, "AVX512_CORE_AMX")
    assert not pytorch.avoid_broken_onednn_amx.__wrapped__() and not probe.commands
    assert pytorch.os.environ[pytorch.ONEDNN_ISA_ENV] == "AVX512_CORE_AMX"
