"""stack: a lowered CPU function's buffers of up to MAX_STACK_BYTES stay on the stack, not in per-iteration
workspace calls."""

import re

import numpy as np
import tvm
from tvm import relax
from tvm.script import tirx as T

from relay_amp.backend.cpu import stack
from relay_amp.compile.build import build
from relay_amp.runtime import run_executable

from builders import single_output_module, tensor
from pass_checks import assert_transforms

TOLERANCE = 1e-6  # relative to the output's largest value: fp32 exps and sums over the same values


@T.prim_func(private=True)
def _rows_buffered(x: T.Buffer((4, 256), "float32"), out: T.Buffer((4, 256), "float32")):
    for row in T.parallel(4):
        row_copy = T.alloc_buffer((256,))
        wide = T.alloc_buffer((32768,))
        for j in range(256):
            row_copy[j] = x[row, j]
            wide[j] = x[row, j]
        for j in range(256):
            out[row, j] = row_copy[j] + wide[j]


@T.prim_func(private=True)
def _rows_buffered_on_stack(x: T.Buffer((4, 256), "float32"), out: T.Buffer((4, 256), "float32")):
    for row in T.parallel(4):
        row_copy = T.alloc_buffer((256,), annotations={"disable_lower_builtin": 1})
        wide = T.alloc_buffer((32768,))
        for j in range(256):
            row_copy[j] = x[row, j]
            wide[j] = x[row, j]
        for j in range(256):
            out[row, j] = row_copy[j] + wide[j]


def test_a_row_buffer_of_1_kb_stays_on_the_stack_and_one_of_128_kb_does_not():
    assert_transforms(stack.StackBuffers, tvm.IRModule({"main": _rows_buffered}),
                      tvm.IRModule({"main": _rows_buffered_on_stack}))


def test_stack_bytes_counts_flat_constant_cpu_buffers_only():
    assert stack.stack_bytes(tvm.tirx.decl_buffer((256,), "float32")) == 1024
    assert stack.stack_bytes(tvm.tirx.decl_buffer((8,), "bfloat16")) == 16
    assert stack.stack_bytes(tvm.tirx.decl_buffer((4, 4), "float32")) == 0
    assert stack.stack_bytes(tvm.tirx.decl_buffer((tvm.tirx.Var("n", "int64"),), "float32")) == 0
    assert stack.stack_bytes(tvm.tirx.decl_buffer((256,), "float32", scope="shared")) == 0


def test_a_softmax_over_rows_of_256_calls_no_workspace_allocation_and_matches_numpy():
    """TVM would allocate the row of exps (1 KB) with a workspace call at each of the 64 rows."""
    mod = single_output_module(lambda x: relax.op.nn.softmax(x, axis=-1), tensor("x", (64, 256)))
    executable = build(mod, "cpu")
    assert "TVMBackendAllocWorkspace" not in _parallel_bodies(executable.mod.imports[0].inspect_source("ll"))
    x = np.random.default_rng(0).standard_normal((64, 256)).astype("float32") * 4
    exps = np.exp(x - x.max(axis=-1, keepdims=True))
    expected = exps / exps.sum(axis=-1, keepdims=True)
    assert np.abs(run_executable(executable, [x])[0] - expected).max() <= TOLERANCE * expected.max()


def _parallel_bodies(llvm_ir: str) -> str:
    """The LLVM IR of the functions the parallel loops became."""
    functions = llvm_ir.split("\ndefine ")
    bodies = [f for f in functions if re.match(r"[^@\n]*@__tvm_parallel_lambda", f)]
    assert bodies
    return "\n".join(bodies)
