"""save/load of converted modules, and atomic writes."""

import json
from dataclasses import asdict, dataclass

import numpy as np
import pytest
import tvm

import relay_amp
from relay_amp import models
from relay_amp.serialization import atomic_write_bytes, atomic_write_text, dataclass_from_json


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_save_load_round_trips_low_precision_constants_and_plan(dtype, tmp_path):
    converted = relay_amp.to_mixed_precision(models.small_cnn(), dtype)
    path = tmp_path / "model.json"
    relay_amp.save(converted, path)
    loaded = relay_amp.load(path)
    tvm.ir.assert_structural_equal(loaded, converted)
    assert relay_amp.precision_plan(loaded) == relay_amp.precision_plan(converted)
    x = models.example_inputs(converted)
    np.testing.assert_array_equal(relay_amp.run(loaded, x)[0], relay_amp.run(converted, x)[0])


def test_load_rejects_missing_and_corrupt_files(tmp_path):
    with pytest.raises(relay_amp.ModelLoadError, match="absent.json"):
        relay_amp.load(tmp_path / "absent.json")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"root": 1, "nodes": [{"type_key": "nonsense"}]}')
    with pytest.raises(relay_amp.ModelLoadError, match="corrupt.json"):
        relay_amp.load(corrupt)


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")

    with pytest.raises(TypeError):
        atomic_write_bytes(path, object())  # fails inside the write: the temporary file must go
    with pytest.raises(TypeError, match="expected text"):
        atomic_write_text(path, b"bytes")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_a_dataclass_comes_back_from_its_json_with_its_tuples():
    @dataclass(frozen=True)
    class Spec:
        shape: tuple
        name: str
        size: int

    spec = Spec((1, 2, 3), "conv", 4)
    again = dataclass_from_json(Spec, json.dumps(asdict(spec)))
    assert again == spec and isinstance(again.shape, tuple)
