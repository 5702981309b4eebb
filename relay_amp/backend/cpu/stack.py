"""stack: the buffers a lowered CPU function allocates, up to MAX_STACK_BYTES each, kept on the stack.

TVM's LowerTVMBuiltin leaves a CPU buffer on the stack only under 1024 bytes (its runtime::kMaxStackAlloca); a
bigger one becomes a TVMBackendAllocWorkspace call and a free, made wherever the buffer's allocation sits: inside
a loop, at each of its iterations. A softmax over rows of 256 keeps a row of exps per parallel row, so SegFormer-B0
at 512x512 made 16384 calls of each per attention softmax (0.60 -> 0.55 ms, the same outputs). `StackBuffers`
marks such allocations with TVM's `disable_lower_builtin`, which leaves them to LLVM's code generator: an alloca
at the entry of the function (a parallel loop's body is a function of its own), made once per call or task.

TIR_PIPELINE names TVM's S-TIR pipeline with `StackBuffers` run before its host finalization (which holds
LowerTVMBuiltin); the CPU backend builds with it.
"""

import tvm
import tvm_ffi
from tvm import tirx

TIR_PIPELINE = "relay_amp_cpu"
MAX_STACK_BYTES = 64 * 1024  # per buffer; TVM's pool threads run on the process's stacks (8 MB on Linux)
_DISABLE_LOWER_BUILTIN = "disable_lower_builtin"  # TVM's transform::kDisableLowerTVMBuiltin


def stack_bytes(buffer: tirx.Buffer) -> int:
    """The bytes of a flat, constant-size buffer in CPU memory ("global" scope), 0 for any other buffer."""
    if buffer.scope() != "global" or len(buffer.shape) != 1 or not isinstance(buffer.shape[0], tirx.IntImm):
        return 0
    return int(buffer.shape[0]) * buffer.dtype.bits * buffer.dtype.lanes // 8


def _on_stack(allocation: tirx.AllocBuffer) -> tirx.AllocBuffer:
    if not 0 < stack_bytes(allocation.buffer) <= MAX_STACK_BYTES:
        return allocation
    annotations = {**allocation.annotations, _DISABLE_LOWER_BUILTIN: tirx.IntImm("int32", 1)}
    return tirx.AllocBuffer(allocation.buffer, annotations)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="StackBuffers")
def StackBuffers(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx) -> tirx.PrimFunc:  # noqa: N802
    """Mark every allocation of a flat CPU buffer of at most MAX_STACK_BYTES to stay on the stack."""
    body = tvm_ffi.structural_map(func.body, [(tirx.AllocBuffer, _on_stack)])
    return func if body.same_as(func.body) else func.with_body(body)


def _pipeline():
    """TVM's S-TIR pipeline, StackBuffers first among its host finalization passes."""
    lower, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("s_tir")
    return lower, lambda: tvm.transform.Sequential([StackBuffers, finalize_host()]), finalize_device


tvm.tirx.register_tir_pipeline(TIR_PIPELINE, _pipeline)
