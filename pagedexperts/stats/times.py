"""The one quantile definition of the paging stats (standard library only): ``nearest_rank``."""

from __future__ import annotations

import math
from typing import Sequence


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (q in [0, 1]) of the sorted, non-empty ``ordered`` by the nearest-rank
    method: the value at 1-based rank ceil(q x n), clamped to [1, n] (Hyndman & Fan type 1)."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
