"""Calibration data: random batches and batches read from .npz files."""

import numpy as np
import pytest

from relay_amp import ModelLoadError, OptionError, models
from relay_amp.tools.calibration import load_batches, random_batches


def test_random_batches_match_the_inputs_and_differ_from_each_other():
    mod = models.small_cnn(batch=2)
    batches = random_batches(mod, 3)
    assert len(batches) == 3 and all(batch[0].shape == (2, 3, 16, 16) for batch in batches)
    assert not np.array_equal(batches[0][0], batches[1][0])


def test_a_npz_is_split_into_batches_of_the_model_batch(tmp_path):
    mod = models.small_cnn(batch=2)
    samples = np.arange(6 * 3 * 16 * 16, dtype="float64").reshape(6, 3, 16, 16)
    path = tmp_path / "calib.npz"
    np.savez(path, anything=samples)  # one input: any name
    batches = load_batches(mod, path)
    assert len(batches) == 3 and batches[1][0].dtype == np.float32
    np.testing.assert_array_equal(batches[1][0], samples[2:4])


def test_bad_calibration_files_name_the_file_and_input(tmp_path):
    mod = models.small_cnn(batch=2)
    with pytest.raises(ModelLoadError, match="absent.npz"):
        load_batches(mod, tmp_path / "absent.npz")
    odd = tmp_path / "odd.npz"
    np.savez(odd, x=np.zeros((3, 3, 16, 16)))
    with pytest.raises(OptionError, match="odd.npz.*multiple of 2 samples"):
        load_batches(mod, odd)
    encoder = models.bert_encoder(seq_len=16, hidden=64, heads=2, layers=1)
    named = tmp_path / "named.npz"
    np.savez(named, wrong=np.zeros((1, 16)), other=np.zeros((1, 16)))
    with pytest.raises(OptionError, match="no array for input"):
        load_batches(encoder, named)
