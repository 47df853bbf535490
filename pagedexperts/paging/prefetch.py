"""Prefetch: while layer l computes, predict layer l+1's experts with its own router and page them in
early (``--prefetch``), or with the disk tier only read them ahead (``page_in=False``).
docs/design-layer-step.md "Prefetch". A wrong prediction wastes a page-in, never changes a result.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence


def prediction_order(ids: Sequence[Sequence[int]]) -> list[int]:
    """Predicted top-k ids [T, k] -> distinct experts, most tokens first, then lower id."""
    counts: dict[int, int] = {}
    for row in ids:
        for e in row:
            counts[e] = counts.get(e, 0) + 1
    return sorted(counts, key=lambda e: (-counts[e], e))


class NextLayerPrefetcher:
    """Prefetch from MoE layer l into the next layer's executor ``target`` through its router ``gate``,
    at most ``budget`` page-ins per step; ``page_in`` False: read-ahead only; ``read_ahead`` False: a
    disk tier reads nothing ahead (--no-read-ahead)."""

    def __init__(self, *, gate, target, budget: int, on_predict: Callable[[int, list[int]], None] | None = None,
                 page_in: bool = True, read_ahead: bool = True):
        self.gate = gate
        self.target = target
        self.budget = budget
        self.page_in = page_in
        self.read_ahead = read_ahead
        self.on_predict = on_predict
        self._pending: list[int] | None = None

    def predict_ids(self, hidden_states):
        """Layer l's experts input [T, H] -> layer l+1's predicted ids [T, k] (int64, device; no sync)."""
        import torch

        t0 = time.perf_counter()
        with torch.no_grad():
            ids = self.gate.forward(hidden_states)[2]
        self.target.prefetch_stats.predict_s += time.perf_counter() - t0
        return ids

    def take_prediction(self, ids_host) -> None:
        """Predicted ids [T, k] read back to the host -> the predicted experts (until issue)."""
        t0 = time.perf_counter()
        self._pending = prediction_order(ids_host.tolist())
        if self.read_ahead:  # a disk tier starts reading the predicted experts now (a full store reads nothing)
            self.target.store.read_ahead([e for e in self._pending if not self.target.is_resident(e)])
        self.target.prefetch_stats.predict_s += time.perf_counter() - t0
        if self.on_predict is not None:
            self.on_predict(self.target.layer, self._pending)

    def issue(self) -> None:
        """Page the predicted experts into layer l+1's slots; read-ahead only: forget them."""
        if self._pending is None or not self.page_in:
            self._pending = None
            return
        t0 = time.perf_counter()
        target, stats = self.target, self.target.prefetch_stats
        loads = target.residency.prefetch(self._pending, budget=self.budget)
        self._pending = None
        if loads:
            target.copy_in(loads)  # copy stream on CUDA, ordered by ``transfer``
        stats.issued += len(loads)
        stats.bytes += len(loads) * target.store.expert_bytes
        stats.pending.update(load.expert for load in loads)
        stats.issue_s += time.perf_counter() - t0


def install(executors: dict, routers: dict, *, budget: int, page_in: bool = True,
            read_ahead: bool = True) -> list[NextLayerPrefetcher]:
    """A prefetcher on every paged MoE layer but the last (``executors`` and ``routers`` by MoE layer)."""
    layers = sorted(executors)
    out = []
    for here, nxt in zip(layers, layers[1:]):
        p = NextLayerPrefetcher(gate=routers[nxt], target=executors[nxt], budget=budget, page_in=page_in,
                                read_ahead=read_ahead)
        executors[here].prefetcher = p
        out.append(p)
    return out
