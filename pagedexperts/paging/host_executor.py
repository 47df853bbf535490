"""The host-planned layer-step executor: one MoE layer's K device slots, its ``Residency``, its host
store and its body, stepped top-down in ``step`` with exactly one device-to-host transfer
(docs/design-layer-step.md "How a wave runs").
"""

from __future__ import annotations

import time

import torch

from pagedexperts.paging.runner_contract import PagedExecutor
from pagedexperts.paging.steps.contract import HostRouting, SlotSetup
from pagedexperts.paging.transfer import SlotTransfers, StepRead, read_step
from pagedexperts.residency.eviction import EvictionPolicy
from pagedexperts.residency.planner import Residency


class HostExecutor(PagedExecutor):
    """Paged experts of one MoE layer, planned on the host (any step, any device); ``copy_stream``:
    CUDA stream for page-ins (None on CPU)."""

    def __init__(self, *, layer: int, store, num_slots: int, device, inner: str,
                 policy: EvictionPolicy | None = None, copy_stream: "torch.cuda.Stream | None" = None,
                 setup: SlotSetup | None = None) -> None:
        super().__init__(layer=layer, store=store, device=device, inner=inner, num_slots=num_slots, setup=setup)
        self.residency = Residency(store.num_experts, num_slots, policy)
        self.copy_stream = copy_stream
        self.transfers = SlotTransfers(self.slots, self.device, copy_stream, store=store)

    def step(self, module, hidden_states, top_k_index, top_k_weights, padding_count=None) -> torch.Tensor:
        """The experts step (``runner_contract.ExpertsRunner.step``)."""
        predicted = self.prefetcher.predict_ids(hidden_states) if self.prefetcher is not None else None
        t0 = time.perf_counter()
        read = read_step(top_k_index, predicted, padding_count)  # the step's one read-back
        t_read = time.perf_counter()
        if self.trace_hook is not None or read.predicted is not None:
            self._observe(read, top_k_weights)
        t1 = time.perf_counter()  # host bookkeeping starts here (tracing and prediction apart)
        routed = read.ids.reshape(-1).tolist()
        plan = self.residency.plan(routed)  # waves of at most K experts, hits first
        if self.prefetch_stats.pending:
            self.prefetch_stats.observe(routed)
        t2 = time.perf_counter()
        body, transfers, only_wave, zero_copy = self.body, self.transfers, len(plan.waves) == 1, 0
        work = body.begin(module, hidden_states, top_k_index, HostRouting(read.ids.numpy(), plan.waves))
        for w, wave in enumerate(plan.waves):
            zero_copy += transfers.page_in(wave.loads)  # the wave's rows into their slots; compute waits for them
            slot_map = transfers.slot_map(wave, only_wave=only_wave) if body.needs_slot_map else None
            if w == 0 and self.prefetcher is not None:
                self.prefetcher.issue()  # the next layer's predicted page-ins queue behind this wave's
            body.run_wave(work, w, slot_map)  # the next page-in's copies wait for it (transfer)
        out = body.combine(work, top_k_weights)
        page_in_s, map_s = transfers.take_times(block=False)
        self.stats.record_step(
            hits=plan.hits, misses=plan.misses, waves=len(plan.waves), padding_tokens=read.padding,
            tokens=int(hidden_states.shape[0]) - read.padding, expert_bytes=self.store.expert_bytes,
            page_in_s=page_in_s, plan_s=t2 - t1 + map_s, sync_s=t_read - t0,
            host_syncs=1,  # read_step: the step's one read-back
            zero_copy=zero_copy,
        )
        return out

    # -- the edge before: tracing and the prediction hand-off --

    def _observe(self, read: StepRead, top_k_weights) -> None:
        if self.trace_hook is not None:  # tracing reads the weights too (not the hot path)
            self.trace_hook(self.layer, read.ids.clone(), top_k_weights.detach().to("cpu"))
        if read.predicted is not None:
            self.prefetcher.take_prediction(read.predicted)

    # -- the PagedExecutor contract beyond the step --

    def is_resident(self, expert: int) -> bool:
        """Whether ``expert`` holds a slot now (the host residency's map; no device read)."""
        return expert in self.residency.slot_of_expert

    def copy_in(self, loads) -> None:
        """Page ``loads`` in now (a prefetch): the next compute of this layer waits for them. Those read
        in place are not a step's ``zero_copy_page_ins`` (a part of its misses): the prefetch stats
        count them (``issued``)."""
        self.transfers.page_in(loads, now=False)

    def collect_copy_time(self) -> None:
        """On CUDA, wait for this layer's page-in timing events (each its own event) and add them to the stats."""
        self.stats.add_page_in_s([self.transfers.take_times(block=True)[0]])

    def release(self) -> None:
        """Wait for copies still in flight into the slots (before the executor is dropped)."""
        self.transfers.drain()
