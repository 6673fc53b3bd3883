"""Weighted log-binned histograms and percentiles for the simulator's latency statistics."""

from __future__ import annotations

from math import log10

import numpy as np

# 1 us .. 10^4 s at 100 bins per decade: quantiles within 2.3% of the true value.
_LO, _DECADES, _PER_DECADE = 1e-6, 10, 100
_LAST = _DECADES * _PER_DECADE  # the last bin (values >= 10^4 s)


class Histogram:
    """Token-weighted distribution of inter-token gaps (one engine step = one gap for each sequence in it)."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0.0] * (_LAST + 1)
        self.total = 0.0

    def add(self, value: float, weight: float) -> None:
        if weight <= 0:
            return
        self.counts[bin_index(value)] += weight
        self.total += weight

    def quantile(self, q: float) -> float | None:
        """The value below which a fraction q of the weight lies (bin upper edge); None when empty."""
        if not 0 <= q <= 1:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if self.total <= 0:
            return None
        cum = np.cumsum(self.counts)
        i = int(np.searchsorted(cum, q * self.total, side="left"))
        return _LO * 10 ** ((min(i, _LAST) + 1) / _PER_DECADE)

    def merge(self, other: "Histogram") -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total


def bin_index(value: float) -> int:
    """The index in a `Histogram`'s counts that `add(value, ...)` adds to (the engine keeps it while it adds one
    value many times; it asks once per decode phase, hence no min())."""
    if value <= _LO:
        return 0
    i = int(log10(value / _LO) * _PER_DECADE)
    return i if i < _LAST else _LAST


def percentile(values: np.ndarray, q: float) -> float | None:
    """q-th percentile (0..100) of the finite values; None when there are none."""
    v = values[np.isfinite(values)]
    return float(np.percentile(v, q)) if len(v) else None
