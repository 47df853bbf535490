"""The contracts of a paged layer's experts runners: what the dispatcher and the runtime see.

Owns: ``ExpertsRunner``, the ABC every per-layer runner implements (the layer-step executors
and the baselines): one ``step`` per MoE layer per model step, its ``LayerStats``, the trace hook
and the end-of-life hooks; and ``PagedExecutor``, the ABC of the runners that page: K slots, a
residency, page-ins outside a step (prefetch) and the wave view the independence check reads.
Two executors implement ``PagedExecutor`` side by side (DESIGN.md "Devices"):

- ``paging.host_executor.HostPlannedExecutor``: any step, any device; the top-k ids are read
  back once and the tensor-free residency plans the waves on the host.
- ``paging.device_pager.DevicePager`` (``--decide device``; CUDA, or a CPU under
  TRITON_INTERPRET=1): decide and page-in kernels keep the residency in device tensors, no
  host sync, fixed shapes (for CUDA graphs; capture is not built yet).

The baselines (``paging.baselines``: resident, offload, cpu-experts) are ``ExpertsRunner``s.
Does not: plan, copy or compute anything itself.

Legend: T tokens, H hidden, k top_k, E experts, K slots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from pagedexperts.stats.accounting import LayerStats, PrefetchStats

# (layer, top-k ids [T, k] on the host, top-k weights [T, k] on the host) -> None
TraceHook = Callable[[int, torch.Tensor, torch.Tensor], None]


class ExpertsRunner(ABC):
    """The experts of one MoE layer as transformers' dispatcher calls them.

    Args:
        layer: index of the decoder layer (stats, traces, messages).
        store: the layer's host store (``storage.host_store.ExpertStore``).
        device: where the experts are computed.
        inner: the transformers experts implementation run over the experts
            (``paging.waves.INNER_IMPLEMENTATIONS``).

    Attributes:
        stats: the layer's counters (``stats.accounting.LayerStats``).
        trace_hook: called once per step with the routing read back (tracing), or None.
        padding_count: the current model step's padding rows, a 0-dim device tensor set by the
            model's pre-hook (``integration.install_padding_hook``) and handed to ``step`` by
            the dispatcher; None: no padding.
    """

    def __init__(self, *, layer: int, store, device, inner: str) -> None:
        self.layer = layer
        self.store = store
        self.device = torch.device(device)
        self.inner = inner
        self.stats = LayerStats()
        self.trace_hook: TraceHook | None = None
        self.padding_count: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.store.num_experts

    def __call__(self, module, hidden_states, top_k_index, top_k_weights, padding_count=None) -> torch.Tensor:
        return self.step(module, hidden_states, top_k_index, top_k_weights, padding_count)

    @abstractmethod
    def step(self, module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             padding_count: torch.Tensor | None) -> torch.Tensor:
        """The experts step: hidden_states [T, H], top_k_index [T, k] (expert ids, int64),
        top_k_weights [T, k], padding rows (0-dim, or None) -> output [T, H] in
        hidden_states.dtype, equal to the unpaged model's with the same implementation."""

    def collect_copy_time(self) -> None:
        """Fold copy times measured after the step (CUDA events) into ``stats``; none here."""

    def release(self) -> None:
        """Wait for copies still in flight (before the runner is dropped); none here."""

    def reset_stats(self) -> None:
        """Zero the layer's counters (copy times in flight folded in first)."""
        self.collect_copy_time()
        self.stats = LayerStats()


class InlineRunner:
    """Marker contract of a runner whose step is the model's own device math and nothing else
    (no host read, no Python decision: ``baselines.ResidentRunner``). The dispatcher calls it
    inline, not through the opaque custom op: eager skips the op's dispatcher round trip (its
    autograd and dynamo-disable wrappers) and ``torch.compile`` traces it like the unpaged model."""


class PagedExecutor(ExpertsRunner):
    """A runner that pages: K slot tensors, a residency over them, prefetch hooks.

    Attributes (set by implementations): ``residency`` (``residency.planner.Residency`` or
    its device twin), ``slots`` (the [K, ...] slot table, ``formats.slots``), ``dequantizer``
    (``formats.slots.WaveDequantizer`` for packed slots of a quantized format, else None),
    ``prefetcher``
    (``paging.prefetch.NextLayerPrefetcher`` of the next layer, or None) and
    ``prefetch_stats`` (prefetches INTO this layer).
    """

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.dequantizer = None
        self.prefetcher = None
        self.prefetch_stats = PrefetchStats()

    @property
    def num_slots(self) -> int:
        return self.residency.num_slots

    @abstractmethod
    def copy_in(self, loads) -> None:
        """Page ``loads`` (``residency.planner.Load``) in now (a prefetch); the layer's next
        compute waits for them."""

    @abstractmethod
    def wave_view(self, module, wave_slots):
        """The experts module as the inner implementation sees it for one wave over
        ``wave_slots``: the slot tensors (dequantized for packed slots of a quantized format)."""
