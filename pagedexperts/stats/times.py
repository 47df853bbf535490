"""Time distributions of the paging stats, and the one quantile definition (standard library only).

Owns: ``TimeDistribution`` (a window of recent samples for p50/p99, cumulative histogram buckets
with Prometheus semantics since the start) and ``nearest_rank``, the quantile every counter of
the package uses (host times here, disk read times in ``stats.tiers``). Does not: count hits or
misses (``stats.accounting``) or format metrics (the server does).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (q in [0, 1]) of the sorted, non-empty ``ordered`` by the nearest-rank
    method: the value at 1-based rank ceil(q x n), clamped to [1, n] (Hyndman & Fan type 1)."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


WINDOW = 1024  # most recent samples per layer and kind that p50/p99 are taken over
# Histogram upper bounds in seconds (``le``), 1 us to 1 s; the +Inf bucket is implicit.
TIME_BUCKETS_S = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
                  1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)


@dataclass
class TimeDistribution:
    """Samples of one time (seconds): the last ``WINDOW`` for quantiles, and since the start
    the count, sum and per-bucket counts over ``TIME_BUCKETS_S`` (``buckets[i]``: samples in
    (bound[i-1], bound[i]], the last entry above the largest bound)."""

    window: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    buckets: list[int] = field(default_factory=lambda: [0] * (len(TIME_BUCKETS_S) + 1))
    count: int = 0
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.window.append(seconds)
        self.buckets[bisect.bisect_left(TIME_BUCKETS_S, seconds)] += 1
        self.count += 1
        self.sum_s += seconds

    def merge(self, other: "TimeDistribution") -> None:
        """Add ``other``'s samples (its window is appended: the merged window spans both)."""
        self.window = deque([*self.window, *other.window], maxlen=max(WINDOW, len(self.window) + len(other.window)))
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets)]
        self.count += other.count
        self.sum_s += other.sum_s

    def quantiles(self, *qs: float) -> list[float]:
        """The ``qs`` quantiles (each in [0, 1]) of the window, nearest rank; NaN when empty."""
        if not self.window:
            return [math.nan] * len(qs)
        ordered = sorted(self.window)
        return [nearest_rank(ordered, q) for q in qs]

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus histogram buckets: (``le`` bound as text, samples <= bound), +Inf last."""
        out, total = [], 0
        for bound, n in zip((*map(repr, TIME_BUCKETS_S), "+Inf"), self.buckets):
            total += n
            out.append((bound, total))
        return out

    def summary(self) -> dict:
        """p50 and p99 of the window and the sample count since the start (seconds)."""
        p50, p99 = self.quantiles(0.5, 0.99)
        return {"p50": p50, "p99": p99, "count": self.count}
