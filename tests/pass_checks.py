"""The check every structural pass test makes: well-formed output, equal to Expected, input untouched."""

import tvm
from tvm import relax


def assert_transforms(transform, before: tvm.IRModule, expected: tvm.IRModule) -> tvm.IRModule:
    """Apply `transform` to `before` and compare with `expected`; return the output."""
    text = before.script()
    after = transform(before)
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(after, expected)
    assert before.script() == text, "the pass mutated its input module"
    return after
