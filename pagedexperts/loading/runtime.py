"""The paging state of one model, attached as ``model.pagedexperts``.

Owns: ``PagingRuntime`` (the options as given, the ``Resolved`` record, one experts runner per
MoE layer, the sites, host stores, layouts, shared buffers and the disk tier's read-ahead; the
model-wide views of their counters) and ``runtime_of``. No module globals: several paged models
share a process. Does not: build any of it (``loading.build``, ``loading.runners``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedexperts.formats.base import ExpertLayout
from pagedexperts.loading.config import PagingConfig
from pagedexperts.loading.resolved import Resolved
from pagedexperts.models.sites import ExpertsSite
from pagedexperts.paging.runner_contract import ExpertsRunner, PagedExecutor
from pagedexperts.stats.accounting import ModelStats
from pagedexperts.stats.tiers import TierStats
from pagedexperts.storage.host_memory import HostMemoryPlan
from pagedexperts.storage.host_store import ExpertStore
from pagedexperts.storage.host_tier import ReadAhead

PREFETCH_COUNTERS = ("issued", "used", "wasted", "bytes", "predict_s", "issue_s")


@dataclass
class PagingRuntime:
    """The paging state of one model.

    Attributes:
        config: the options as given and checked (``loading.config.PagingConfig``).
        resolved: every choice resolved from them, with its reason (``loading.resolved.Resolved``).
        runners: MoE layer index -> its ``paging.runner_contract.ExpertsRunner``.
        sites: the experts sites (``models.sites.ExpertsSite``), in layer order.
        stores: site name -> the layer's host store (``storage.host_store.ExpertStore``).
        layouts: site name -> the format's ``formats.base.ExpertLayout``.
        buffers: "scratch" / "staging" -> tensor name -> tensor, shared by all layers.
        quantized_linears: ``loading.linears.QuantizedLinears``, None for a model built without a checkpoint.
        decode_graphs: ``generation.graphs.DecodeGraphs``, built on first use (None until then).
    """

    config: PagingConfig
    resolved: Resolved
    num_experts: int
    top_k: int
    runners: dict[int, ExpertsRunner] = field(default_factory=dict)
    sites: list[ExpertsSite] = field(default_factory=list, repr=False)
    stores: dict[str, ExpertStore] = field(default_factory=dict, repr=False)
    expert_format: str = "dense"  # the checkpoint's expert format (``formats``)
    layouts: dict[str, ExpertLayout] = field(default_factory=dict, repr=False)
    buffers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    quantized_linears: object = field(default=None, repr=False)  # loading.linears.QuantizedLinears (a layer above)
    read_ahead: ReadAhead | None = field(default=None, repr=False)
    decode_graphs: object | None = field(default=None, repr=False)
    # why the packed disk tier converts at page-in instead of reading a stored kernel layout
    # (``loading.stored_layout``); None: it reads one, or has no packed disk tier
    stored_layout_fallback: str | None = None

    @property
    def num_resident(self) -> int:
        """K, the slots per MoE layer (``Resolved.num_resident``)."""
        return self.resolved.num_resident

    @property
    def decide(self) -> str:
        """Where paged steps are planned, "host" or "device" (``Resolved.decide``)."""
        return self.resolved.decide

    @property
    def stored_layout(self) -> str | None:
        """The stored kernel layout's path the disk tier reads (``Resolved.stored_layout``)."""
        return self.resolved.stored_layout

    @property
    def host_memory(self) -> HostMemoryPlan:
        """The host-memory plan (``Resolved.host_memory``)."""
        return self.resolved.host_memory

    def stats(self) -> ModelStats:
        """Current counters of every MoE layer (CUDA copy times folded in first), with the
        host and disk tier counters of each layer when the disk tier is on."""
        for r in self.runners.values():
            r.collect_copy_time()
        fallbacks = sorted({r.store.fallback for r in self.runners.values() if r.store.fallback})
        fallbacks += [f"layer {i}: packed -> grouped_mm ({why})" for i, why in sorted(self.resolved.experts_fallbacks.items())]
        if self.stored_layout_fallback is not None:
            fallbacks.append(self.stored_layout_fallback)
        if self.quantized_linears is not None:
            fallbacks += [f"non-expert linears: {line}" for line in self.quantized_linears.fallback_lines()]
        tiers = {i: r.store.tier_stats for i, r in self.runners.items() if r.store.tier_stats is not None}
        return ModelStats.collect(((i, r.stats) for i, r in self.runners.items()), fallbacks, tiers=tiers)

    def reset_stats(self) -> None:
        """Zero every layer's counters, and the tier counters of a disk tier (``TierStats.carried``: its
        read-aheads held carry over)."""
        for r in self.runners.values():
            r.reset_stats()
            if r.store.tier_stats is not None:
                r.store.tier_stats = TierStats.carried(r.store.tier_stats.read_ahead_held)

    def prefetch_stats(self) -> dict:
        """Per-layer and total prefetch counters (prefetches INTO each paged layer)."""
        layers = {i: r.prefetch_stats.as_dict() for i, r in self.runners.items() if isinstance(r, PagedExecutor)}
        total = {k: sum(d[k] for d in layers.values()) for k in PREFETCH_COUNTERS}
        return dict(total=total, layers=layers)

    @property
    def expert_bytes(self) -> int:
        """Packed bytes of one expert (the unit of a page-in)."""
        return next(iter(self.runners.values())).store.expert_bytes

    @property
    def dense_expert_bytes(self) -> int:
        """Bytes of one expert dequantized (one dense slot), in the experts' dtype: the model's,
        or a W4A16 checkpoint's scales' (``ExpertFormat.experts_dtype``)."""
        return next(iter(self.layouts.values())).dense_expert_bytes


def runtime_of(model) -> PagingRuntime | None:
    """The ``PagingRuntime`` of a model loaded by ``loading.loader.load_model`` (or built by
    ``loading.build.build_paged_model``), or None for a model this package did not page."""
    return getattr(model, "pagedexperts", None)
