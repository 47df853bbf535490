"""The host-planned layer-step executor: one MoE layer's K device slots, residency and waves.

Owns: the [K, ...] slot tensors of one MoE layer on the device, its ``Residency`` (policy and
slot map), its host store, and the experts step of docs/design.md "The layer-step" (steps 2-6), read top-down in
``step``: read the top-k ids to the host (``transfer.read_step``), plan waves
(``residency.planner``), page each wave in (``transfer.SlotTransfers.page_in``), compute it with
the model's own experts implementation over the slot tensors (the wave-compute contract:
the inner implementation's host step, ``paging.inner``, ``paging.waves``), combine; stats and tracing at the edges. The device-planned
executor (``paging.device_executor``) implements the same ``runner.PagedExecutor`` contract
through the same wave-compute contract. Does not: route (the model's router runs unchanged),
load checkpoints (``loading``), know the architecture (``models``), or order copies
(``transfer``).

Syncs. A layer-step makes exactly one device-to-host transfer (``transfer.read_step``: the
top-k ids, the next layer's prefetch prediction and the step's padding count together); the
slot map lives on the device and is re-uploaded from pinned memory only when it changed, and a
multi-wave step's rows per wave are computed on the host from the read-back ids and uploaded.
``tests/test_syncs.py`` counts this by instrumentation.

Exactness. Each wave's entries are computed by ``waves`` with the model's own experts math over
the slot tensors, every kernel handed the unpaged model's row order and buffer shape, and
combined in the implementation's own order: paged output is bit-identical to the unpaged model
with the same implementation (docs/exactness.md).

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T * k entries.
"""

from __future__ import annotations

import time

import torch

from pagedexperts.formats.slots import PackedSlots, allocate
from pagedexperts.paging.runner import PagedExecutor
from pagedexperts.paging.transfer import SlotTransfers, StepRead, read_step
from pagedexperts.paging.waves import SlotView
from pagedexperts.residency.eviction import EvictionPolicy
from pagedexperts.residency.planner import Residency, StepPlan


class HostExecutor(PagedExecutor):
    """Paged experts of one MoE layer, planned on the host (any step, any device).

    Args:
        layer: index of the decoder layer (for stats and traces).
        store: the layer's host store ([E, ...] rows; ``storage.host_store.ExpertStore``).
        num_slots: K, 1 <= K <= E (checked by ``Residency``).
        device: where the slot tensors live and the experts are computed.
        inner: name of the experts implementation used on the slots
            (``inner.INNER_IMPLEMENTATIONS``).
        policy: eviction policy over K slots; None: the ``Residency`` default, LFU with aging
            (``--policy``'s default, ``residency.policies.DEFAULT_POLICY``).
        copy_stream: CUDA stream for page-ins (None on CPU).
        slots: the [K, ...] slot table, when a quantized format needs one other than the
            store's packed tensors (``formats.slots.DenseSlots``); None = allocate them like
            the store's tensors (``formats.slots.PackedSlots``).
        dequantizer: for packed slots of a quantized format, turns each wave's slots into
            dense tensors (``formats.slots.WaveDequantizer``); None = the slots are dense.
    """

    def __init__(self, *, layer: int, store, num_slots: int, device, inner: str,
                 policy: EvictionPolicy | None = None, copy_stream: "torch.cuda.Stream | None" = None,
                 slots=None, dequantizer=None) -> None:
        super().__init__(layer=layer, store=store, device=device, inner=inner)
        self.residency = Residency(store.num_experts, num_slots, policy)
        self.copy_stream = copy_stream
        self.slots = slots if slots is not None else PackedSlots(allocate(store.specs, num_slots, self.device))
        self.transfers = SlotTransfers(self.slots, self.device, copy_stream, num_experts=store.num_experts)
        self.dequantizer = dequantizer

    def step(self, module, hidden_states, top_k_index, top_k_weights, padding_count=None) -> torch.Tensor:
        """The experts step (``runner.ExpertsRunner.step``), docs/design.md "The layer-step" steps 2-6."""
        predicted = self.prefetcher.predict_ids(hidden_states) if self.prefetcher is not None else None
        t0 = time.perf_counter()
        read = read_step(top_k_index, predicted, padding_count)
        t_read = time.perf_counter()
        self._observe(read, top_k_weights)
        t1 = time.perf_counter()  # host bookkeeping starts here (tracing and prediction apart)
        union = read.union()
        plan = self.residency.plan(union)
        if self.prefetch_stats.pending:
            self.prefetch_stats.observe(union)
        t2 = time.perf_counter()
        out = self._run_waves(module, plan, hidden_states, top_k_index, top_k_weights, read.ids)
        self._record(plan, tokens=int(hidden_states.shape[0]) - read.padding, padding=read.padding,
                     plan_s=t2 - t1 + self.transfers.take_map_s(), sync_s=t_read - t0)
        return out

    def _run_waves(self, module, plan: StepPlan, hidden, top_k_index, top_k_weights, ids_host) -> torch.Tensor:
        """Page in, compute and combine the plan's waves: [T, H] in hidden's dtype."""
        step = self.inner_kernel.host(module, hidden, top_k_index, ids_host.numpy(), plan.waves)
        for w, wave in enumerate(plan.waves):
            self.transfers.page_in(self.store, wave)
            slot_map = self.transfers.slot_map(wave, only_wave=step.only_wave) if step.needs_slot_map else None
            if w == 0 and self.prefetcher is not None:
                self.prefetcher.issue()  # the next layer's predicted page-ins queue behind this wave's
            step.run_wave(self.wave_view(module, wave.slots), w, slot_map)
            self.transfers.compute_done()
        return step.combine(top_k_weights)

    # -- the edges: tracing and prediction hand-off before, stats after --

    def _observe(self, read: StepRead, top_k_weights) -> None:
        if self.trace_hook is not None:  # tracing reads the weights too (not the hot path)
            self.trace_hook(self.layer, read.ids.clone(), top_k_weights.detach().to("cpu"))
        if read.predicted is not None:
            self.prefetcher.take_prediction(read.predicted)

    def _record(self, plan: StepPlan, *, tokens: int, padding: int, plan_s: float, sync_s: float) -> None:
        self.stats.record_step(
            hits=plan.hits, misses=plan.misses, waves=len(plan.waves), tokens=tokens, padding_tokens=padding,
            expert_bytes=self.store.expert_bytes, page_in_s=self.transfers.take_copy_s(block=False),
            plan_s=plan_s, sync_s=sync_s, host_syncs=1,  # read_step: the step's one read-back
        )

    # -- the PagedExecutor contract beyond the step --

    def is_resident(self, expert: int) -> bool:
        """Whether ``expert`` holds a slot now (the host residency's map; no device read)."""
        return expert in self.residency.slot_of_expert

    def copy_in(self, loads) -> None:
        """Page ``loads`` in now (a prefetch): the next compute of this layer waits for them."""
        self.transfers.copy_in(self.store, loads)

    def wave_view(self, module, wave_slots) -> SlotView:
        """The experts module as the inner sees it for one wave: the slot tensors, or for
        packed slots of a quantized format the wave's slots dequantized (dense scratch)."""
        if self.dequantizer is None:
            return SlotView(module, self.slots)
        return SlotView(module, self.dequantizer.wave_tensors(self.slots, wave_slots))

    def collect_copy_time(self) -> None:
        """On CUDA, wait for this layer's in-flight page-in timing events (each its own event,
        not the whole device) and fold their elapsed times into ``self.stats.page_in_s``."""
        self.stats.add_page_in_s([self.transfers.take_copy_s(block=True)])

    def release(self) -> None:
        """Wait for copies still in flight into the slots (before the executor is dropped)."""
        self.transfers.drain()
