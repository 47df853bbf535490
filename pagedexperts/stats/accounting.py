"""Paging accounting, defined once: the runtime, the simulator and the server all count here.

Owns: per-layer counters (hits, misses, bytes paged, page-in seconds, waves, union size), their
totals and rates, the host times of each layer-step as distributions (``TimeDistribution``) and
the prefetch counters (``PrefetchStats``). A hit or a miss is counted per distinct routed expert
per MoE layer per step (docs/design.md "Terms"); padding tokens are counted apart
(``padding_tokens``), not in ``tokens``. Standard library only. Does not: decide residency,
move bytes, or format metrics.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Iterable, Sequence

from pagedexperts.stats.tiers import TierStats
from pagedexperts.stats.times import nearest_rank

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


TIMED = {"plan_s": "host planning (union, wave plan, slot map)", "sync_s": "top-k read-back",
         "page_in_s": "page-in copies"}  # the LayerStats sums that also keep a distribution


@dataclass
class LayerStats:
    """Counters of one MoE layer; all counts are sums over recorded steps.

    Units: bytes (``bytes_paged``), seconds (``page_in_s``, ``plan_s``, ``sync_s``).
    ``plan_s`` is the host bookkeeping time (union, wave plan, slot map), ``sync_s`` the read of
    the top-k ids (the one sync per layer per step of host-side planning).
    """

    steps: int = 0
    tokens: int = 0
    padding_tokens: int = 0
    hits: int = 0
    misses: int = 0
    page_ins: int = 0
    bytes_paged: int = 0
    page_in_s: float = 0.0
    plan_s: float = 0.0
    sync_s: float = 0.0
    waves: int = 0
    multi_wave_steps: int = 0
    union_last: int = 0
    union_sum: int = 0
    union_max: int = 0
    host_syncs: int = 0  # device-to-host reads the runtime made (host-planned: the top-k read-back)
    # --beyond-k in-place: misses read in place from the host store (not paged in: misses = page_ins + these)
    in_place_rows: int = 0
    in_place_bytes: int = 0
    # page-ins a CPU slot serves by reading the host row in place: no bytes copied (in page_ins too)
    zero_copy_page_ins: int = 0
    # per layer-step distributions of plan_s, sync_s and page_in_s (TIMED); not counters
    times: dict[str, TimeDistribution] = field(
        default_factory=lambda: {name: TimeDistribution() for name in TIMED}, repr=False, compare=False)

    def record_step(
        self,
        *,
        hits: int,
        misses: int,
        waves: int,
        tokens: int,
        expert_bytes: int,
        page_in_s: float = 0.0,
        plan_s: float = 0.0,
        sync_s: float = 0.0,
        padding_tokens: int = 0,
        bytes_paged: int | None = None,
        host_syncs: int = 0,
        zero_copy: int = 0,
    ) -> None:
        """Add one step of one layer. ``expert_bytes``: bytes of one expert's tensors;
        ``bytes_paged`` overrides misses x expert_bytes (the offload baseline copies all E);
        ``zero_copy``: of the misses, page-ins read in place (``zero_copy_page_ins``).
        A step with a plan or read-back time is a timed one (the runtime's; the simulator times
        nothing): its times go into the distributions, the page-in time only if it paged in."""
        union = hits + misses
        self.steps += 1
        self.tokens += tokens
        self.padding_tokens += padding_tokens
        self.hits += hits
        self.misses += misses
        self.page_ins += misses
        self.zero_copy_page_ins += zero_copy
        self.bytes_paged += misses * expert_bytes if bytes_paged is None else bytes_paged
        self.page_in_s += page_in_s
        self.plan_s += plan_s
        self.sync_s += sync_s
        self.waves += waves
        self.multi_wave_steps += int(waves > 1)
        self.union_last = union
        self.union_sum += union
        self.union_max = max(self.union_max, union)
        self.host_syncs += host_syncs
        if plan_s or sync_s:
            self.times["plan_s"].observe(plan_s)
            self.times["sync_s"].observe(sync_s)
            if page_in_s:
                self.times["page_in_s"].observe(page_in_s)

    def add_page_in_s(self, seconds: Iterable[float]) -> None:
        """Page-in times measured after the step (CUDA events): into the sum and distribution."""
        for value in seconds:
            self.page_in_s += value
            self.times["page_in_s"].observe(value)

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before any access."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else 0.0

    @property
    def union_mean(self) -> float:
        return self.union_sum / self.steps if self.steps else 0.0

    @property
    def waves_per_step(self) -> float:
        return self.waves / self.steps if self.steps else 0.0

    def merge(self, other: "LayerStats") -> None:
        """Add ``other``'s counters to these (``union_last`` and ``union_max`` take the max)
        and its time samples to these distributions."""
        for f in fields(self):
            name = f.name
            if name == "times":
                for kind, dist in other.times.items():
                    self.times[kind].merge(dist)
            elif name == "union_max" or name == "union_last":
                setattr(self, name, max(getattr(self, name), getattr(other, name)))
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def time_summary(self) -> dict:
        """{"plan_s": {"p50", "p99", "count"}, "sync_s": ..., "page_in_s": ...} (seconds)."""
        return {kind: dist.summary() for kind, dist in self.times.items()}

    def as_dict(self, *, times: bool = True) -> dict:
        """Counters and rates; with ``times``, also p50/p99 of the time windows (a sort each)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "times"}
        d.update(
            hit_rate=self.hit_rate,
            misses_per_token=self.misses_per_token,
            union_mean=self.union_mean,
            waves_per_step=self.waves_per_step,
        )
        if times:
            d["times"] = self.time_summary()
        return d


@dataclass
class ModelStats:
    """Per-layer stats of a whole model plus totals; ``tokens`` counts model steps' tokens once.

    ``layers`` maps a MoE layer index to its ``LayerStats``. Rates that are "per token" divide
    sums over layers by the tokens the model processed (each token passes every MoE layer), so
    ``misses_per_token`` is misses across all layers per token, and ``bytes_per_token`` is the
    bytes paged per token.
    """

    layers: dict[int, LayerStats] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    # disk tier on: MoE layer -> its host/disk counters (``stats.tiers.TierStats``)
    tiers: dict = field(default_factory=dict)

    @classmethod
    def collect(cls, per_layer: Iterable[tuple[int, LayerStats]], fallbacks=(), tiers=None) -> "ModelStats":
        return cls(layers=dict(per_layer), fallbacks=list(fallbacks), tiers=dict(tiers or {}))

    def tier_totals(self) -> dict:
        """Host and disk tier counters summed over layers (``TierStats.as_dict`` keys, all
        zero without a disk tier), plus ``disk_bytes_per_token``."""
        totals = TierStats()
        for t in self.tiers.values():
            totals.merge(t)
        d = totals.as_dict()
        d["disk_tier"] = bool(self.tiers)
        d["disk_bytes_per_token"] = d["disk_bytes_read"] / self.tokens if self.tokens else 0.0
        return d

    def total(self) -> LayerStats:
        out = LayerStats()
        for s in self.layers.values():
            out.merge(s)
        return out

    @property
    def tokens(self) -> int:
        return max((s.tokens for s in self.layers.values()), default=0)

    def as_dict(self, *, times: bool = True) -> dict:
        """Totals, rates and per-layer dicts. ``times``: p50/p99 of plan, read-back and page-in
        per layer-step (all layers' windows together under "times", each layer's in its dict)."""
        tot = self.total()
        tokens = self.tokens
        return {
            "tokens": tokens,
            "layer_steps": tot.steps,
            "hits": tot.hits,
            "misses": tot.misses,
            "hit_rate": tot.hit_rate,
            "misses_per_token": tot.misses / tokens if tokens else 0.0,
            "bytes_paged": tot.bytes_paged,
            "bytes_per_token": tot.bytes_paged / tokens if tokens else 0.0,
            "page_ins": tot.page_ins,
            "zero_copy_page_ins": tot.zero_copy_page_ins,
            "in_place_rows": tot.in_place_rows,
            "in_place_bytes": tot.in_place_bytes,
            "in_place_rows_per_token": tot.in_place_rows / tokens if tokens else 0.0,
            "in_place_bytes_per_token": tot.in_place_bytes / tokens if tokens else 0.0,
            "page_in_s": tot.page_in_s,
            "plan_s": tot.plan_s,
            "sync_s": tot.sync_s,
            "waves": tot.waves,
            "multi_wave_steps": tot.multi_wave_steps,
            "union_mean": tot.union_sum / tot.steps if tot.steps else 0.0,
            "union_max": tot.union_max,
            "host_syncs": tot.host_syncs,
            "host_syncs_per_token": tot.host_syncs / tokens if tokens else 0.0,
            "fallbacks": list(self.fallbacks),
            **self.tier_totals(),
            **({"times": tot.time_summary()} if times else {}),
            "layers": {str(i): s.as_dict(times=times) for i, s in sorted(self.layers.items())},
        }

    def time_histograms(self) -> dict[str, TimeDistribution]:
        """All layers' time distributions merged, by kind (``TIMED``): for /metrics histograms."""
        return self.total().times


@dataclass
class PrefetchStats:
    """Prefetch counters of one layer (the layer the experts were prefetched INTO).

    ``issued``: page-ins made by prefetch; ``used``: of those, experts the next step routed to
    (they count as hits in ``LayerStats``); ``wasted`` = issued - used. ``bytes`` = issued x
    expert bytes (not in ``LayerStats.bytes_paged``). ``predict_s``: host time of the prediction
    (router matmul + top-k, and ordering the read-back ids), ``issue_s``: of planning and issuing the copies.
    """

    issued: int = 0
    used: int = 0
    bytes: int = 0
    predict_s: float = 0.0
    issue_s: float = 0.0
    pending: set = field(default_factory=set)  # prefetched, not yet seen by a step

    @property
    def wasted(self) -> int:
        return self.issued - self.used - len(self.pending)

    def observe(self, union: Sequence[int]) -> None:
        """A step of this layer routes to ``union``: settle the pending prefetches."""
        self.used += len(self.pending.intersection(union))
        self.pending.clear()

    def as_dict(self) -> dict:
        return dict(issued=self.issued, used=self.used, wasted=self.wasted, bytes=self.bytes,
                    predict_s=self.predict_s, issue_s=self.issue_s)
