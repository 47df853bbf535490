"""Prefetch: while layer l computes, predict layer l+1's experts and start their page-in early.

Two depths: page-in (``--prefetch``: the predicted experts go into layer l+1's slots) and
read-ahead only (the default with the disk tier: the predicted experts that are in no host row
are read from disk into staging rows in the background, no slot changes; ``page_in=False``).

Owns: the next-layer prediction (layer l+1's own router, found by the family adapter: ``mlp.gate``,
gpt-oss ``mlp.router``; applied to layer l's experts input, as mixtral-offloading does), issuing the predicted page-ins into layer
l+1's slots within a slot budget (``Residency.prefetch``: never evicts a predicted expert, never
more than ``budget`` loads per layer per step), and filling the target's prefetch counters
(``stats.accounting.PrefetchStats``: issued, used, wasted).
Prediction happens in layer l's experts step before its own waves; the page-ins are issued after
layer l's first wave's own page-ins, so on CUDA they queue behind them on the copy stream and
overlap layer l's compute. Layer l+1 runs nothing between, so no wave of it can lose a slot.
Does not: change routing or outputs (the model's router still decides; a wrong prediction is a
wasted page-in, never a wrong result), or decide eviction (``residency``).

Legend: T tokens of a step, H hidden, k top_k, E experts, K slots.
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
    """Prefetch of one MoE layer l into the next MoE layer (``target``), on layer l's executor.

    Args:
        gate: layer l+1's router module (``models.sites.router_of``: ``mlp.gate``, gpt-oss ``mlp.router``); its ``forward``
            maps hidden [T, H] -> (logits, scores, top-k ids [T, k]).
        target: layer l+1's ``runner_contract.PagedExecutor``.
        budget: at most this many prefetch page-ins per step (default top_k: one token's worth).
        on_predict: optional ``(target_layer, experts)`` callback (trace recording).
        page_in: page the predictions into the slots (``issue``); False: a disk tier's read-ahead
            only (``take_prediction``), the slots and the device residency untouched.
    """

    def __init__(self, *, gate, target, budget: int, on_predict: Callable[[int, list[int]], None] | None = None,
                 page_in: bool = True):
        self.gate = gate
        self.target = target
        self.budget = budget
        self.page_in = page_in
        self.on_predict = on_predict
        self._pending: list[int] | None = None

    def predict_ids(self, hidden_states):
        """Layer l's experts input [T, H] -> layer l+1's predicted top-k ids [T, k] (int64, on
        the device; no sync)."""
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
        # a disk tier starts reading the predicted experts now (a full store reads nothing)
        self.target.store.read_ahead([e for e in self._pending if not self.target.is_resident(e)])
        self.target.prefetch_stats.predict_s += time.perf_counter() - t0
        if self.on_predict is not None:
            self.on_predict(self.target.layer, self._pending)

    def issue(self) -> None:
        """Page the predicted experts into layer l+1's slots (copy stream on CUDA); read-ahead
        only: forget them (the read-ahead started at ``take_prediction``)."""
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


def install(executors: dict, routers: dict, *, budget: int, page_in: bool = True) -> list[NextLayerPrefetcher]:
    """Give every paged MoE layer but the last a prefetcher into the next one.

    ``executors``: MoE layer -> its ``runner_contract.PagedExecutor``; ``routers``: MoE layer -> its
    router module (``models.sites.router_of``); ``budget`` >= 1 (checked with the rest of the
    configuration, ``loading.config``); ``page_in`` False: read-ahead only (``NextLayerPrefetcher``).
    Returns the prefetchers, in layer order.
    """
    layers = sorted(executors)
    out = []
    for here, nxt in zip(layers, layers[1:]):
        p = NextLayerPrefetcher(gate=routers[nxt], target=executors[nxt], budget=budget, page_in=page_in)
        executors[here].prefetcher = p
        out.append(p)
    return out
