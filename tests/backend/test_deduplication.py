"""deduplication_passes: a value computed twice the same way (a quantizer's requantize per reader) is computed once."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp.backend import fusion
from relay_amp.backend.cpu import pipeline as cpu_pipeline
from relay_amp.backend.cuda import pipeline as cuda_pipeline

from pass_checks import assert_transforms


@I.ir_module
class TwoRequantizes:
    @R.function
    def main(x: R.Tensor((1, 8), "float32")) -> R.Tuple(R.Tensor((1, 8), "uint8"), R.Tensor((1, 8), "uint8")):
        with R.dataflow():
            a = R.multiply(x, R.const(4.0, "float32"))
            a_rounded = R.floor(R.add(a, R.const(0.5, "float32")))
            a_codes = R.astype(R.clip(a_rounded, 0, 255), "uint8")
            b = R.multiply(x, R.const(4.0, "float32"))
            b_rounded = R.floor(R.add(b, R.const(0.5, "float32")))
            b_codes = R.astype(R.clip(b_rounded, 0, 255), "uint8")
            gv = (a_codes, b_codes)
            R.output(gv)
        return gv


def test_identical_chains_are_computed_once():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8), "float32")) -> R.Tuple(R.Tensor((1, 8), "uint8"), R.Tensor((1, 8), "uint8")):
            with R.dataflow():
                a = R.multiply(x, R.const(4.0, "float32"))
                a_rounded = R.floor(R.add(a, R.const(0.5, "float32")))
                a_codes = R.astype(R.clip(a_rounded, 0, 255), "uint8")
                gv = (a_codes, a_codes)
                R.output(gv)
            return gv

    assert_transforms(tvm.transform.Sequential(fusion.deduplication_passes()), TwoRequantizes, Expected)


@pytest.mark.parametrize("pipeline", [cpu_pipeline, cuda_pipeline])
def test_every_backend_deduplicates_first(pipeline):
    target = tvm.target.Target({"kind": "llvm"} if pipeline is cpu_pipeline else {"kind": "cuda", "arch": "sm_80"})
    prepared = pipeline.prepare_passes(target)(TwoRequantizes)
    calls = [b for b in prepared["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert len(calls) == 1  # one fused requantize, read twice


def test_a_deduplicated_build_computes_both_outputs():
    x = np.linspace(-1.0, 70.0, 8, dtype="float32").reshape(1, 8)
    expected = np.clip(np.floor(x * 4.0 + 0.5), 0, 255).astype("uint8")
    for got in relay_amp.run(TwoRequantizes, [x]):
        np.testing.assert_array_equal(got, expected)


def test_cpu_pads_a_tensor_two_amx_convs_read_once():
    """Two 3x3 convs of one tensor (an Inception block's branches) on AMX: dispatch pads it by one pixel around for
    each, and the pipeline merges the two pads after epilogue fusion."""
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((1, 14, 14, 64), "bfloat16"))
    weights = [rng.standard_normal((64, 64, 3, 3)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            products = [bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1, data_layout="NHWC",
                                                   out_dtype="float32")) for w in weights]
            out = bb.emit_output(relax.Tuple(products))
        bb.emit_func_output(out)
    prepared = cpu_pipeline.prepare_passes(relay_amp.targets.get_target("cpu-amx"))(bb.get())
    called = [b.value.args[0].name_hint for b in prepared["main"].body.blocks[0].bindings
              if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    assert len([name for name in called if "pad" in name]) == 1  # one pad, read by both kernels
    assert len([name for name in called if "dot_kernel" in name]) == 2
