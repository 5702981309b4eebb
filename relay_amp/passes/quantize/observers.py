"""Observers: the clipping threshold of a layer's activations, chosen from a histogram of |x| seen in calibration.

One pass over the data fills a histogram per layer whose range grows with the largest |x| seen (earlier counts
are moved into the wider bins). The observers then pick the threshold T that int8 codes map onto [-T, T] (or
uint8 onto [0, T]): `minmax` keeps every value, `percentile` clips the top of the distribution, `entropy`
minimizes the KL divergence between the histogram and its quantized copy (TensorRT's calibration, as TVM
Relay's `kl_divergence` did), `mse` minimizes the expected squared error of rounding and clipping.

Exact zeros (a ReLU's, a hardswish's) are counted apart: code 0 holds them at any threshold, so they weigh in no
observer's choice but percentile's. In the histogram's first bin, a ReLU output's spike of zeros made `entropy`
keep that bin unmerged, at the least threshold it can (ResNet-18: 8/32 top-1 agreement, MobileNetV3 0/32), and
`mse` charge rounding error to values that have none.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...errors import OptionError

OBSERVERS = ("minmax", "percentile", "entropy", "mse")
BINS = 2048
DEFAULT_PERCENTILE = 99.99
CANDIDATE_STRIDE = 16  # thresholds tried by entropy and mse: every 16th bin edge


@dataclass
class Histogram:
    """Counts of nonzero |x| over [0, top] in BINS bins, how many values were exactly zero, and the smallest value
    seen (is the layer's input signed?)."""

    top: float = 0.0
    minimum: float = np.inf
    counts: np.ndarray = field(default_factory=lambda: np.zeros(BINS))
    zeros: int = 0

    def add(self, values: np.ndarray) -> None:
        """Count one batch of values (finite ones only; the caller rejects NaN and inf)."""
        magnitudes = np.abs(values.astype("float64")).ravel()
        self.minimum = min(self.minimum, float(values.min(initial=np.inf)))
        nonzero = magnitudes[magnitudes > 0]
        self.zeros += magnitudes.size - nonzero.size
        peak = float(nonzero.max(initial=0.0))
        if peak > self.top:
            self._widen(peak)
        if self.top > 0:
            self.counts += np.histogram(nonzero, bins=BINS, range=(0.0, self.top))[0]

    def _widen(self, top: float) -> None:
        """Move the counts into bins over [0, top]."""
        if self.top > 0:
            self.counts = self.counts_over(top)
        self.top = top

    def counts_over(self, top: float) -> np.ndarray:
        """The counts in BINS bins over [0, top] (at least this histogram's top): each bin's count where its centre
        falls."""
        centres = (np.arange(BINS) + 0.5) * (self.top / BINS)
        return np.bincount(np.minimum((centres / top * BINS).astype(int), BINS - 1), weights=self.counts,
                           minlength=BINS)

    @property
    def rms(self) -> float:
        """The root mean square of the values counted (bin centres for the nonzero ones), zeros included."""
        centres = (np.arange(BINS) + 0.5) * (self.top / BINS)
        total = self.counts.sum() + self.zeros
        return float(np.sqrt((self.counts * centres * centres).sum() / total)) if total else 0.0

    @property
    def signed(self) -> bool:
        """Whether a negative value was seen."""
        return self.minimum < 0

    def edge(self, index: int) -> float:
        """The upper edge of bin `index - 1`: the threshold that keeps the first `index` bins."""
        return index * self.top / BINS


def merged(histograms: Sequence[Histogram]) -> Histogram:
    """One histogram of every value `histograms` counted."""
    total = Histogram(top=max(histogram.top for histogram in histograms),
                      minimum=min(histogram.minimum for histogram in histograms),
                      zeros=sum(histogram.zeros for histogram in histograms))
    for histogram in histograms:
        if histogram.top > 0:
            total.counts += histogram.counts_over(total.top)
    return total


def threshold(histogram: Histogram, observer: str, levels: int, percentile: float = DEFAULT_PERCENTILE) -> float:
    """The clipping threshold `observer` picks for codes with `levels` steps above zero (127 for int8)."""
    if observer not in OBSERVERS:
        raise OptionError(f"observer must be one of {list(OBSERVERS)}, got {observer!r}")
    total = histogram.counts.sum()
    if histogram.top == 0 or total == 0:
        return 0.0
    if observer == "minmax":
        return histogram.top
    if observer == "percentile":  # of all values, zeros too
        cumulative = (np.cumsum(histogram.counts) + histogram.zeros) / (total + histogram.zeros)
        return histogram.edge(int(np.searchsorted(cumulative, percentile / 100)) + 1)
    chooser = _kl_divergence if observer == "entropy" else _squared_error
    candidates = np.arange(min(levels, BINS), BINS + 1, CANDIDATE_STRIDE)
    costs = [chooser(histogram.counts, int(bins), levels) for bins in candidates]
    return histogram.edge(int(candidates[int(np.argmin(costs))]))


def _kl_divergence(counts: np.ndarray, bins: int, levels: int) -> float:
    """KL(P || Q): P the first `bins` bins with the clipped tail added to the last, Q that merged into `levels`."""
    reference = counts[:bins].copy()
    reference[-1] += counts[bins:].sum()
    groups = np.array_split(np.arange(bins), levels)
    expanded = np.zeros(bins)
    for group in groups:
        occupied = group[counts[group] > 0]
        if occupied.size:
            expanded[occupied] = counts[group].sum() / occupied.size
    p, q = reference / reference.sum(), expanded / max(expanded.sum(), 1e-300)
    mask = p > 0
    return float(np.sum(p[mask] * np.log(p[mask] / np.maximum(q[mask], 1e-12))))


def _squared_error(counts: np.ndarray, bins: int, levels: int) -> float:
    """Expected squared error (in bin widths) of rounding to `levels` steps over the first `bins` bins and
    clipping the rest to the last one."""
    centres = np.arange(counts.size) + 0.5
    step = bins / levels
    rounding = counts[:bins].sum() * step * step / 12
    clipping = np.sum(counts[bins:] * (centres[bins:] - bins) ** 2)
    return float(rounding + clipping)
