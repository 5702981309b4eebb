"""relay_amp._ir helpers that have no pass of their own to be tested through."""

import subprocess
import sys

IMPORT_IN_A_FRESH_PROCESS = """
import inspect
import tvm
from relay_amp._ir import import_tensor_intrinsics
stack = inspect.stack
module = import_tensor_intrinsics("tvm.s_tir.tensor_intrin.x86")
assert inspect.stack is stack, "inspect.stack was not restored"
assert module is import_tensor_intrinsics("tvm.s_tir.tensor_intrin.x86")
tvm.s_tir.TensorIntrin.get("dot_16x4_vnni")  # raises if the TVMScript intrinsics were not registered
tvm.s_tir.TensorIntrin.get("wmma_sync_16x16x16_f16f16f32")  # the package's CUDA ones came with it
print("ok")
"""


def test_tensor_intrinsics_import_registers_them_and_restores_inspect():
    result = subprocess.run([sys.executable, "-c", IMPORT_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
