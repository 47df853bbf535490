"""The paging state of one model, attached as ``model.pagedexperts``: one object per model.

Owns: ``PagingRuntime``, everything a paged model holds beyond its modules: the validated
``PagingConfig``, one runner per MoE layer (``pagers``: executors or baselines), the experts
sites, the host stores, the format's layouts, the shared scratch and staging buffers, the host
memory plan and the disk tier's read-ahead; and the model-wide views of their counters
(``stats``, ``reset_stats``, ``prefetch_stats``). No module globals: several paged models
share a process. Does not: build any of it (``loading.build``, ``loading.runners``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedexperts.loading.config import PagingConfig
from pagedexperts.paging.runner import PagedExecutor
from pagedexperts.stats.accounting import ModelStats
from pagedexperts.stats.tiers import TierStats
from pagedexperts.storage.host_memory import HostMemoryPlan
from pagedexperts.storage.host_tier import ReadAhead

PREFETCH_COUNTERS = ("issued", "used", "wasted", "bytes", "predict_s", "issue_s")


@dataclass
class PagingRuntime:
    """The paging state of one model: its runners (one per MoE layer) and its config."""

    config: PagingConfig
    num_experts: int
    top_k: int
    num_resident: int
    pagers: dict = field(default_factory=dict)  # MoE layer -> paging.runner.ExpertsRunner
    sites: list = field(default_factory=list, repr=False)
    stores: dict = field(default_factory=dict, repr=False)  # site name -> storage.host_store.ExpertStore
    expert_format: str = "dense"  # the checkpoint's expert format (pagedexperts.formats)
    layouts: dict = field(default_factory=dict, repr=False)  # site name -> ExpertLayout
    buffers: dict = field(default_factory=dict, repr=False)  # shared dense scratch / packed staging
    host_memory: HostMemoryPlan | None = None
    # quantized non-expert modules dequantized at load (``loading.linears.DequantizedLinears``; None: none)
    dequantized_linears: object = field(default=None, repr=False)
    read_ahead: ReadAhead | None = field(default=None, repr=False)
    decide: str = "host"  # where paged steps are planned: config.decide resolved ("host" or "device")
    # decode steps in CUDA graphs: config.cuda_graphs resolved ("cuda", "eager" or "off") and why off
    cuda_graphs: str = "off"
    cuda_graphs_reason: str | None = None
    # the decode graphs (``generation.graphs.DecodeGraphs``), built on first use; its captures
    # check the runners they hold against ``pagers`` (a repage invalidates them)
    decode_graphs: object = field(default=None, repr=False)

    def stats(self) -> ModelStats:
        """Current counters of every MoE layer (CUDA copy times folded in first), with the
        host and disk tier counters of each layer when the disk tier is on."""
        for p in self.pagers.values():
            p.collect_copy_time()
        fallbacks = sorted({p.store.fallback for p in self.pagers.values() if p.store.fallback})
        tiers = {i: p.store.tier_stats for i, p in self.pagers.items() if p.store.tier_stats is not None}
        return ModelStats.collect(((i, p.stats) for i, p in self.pagers.items()), fallbacks, tiers=tiers)

    def reset_stats(self) -> None:
        """Zero every layer's counters, and the tier counters of a disk tier."""
        for p in self.pagers.values():
            p.reset_stats()
            if p.store.tier_stats is not None:
                p.store.tier_stats = TierStats()

    def prefetch_stats(self) -> dict:
        """Per-layer and total prefetch counters (prefetches INTO each paged layer)."""
        layers = {i: p.prefetch_stats.as_dict() for i, p in self.pagers.items() if isinstance(p, PagedExecutor)}
        total = {k: sum(d[k] for d in layers.values()) for k in PREFETCH_COUNTERS}
        return dict(total=total, layers=layers)

    @property
    def expert_bytes(self) -> int:
        """Packed bytes of one expert (the unit of a page-in)."""
        return next(iter(self.pagers.values())).store.expert_bytes

    @property
    def dense_expert_bytes(self) -> int:
        """Bytes of one expert dequantized (one dense slot), in the experts' dtype: the model's,
        or a W4A16 checkpoint's scales' (``ExpertFormat.experts_dtype``)."""
        return next(iter(self.layouts.values())).dense_expert_bytes
