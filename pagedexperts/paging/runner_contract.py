"""The contracts of a paged layer's experts runners: what the dispatcher and the runtime see.

Owns: ``ExpertsRunner``, the ABC every per-layer runner implements (the layer-step executors
and the baselines): one ``step`` per MoE layer per model step, its ``LayerStats``, the trace hook,
the end-of-life hooks and two capabilities the callers ask instead of the runner's type:
``inline`` (how the dispatcher calls the step under ``torch.compile``) and ``capture_problem``
(whether a CUDA graph can hold the step); and ``PagedExecutor``, the ABC of the runners that
page: K slots, a residency (``is_resident``), page-ins outside a step (prefetch), and the body
that computes the experts (a ``paging.steps.contract.LayerStep``, built from the layer's
``SlotSetup`` for the inner implementation: ``body``). Two executors implement
``PagedExecutor`` side by side (docs/design.md "Executors"), each holding a body of its path
(``paging.steps.table``):

- ``paging.host_executor.HostExecutor``: any step, any device; the top-k ids are read back
  once and the tensor-free residency plans the waves on the host.
- ``paging.device_executor.DeviceExecutor`` (``--decide device``; CUDA, or a CPU under
  TRITON_INTERPRET=1): decide and page-in kernels keep the residency in device tensors, no
  host sync, fixed shapes: decode steps are captured in CUDA graphs (``generation.graphs``).

The baselines (``paging.baselines``: resident, offload, cpu-experts) are ``ExpertsRunner``s.
Does not: plan, copy or compute anything itself; build runners (``loading.runners``, the
builders of what this module declares).

Legend: T tokens, H hidden, k top_k, E experts, K slots.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Callable

import torch

from pagedexperts.formats.slots import allocate
from pagedexperts.paging.steps.contract import LayerStep, PackedSlots, SlotSetup
from pagedexperts.paging.steps.table import body_for, inner_problem
from pagedexperts.stats.accounting import LayerStats, PrefetchStats

# (layer, top-k ids [T, k] on the host, top-k weights [T, k] on the host) -> None
TraceHook = Callable[[int, torch.Tensor, torch.Tensor], None]


class ExpertsRunner(ABC):
    """The experts of one MoE layer as transformers' dispatcher calls them.

    Args:
        layer: index of the decoder layer (stats, traces, messages).
        store: the layer's host store (``storage.host_store.ExpertStore``).
        device: where the experts are computed.
        inner: the experts implementation run over the experts
            (``paging.steps.table.INNER_IMPLEMENTATIONS``; checked when set, ``inner``).

    Attributes:
        inline: the step is the model's own device math and nothing else (no host read, no
            Python decision: ``baselines.ResidentRunner``): the dispatcher calls it inline under
            ``torch.compile`` too, so the compiler traces it like the unpaged model; other
            runners run there as one opaque custom op (``integration``). False here.
        decide: where this runner's steps are planned, "host" or "device": the inner
            implementations it accepts are those with a body there (``paging.steps.table``).
        stats: the layer's counters (``stats.accounting.LayerStats``).
        trace_hook: called once per step with the routing read back (tracing), or None.
        padding_count: the current model step's padding rows, a 0-dim device tensor set by the
            model's pre-hook (``integration.install_padding_hook``) and handed to ``step`` by
            the dispatcher; None: no padding.
    """

    inline = False
    decide = "host"

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

    @property
    def inner(self) -> str:
        """The inner experts implementation; settable (transformers' decode switch sets it).

        Raises:
            ValueError: on setting one without a body where this runner plans
                (``paging.steps.table.inner_problem``: names the choices and the flag).
        """
        return self._inner

    @inner.setter
    def inner(self, name: str) -> None:
        problem = inner_problem(name, decide=self.decide)
        if problem is not None:
            raise ValueError(problem)
        self._inner = name
        self._inner_set(name)

    def _inner_set(self, name: str) -> None:
        """Called when ``inner`` is set (checked): nothing here."""

    @abstractmethod
    def step(self, module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             padding_count: torch.Tensor | None = None) -> torch.Tensor:
        """The experts step: hidden_states [T, H], top_k_index [T, k] (expert ids, int64),
        top_k_weights [T, k], padding rows (0-dim, or None) -> output [T, H] in
        hidden_states.dtype, equal to the unpaged model's with the same implementation."""

    def capture_problem(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why this runner's step, in ``dtype`` on ``device``, cannot be captured in a CUDA
        graph (it reads the device back or builds tensors from host values), or None when it
        can. The inner kernel's own limits are ``generation.graphs``' to judge. Here: the step
        reads its top-k ids back to the host."""
        return f"{type(self).__name__} reads the step back to the host (needs --decide device or mode resident)"

    def collect_copy_time(self) -> None:
        """Fold copy times measured after the step (CUDA events) into ``stats``; none here."""

    def release(self) -> None:
        """Wait for copies still in flight (before the runner is dropped); none here."""

    def reset_stats(self) -> None:
        """Zero the layer's counters (copy times in flight folded in first)."""
        self.collect_copy_time()
        self.stats = LayerStats()


class PagedExecutor(ExpertsRunner):
    """A runner that pages: K slot tensors, a residency over them, a body, prefetch hooks.

    Args (beyond ``ExpertsRunner``'s):
        num_slots: K (its range is the residency's to check).
        setup: the layer's ``paging.steps.contract.SlotSetup`` (its slot table, a
            ``formats.slots.SlotTable``, says how its kernel reads it); None, or None slots: the
            plain table (``PackedSlots``) allocated like the store's tensors.

    Attributes: ``setup``; ``slots`` (its slot table); ``body`` (the
    ``paging.steps.contract.LayerStep`` of ``inner`` on this executor's path, rebuilt over the
    same setup when ``inner`` is set); ``residency`` (set by implementations:
    ``residency.planner.Residency`` or its device twin); ``prefetcher``
    (``paging.prefetch.NextLayerPrefetcher`` of the next layer, or None) and ``prefetch_stats``
    (prefetches INTO this layer).
    """

    def __init__(self, *, num_slots: int, setup: SlotSetup | None = None, **kw) -> None:
        store, setup = kw["store"], setup or SlotSetup()
        slots = setup.slots if setup.slots is not None else PackedSlots(allocate(store.specs, num_slots, kw["device"]))
        self.setup = dataclasses.replace(setup, slots=slots, store=store)
        self.slots = self.setup.slots
        super().__init__(**kw)
        self.prefetcher = None
        self.prefetch_stats = PrefetchStats()

    def _inner_set(self, name: str) -> None:
        """Build ``inner``'s body for this executor's path over the layer's setup."""
        self.body: LayerStep = body_for(name, self.decide)(self.setup)

    @property
    def num_slots(self) -> int:
        return self.residency.num_slots

    @abstractmethod
    def is_resident(self, expert: int) -> bool:
        """Whether ``expert`` holds a slot now (a disk tier starts reading only the others)."""

    @abstractmethod
    def copy_in(self, loads) -> None:
        """Page ``loads`` (``residency.planner.Load``) in now (a prefetch); the layer's next
        compute waits for them."""

    def wave_view(self, module, wave_slots):
        """The experts module as the body's kernels see it once ``wave_slots`` are paged in
        (``paging.steps.contract.LayerStep.wave_view``; the independence check reads it)."""
        return self.body.wave_view(module, wave_slots)
