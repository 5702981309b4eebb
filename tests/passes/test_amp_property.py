"""Property: AMP on random small dataflow graphs stays well-formed, compiles and stays within tolerance."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import relax

import relay_amp

WIDTH = 8
OPS = ("conv", "matmul", "add", "relu", "softmax", "layer_norm", "concat")
# max |amp - fp32| / max |fp32| after at most 6 ops on values of magnitude ~1
REL_TOL = {"float16": 2e-2, "bfloat16": 8e-2}


class _GraphBuilder:
    """Emits ops over (2, WIDTH) float32 values with weights from a seeded generator."""

    def __init__(self, bb: relax.BlockBuilder, seed: int):
        self.bb, self.rng = bb, np.random.default_rng(seed)

    def weight(self, *shape):
        return relax.const((self.rng.standard_normal(shape) / np.sqrt(shape[0])).astype("float32"))

    def emit(self, op: str, a, b):
        bb, R = self.bb, relax.op
        if op == "conv":
            image = bb.emit(R.reshape(a, (2, WIDTH, 1, 1)))
            return bb.emit(R.reshape(bb.emit(R.nn.conv2d(image, self.weight(WIDTH, WIDTH, 1, 1))), (2, WIDTH)))
        if op == "matmul":
            return bb.emit(R.matmul(a, self.weight(WIDTH, WIDTH)))
        if op == "add":
            return bb.emit(R.add(a, b))
        if op == "relu":
            return bb.emit(R.nn.relu(a))
        if op == "softmax":
            return bb.emit(R.nn.softmax(a))
        if op == "layer_norm":
            return bb.emit(R.nn.layer_norm(a, self.weight(WIDTH), self.weight(WIDTH), axes=[-1]))
        both = bb.emit(R.concat([a, b], axis=1))
        return bb.emit(R.matmul(both, self.weight(2 * WIDTH, WIDTH)))


def random_graph(steps: list[tuple[str, int, int]], seed: int):
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType((2, WIDTH), "float32")) for i in range(2)]
    with bb.function("main", params):
        with bb.dataflow():
            builder, values = _GraphBuilder(bb, seed), list(params)
            for op, i, j in steps:
                values.append(builder.emit(op, values[i % len(values)], values[j % len(values)]))
            out = bb.emit_output(values[-1])
        bb.emit_func_output(out)
    return bb.get()


graphs = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=graphs, dtype=st.sampled_from(["float16", "bfloat16"]), seed=st.integers(0, 2**16))
def test_amp_on_random_graphs_is_well_formed_and_close_to_fp32(steps, dtype, seed):
    mod = random_graph(steps, seed)
    converted = relay_amp.to_mixed_precision(mod, dtype)
    relax.analysis.well_formed(converted)
    inputs = [np.random.default_rng(seed + k).standard_normal((2, WIDTH)).astype("float32") for k in range(2)]
    expected = relay_amp.run(mod, inputs)[0]
    got = relay_amp.run(converted, inputs)[0]
    assert got.dtype == np.float32
    scale = max(float(np.abs(expected).max()), 1e-3)
    assert float(np.abs(got - expected).max()) / scale < REL_TOL[dtype], f"{steps}"
