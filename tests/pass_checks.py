"""The check every structural pass test makes: well-formed output, equal to Expected, input untouched; and the
names of the functions the host's CPU pipeline prepares from a module (kernels, fused functions)."""

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


def prepared_module(mod: tvm.IRModule) -> tvm.IRModule:
    """What the host's CPU pipeline prepares from `mod` (kernels, fused functions); on a host without dot-product
    kernels (AVX2 only), cpu-avx512-bf16's (preparing runs nothing)."""
    import relay_amp
    from relay_amp.backend.cpu import pipeline

    preset = relay_amp.targets.host_preset()
    target = relay_amp.targets.get_target("cpu-avx512-bf16" if preset == "cpu" else preset)
    with target, tvm.transform.PassContext(opt_level=3):
        return pipeline.prepare_passes(target)(mod)


def prepared_function_names(mod: tvm.IRModule) -> list[str]:
    """The names of the functions in `prepared_module(mod)`."""
    return [gv.name_hint for gv in prepared_module(mod).get_global_vars()]


def prepared_calls(mod: tvm.IRModule, name_part: str) -> list[relax.Call]:
    """The calls in `prepared_module(mod)`'s main of its functions whose name contains `name_part`."""
    return [binding.value for block in prepared_module(mod)["main"].body.blocks for binding in block.bindings
            if isinstance(binding.value, relax.Call) and isinstance(binding.value.args[0], tvm.ir.GlobalVar)
            and name_part in binding.value.args[0].name_hint]
