"""Prefetch: while layer l computes, predict layer l+1's experts and start their page-in early.

Owns: the next-layer prediction (layer l+1's own router, found by the family adapter: ``mlp.gate``,
gpt-oss ``mlp.router``; applied to layer l's experts input, as mixtral-offloading does), issuing the predicted page-ins into layer
l+1's slots within a slot budget (``Residency.prefetch``: never evicts a predicted expert, never
more than ``budget`` loads per layer per step), and the prefetch counters (issued, used, wasted).
Prediction happens in layer l's experts step before its own waves; the page-ins are issued after
layer l's first wave's own page-ins, so on CUDA they queue behind them on the copy stream and
overlap layer l's compute. Layer l+1 runs nothing between, so no wave of it can lose a slot.
Does not: change routing or outputs (the model's router still decides; a wrong prediction is a
wasted page-in, never a wrong result), or decide eviction (``residency``).

Legend: T tokens of a step, H hidden, k top_k, E experts, K slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

PREFETCH_EXTRA = "prefetch"  # trace extra: the predicted experts of a layer, priority order


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


def prediction_order(ids: Sequence[Sequence[int]]) -> list[int]:
    """Predicted top-k ids [T, k] -> distinct experts, most tokens first, then lower id."""
    counts: dict[int, int] = {}
    for row in ids:
        for e in row:
            counts[e] = counts.get(e, 0) + 1
    return sorted(counts, key=lambda e: (-counts[e], e))


class NextLayerPrefetcher:
    """Prefetch of one MoE layer l into the next MoE layer (``target``), on layer l's pager.

    Args:
        gate: layer l+1's router module (``models.router_of``: ``mlp.gate``, gpt-oss ``mlp.router``); its ``forward``
            maps hidden [T, H] -> (logits, scores, top-k ids [T, k]).
        target: layer l+1's ``ExpertPager``.
        budget: at most this many prefetch page-ins per step (default top_k: one token's worth).
        on_predict: optional ``(target_layer, experts)`` callback (trace recording).
    """

    def __init__(self, *, gate, target, budget: int, on_predict: Callable[[int, list[int]], None] | None = None):
        self.gate = gate
        self.target = target
        self.budget = budget
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
        read_ahead = getattr(self.target.store, "read_ahead", None)  # disk tier: start disk reads now
        if read_ahead is not None:
            read_ahead([e for e in self._pending if e not in self.target.residency.slot_of_expert])
        self.target.prefetch_stats.predict_s += time.perf_counter() - t0
        if self.on_predict is not None:
            self.on_predict(self.target.layer, self._pending)

    def issue(self) -> None:
        """Page the predicted experts into layer l+1's slots (copy stream on CUDA)."""
        if self._pending is None:
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


def install(model, *, budget: int | None = None) -> list[NextLayerPrefetcher]:
    """Give every MoE layer but the last a prefetcher into the next MoE layer.

    Raises:
        ValueError: budget < 1 (``--prefetch-budget``).
    """
    rt = model.pagedexperts
    budget = rt.top_k if budget is None else budget
    if budget < 1:
        raise ValueError(f"prefetch budget {budget} must be >= 1 (--prefetch-budget)")
    from pagedexperts.models.sites import router_of

    sites = {s.layer: s for s in rt.sites}
    layers = sorted(rt.pagers)
    out = []
    for here, nxt in zip(layers, layers[1:]):
        gate = router_of(model, sites[nxt])
        p = NextLayerPrefetcher(gate=gate, target=rt.pagers[nxt], budget=budget)
        rt.pagers[here].prefetcher = p
        out.append(p)
    return out


def record_predictions(model, recorder) -> None:
    """Write each prediction into ``recorder.writer`` (looked up per call) as the trace extra
    PREFETCH_EXTRA of the predicted layer, so the simulator can replay the prefetches."""
    for pager in model.pagedexperts.pagers.values():
        p = getattr(pager, "prefetcher", None)
        if p is not None:
            p.on_predict = lambda layer, experts, rec=recorder: rec.writer.add_extra(
                layer=layer, name=PREFETCH_EXTRA, values=experts)


def model_prefetch_stats(model) -> dict:
    """Per-layer and total prefetch counters of a paged model."""
    layers = {i: p.prefetch_stats.as_dict() for i, p in model.pagedexperts.pagers.items()}
    total = {k: sum(d[k] for d in layers.values()) for k in ("issued", "used", "wasted", "bytes", "predict_s", "issue_s")}
    return dict(total=total, layers=layers)
