"""build: host CPU, bf16 preset, tuning logs, and CUDA tensor-core code without a GPU."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import relay_amp
from relay_amp import models, targets
from relay_amp.compile.build import build, build_for_host, compile_ptx, cuda_source, export_library, library_path
from relay_amp.runtime import compile_for_host, run_executable

from builders import positions_onnx, single_output_module, tensor


def matmul_module(n: int = 256):
    return single_output_module(relax.op.matmul, tensor("x", (n, n)), tensor("w", (n, n)))


def test_build_for_host_cpu_matches_reference():
    mod = models.small_cnn()
    inputs = models.example_inputs(mod)
    np.testing.assert_allclose(run_executable(build(mod, "cpu"), inputs)[0], relay_amp.run(mod, inputs)[0],
                               rtol=1e-5, atol=1e-5)


def test_the_host_compiler_is_build_for_the_host_preset(monkeypatch):
    built = []
    monkeypatch.setattr(relay_amp.compile.build, "build", lambda mod, target: built.append(target) or build(mod, target))
    mod = models.small_cnn()
    inputs = models.example_inputs(mod)
    np.testing.assert_allclose(run_executable(compile_for_host(mod), inputs)[0], relay_amp.run(mod, inputs)[0],
                               rtol=1e-5, atol=1e-5)
    assert built == [targets.host_preset()]
    assert relay_amp.runtime._host_compiler["compile"] is build_for_host


@pytest.mark.skipif(not targets.host_supports("avx512_bf16"), reason="host CPU lacks avx512_bf16")
def test_build_bf16_model_for_the_bf16_preset():
    mod = models.small_cnn()
    inputs = models.example_inputs(mod)
    executable = build(relay_amp.to_mixed_precision(mod, "bfloat16"), "cpu-avx512-bf16")
    assert "vcvtneps2bf16" in executable.mod.imports[0].inspect_source("asm")  # native bf16 rounding
    got = run_executable(executable, inputs)[0]
    expected = relay_amp.run(mod, inputs)[0]
    assert np.abs(got - expected).max() / np.abs(expected).max() < 2e-2


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_float16_matmul_for_tensor_cores_uses_mma_instructions():
    executable = build(relay_amp.to_mixed_precision(matmul_module(), "float16"), "cuda-tensorcore")
    source = cuda_source(executable)
    assert "wmma" in source or "mma" in source
    instructions = set(re.findall(r"(?:wmma\.mma|mma)\.sync[\w.]*", compile_ptx(source)))
    assert instructions, "no tensor-core instruction in the PTX"
    assert any(".m16n16k16" in i or ".f16" in i for i in instructions), instructions


def test_cuda_source_of_a_cpu_build_is_a_target_error():
    with pytest.raises(relay_amp.TargetError, match="no CUDA module"):
        cuda_source(build(models.small_cnn(), "cpu"))


def test_build_warns_of_symbolic_inputs_and_still_computes_them():
    weight = relax.const(np.random.default_rng(0).standard_normal((8, 16)).astype("float32"))
    batch = tvm.tirx.Var("batch", "int64")
    mod = single_output_module(lambda x: relax.op.nn.relu(relax.op.matmul(x, weight)), tensor("x", (batch, 8)))
    with pytest.warns(UserWarning, match=r"symbolic dims \(batch\).*specialize\(mod, \{'batch': N\}\)"):
        executable = build(mod, "cpu")
    x = np.random.default_rng(1).standard_normal((3, 8)).astype("float32")
    np.testing.assert_allclose(run_executable(executable, [x])[0], relay_amp.run(mod, [x])[0], rtol=1e-5, atol=1e-5)


def test_a_dynamic_model_tvm_cannot_compile_is_a_module_error_saying_how_to_bind_its_dims():
    mod = relay_amp.frontend.from_onnx(positions_onnx())
    with pytest.warns(UserWarning), pytest.raises(relay_amp.ModuleError,
                                                  match=r"symbolic input dims \(batch, seq\).*dims=\{'batch': N"):
        build(mod, "cpu")
    build(relay_amp.frontend.from_onnx(positions_onnx(), dims={"batch": 2, "seq": 4}), "cpu")


# run in a fresh interpreter: the library's main on the inputs saved in argv[2], its output saved to argv[3]
TVM_RUNTIME_ALONE = """
import sys
import numpy as np
import tvm
from tvm import relax
vm = relax.VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())
inputs = np.load(sys.argv[2])
output = vm["main"](*[tvm.runtime.tensor(inputs[name]) for name in inputs.files])
np.save(sys.argv[3], output.numpy())
assert "relay_amp" not in sys.modules
"""


def test_an_exported_library_runs_on_the_tvm_runtime_alone_as_the_build_ran(tmp_path):
    mod = relay_amp.to_mixed_precision(models.small_cnn(), "bfloat16")
    executable = build(mod, targets.host_preset())
    inputs = models.example_inputs(mod)
    path = export_library(executable, tmp_path / "lib" / "model.so")
    assert path == tmp_path / "lib" / "model.so"
    assert [p.name for p in path.parent.iterdir()] == ["model.so"]  # the temporary name renamed
    np.savez(tmp_path / "inputs.npz", *inputs)
    environment = {**os.environ, "TVM_NUM_THREADS": str(relay_amp.runtime.pool_threads())}
    subprocess.run([sys.executable, "-c", TVM_RUNTIME_ALONE, str(path), str(tmp_path / "inputs.npz"),
                    str(tmp_path / "output.npy")], check=True, env=environment)
    np.testing.assert_allclose(np.load(tmp_path / "output.npy"), run_executable(executable, inputs)[0], rtol=1e-6)


def test_a_library_exports_as_a_tar_of_objects(tmp_path):
    path = export_library(build(models.small_cnn(), "cpu"), tmp_path / "model.tar")
    assert tarfile.is_tarfile(path)


class _FailingExecutable:
    """An executable whose export writes part of a file, then fails as a linker does."""

    def export_library(self, path):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("Compilation error:\nld: cannot find -lfoo")


def test_a_failed_export_is_a_module_error_and_leaves_the_old_file_alone(tmp_path):
    old = tmp_path / "model.so"
    old.write_bytes(b"old")
    with pytest.raises(relay_amp.ModuleError, match=r"cannot write .*model\.so: ld: cannot find -lfoo"):
        export_library(_FailingExecutable(), old)
    assert old.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model.so"]


def test_a_library_name_of_another_format_is_an_option_error():
    with pytest.raises(relay_amp.OptionError, match=r"written as \.so or \.tar, got 'model\.zip'"):
        library_path("model.zip")
