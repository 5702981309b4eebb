"""Ready metrics."""

import numpy as np
import pytest

from relay_amp import metrics


def test_top1_accuracy_and_agreement():
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert metrics.top1_accuracy(logits, np.array([1, 0, 0])) == pytest.approx(2 / 3)
    assert metrics.top1_agreement(logits, logits * 3) == 1.0
    assert metrics.top1_agreement(logits, -logits) == 0.0


def test_cosine_similarity_of_embeddings():
    a = np.random.default_rng(0).standard_normal((2, 4, 8))
    assert metrics.cosine_similarity(a, 2 * a) == pytest.approx(1.0)
    assert metrics.cosine_similarity(a, -a) == pytest.approx(-1.0)


def test_agreement_metric_picks_by_output_rank():
    assert metrics.agreement_metric(np.zeros((4, 10))) is metrics.top1_agreement
    assert metrics.agreement_metric(np.zeros((1, 16, 256))) is metrics.cosine_similarity
