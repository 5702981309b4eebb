"""_zero_addends: adds and subtracts of all-zero constants that keep their other operand's shape are dropped."""

import numpy as np
import torch
from tvm.script import ir as I
from tvm.script import relax as R

import relay_amp
from relay_amp._zero_addends import zero_addends_dropped
from relay_amp.runtime import run_executable

from pass_checks import assert_transforms


def test_a_mask_of_zeros_added_to_scores_is_dropped_and_other_adds_stay():
    @I.ir_module
    class Before:
        @R.function
        def main(scores: R.Tensor((1, 2, 4, 4), "float32"), row: R.Tensor((1, 4), "float32")):
            with R.dataflow():
                masked = R.add(scores, R.const(np.zeros((1, 1, 4, 4), "float32")))  # dropped
                first = R.add(R.const(np.zeros((4,), "float32")), masked)  # dropped: zeros first
                less = R.subtract(first, R.const(np.zeros((), "float32")))  # dropped
                negated = R.subtract(R.const(np.zeros((), "float32")), less)  # kept: 0 - x is -x
                widened = R.add(row, R.const(np.zeros((3, 4), "float32")))  # kept: it broadcasts row to 3 rows
                shifted = R.add(negated, R.const(np.full((4,), 1e-30, "float32")))  # kept: not zeros
                gv = (shifted, widened)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(scores: R.Tensor((1, 2, 4, 4), "float32"), row: R.Tensor((1, 4), "float32")):
            with R.dataflow():
                negated = R.subtract(R.const(np.zeros((), "float32")), scores)
                widened = R.add(row, R.const(np.zeros((3, 4), "float32")))
                shifted = R.add(negated, R.const(np.full((4,), 1e-30, "float32")))
                gv = (shifted, widened)
                R.output(gv)
            return gv

    assert_transforms(zero_addends_dropped, Before, Expected)


def test_an_attention_with_an_empty_mask_imports_without_the_add_and_matches_pytorch(tmp_path):
    """torch's scaled_dot_product_attention with a mask of zeros, exported: the mask is a constant of zeros."""
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            mask = torch.zeros(1, 1, 8, 8)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(seed)) for seed in range(3))
    path = tmp_path / "attention.onnx"
    torch.onnx.export(Attention(), (q, k, v), str(path), dynamo=False, opset_version=17)
    mod = relay_amp.frontend.from_onnx(str(path))
    assert "R.add" not in mod["main"].script()
    got = run_executable(relay_amp.build(mod, "cpu"), [q.numpy(), k.numpy(), v.numpy()])[0]
    np.testing.assert_allclose(got, Attention()(q, k, v).numpy(), rtol=1e-5, atol=1e-6)
