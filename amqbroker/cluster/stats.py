"""Cheap latency counters for the cluster node (proposal round trips).

`LatencyHistogram` counts durations in logarithmic buckets (each 5 % wider than the
previous, from 1 µs up; anything longer than the last bucket lands in it), so its
memory is fixed whatever the number of samples and a percentile is read with at most
5 % error. Recording is one `math.log` and a list increment: cheap enough for every
grouping decision.
"""

from __future__ import annotations

import math

_BASE = 1e-6  # seconds: the first bucket's upper edge
_GROWTH = 1.05
_BUCKETS = 400  # 1 µs * 1.05**400 ≈ 300 s


class LatencyHistogram:
    __slots__ = ("counts", "max", "n", "total")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.n = 0
        self.total = 0.0
        self.max = 0.0

    def record(self, seconds: float) -> None:
        i = 0 if seconds <= _BASE else math.ceil(math.log(seconds / _BASE, _GROWTH))
        self.counts[min(i, _BUCKETS - 1)] += 1
        self.n += 1
        self.total += seconds
        self.max = max(self.max, seconds)

    def percentile(self, p: float) -> float:
        """Seconds below which `p` (0..100) percent of the samples fall (bucket edge)."""
        if self.n == 0:
            return 0.0
        rank = max(1, math.ceil(self.n * p / 100.0))
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return min(_BASE * _GROWTH**i, self.max)
        return self.max

    def summary(self) -> dict[str, float | int]:
        """count, p50/p99/max and mean in milliseconds (what `clusterStatus` shows)."""
        return {
            "count": self.n,
            "p50Ms": round(self.percentile(50) * 1000, 3),
            "p99Ms": round(self.percentile(99) * 1000, 3),
            "maxMs": round(self.max * 1000, 3),
            "meanMs": round(self.total / self.n * 1000, 3) if self.n else 0.0,
        }
