"""The contracts of a paged layer's experts runners: ``ExpertsRunner`` (every per-layer runner) and
``PagedExecutor`` (the runners that page). docs/design.md "Executors". Builds nothing
(``loading.runners``).
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
    """The experts of one MoE layer as transformers' dispatcher calls them: one ``step`` per model
    step.

    ``inline``: the step is the model's own device math only, so it is called inline under
    ``torch.compile`` (others run as one opaque custom op); ``decide``: "host" or "device";
    ``trace_hook``: called with each step's routing, or None; ``padding_count``: the model step's
    padding rows (0-dim device tensor, ``integration.install_padding_hook``) or None."""

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
        """The inner experts implementation; settable, ValueError for one without a body on this path."""
        return self._inner

    @inner.setter
    def inner(self, name: str) -> None:
        problem = inner_problem(name, decide=self.decide)
        if problem is not None:
            raise ValueError(problem)
        self._inner = name
        self._inner_set(name)

    def _inner_set(self, name: str) -> None:
        """Hook called when ``inner`` is set (checked); nothing here."""

    @abstractmethod
    def step(self, module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             padding_count: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H], [T, k] int64 ids, [T, k] weights, padding (0-dim or None) -> [T, H] in
        hidden_states.dtype, equal to the unpaged model's."""

    def capture_problem(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why a CUDA graph cannot hold the step in ``dtype`` on ``device``, or None; here: it reads
        ids back."""
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
    """A runner that pages: K slots (``setup``'s table, or the plain one), a ``residency``, a ``body``
    (``paging.steps.contract.LayerStep``, rebuilt when ``inner`` is set), ``prefetcher`` and
    ``prefetch_stats``."""

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
        """Page ``loads`` in now (a prefetch); the layer's next compute waits for them."""

    def wave_view(self, module, wave_slots):
        """The experts module as the body's kernels see it once ``wave_slots`` are paged in."""
        return self.body.wave_view(module, wave_slots)
