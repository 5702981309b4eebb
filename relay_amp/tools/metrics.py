"""Ready metrics for accuracy-aware conversion: higher is better, computed over a whole dataset."""

import numpy as np


def top1_accuracy(outputs: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of rows whose arg-max equals the label."""
    return float((np.asarray(outputs).argmax(-1) == np.asarray(labels)).mean())


def top1_agreement(outputs: np.ndarray, reference: np.ndarray) -> float:
    """The fraction of rows whose arg-max equals the reference outputs' arg-max (fp32 agreement)."""
    return top1_accuracy(outputs, np.asarray(reference).argmax(-1))


def cosine_similarity(outputs: np.ndarray, reference: np.ndarray) -> float:
    """The mean cosine similarity of the last-axis vectors of outputs and reference (embeddings)."""
    a = np.asarray(outputs, dtype="float64").reshape(-1, np.shape(outputs)[-1])
    b = np.asarray(reference, dtype="float64").reshape(-1, np.shape(reference)[-1])
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return float(np.mean((a * b).sum(axis=1) / np.maximum(norms, 1e-30)))


def agreement_metric(reference: np.ndarray):
    """The metric for "agree with fp32": top-1 agreement for (batch, classes), cosine otherwise."""
    return top1_agreement if np.ndim(reference) == 2 else cosine_similarity
