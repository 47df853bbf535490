"""The host-planned layer-step executor: one MoE layer's K device slots, residency and waves.

Owns: the [K, ...] slot tensors of one MoE layer on the device, its ``Residency`` (policy and
slot map), its host store, and the experts step of docs/design.md "The layer-step" (steps 2-6),
read top-down in ``step`` as docs/design-layer-step.md "How a wave runs" tells it: read the top-k
ids to the host (``transfer.read_step``), plan waves (``residency.planner``), then per wave page
its loads in (``transfer.SlotTransfers.page_in``: one call, the rows copied into their slots
after the compute that last read them, and the compute made to wait for them) and compute it with the body (the inner implementation's
host-planned ``paging.steps.contract.LayerStep``: begin, run each wave, combine); stats and
tracing at the edges. The device-planned executor
(``paging.device_executor``) implements the same ``runner_contract.PagedExecutor`` contract
with a body of its own path. Does not: route (the model's router runs unchanged), load
checkpoints (``loading``), know the architecture (``models``), a format or a kernel (the
body does), or order copies (``transfer``).

Syncs. A layer-step makes exactly one device-to-host transfer (``transfer.read_step``: the
top-k ids, the next layer's prefetch prediction and the step's padding count together); the
slot map lives on the device and is re-uploaded from pinned memory only when it changed, and a
multi-wave step's rows per wave are computed on the host from the read-back ids and uploaded.
``tests/paging/test_syncs.py`` counts this by instrumentation.

Exactness. Each wave's entries are computed by the body with the model's own experts math over
the slot tensors, every kernel handed the unpaged model's row order and buffer shape, and
combined in the implementation's own order: paged output is bit-identical to the unpaged model
with the same implementation (docs/exactness.md; each body's docstring says how).

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T * k entries.
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
    """Paged experts of one MoE layer, planned on the host (any step, any device).

    Args:
        layer: index of the decoder layer (for stats and traces).
        store: the layer's host store ([E, ...] rows; ``storage.host_store.ExpertStore``).
        num_slots: K, 1 <= K <= E (checked by ``Residency``).
        device: where the slot tensors live and the experts are computed.
        inner: name of the experts implementation used on the slots
            (``paging.steps.table.INNER_IMPLEMENTATIONS``; its host-planned body).
        policy: eviction policy over K slots; None: the ``Residency`` default, LFU with aging
            (``--policy``'s default, ``residency.policies.DEFAULT_POLICY``).
        copy_stream: CUDA stream for page-ins (None on CPU).
        setup: the layer's slot table and how its rows are read
            (``paging.steps.contract.SlotSetup``, ``loading.runners`` builds it); None = the
            plain slot table allocated like the store's tensors.
    """

    def __init__(self, *, layer: int, store, num_slots: int, device, inner: str,
                 policy: EvictionPolicy | None = None, copy_stream: "torch.cuda.Stream | None" = None,
                 setup: SlotSetup | None = None) -> None:
        super().__init__(layer=layer, store=store, device=device, inner=inner, num_slots=num_slots, setup=setup)
        self.residency = Residency(store.num_experts, num_slots, policy)
        self.copy_stream = copy_stream
        self.transfers = SlotTransfers(self.slots, self.device, copy_stream, store=store)

    def step(self, module, hidden_states, top_k_index, top_k_weights, padding_count=None) -> torch.Tensor:
        """The experts step (``runner_contract.ExpertsRunner.step``), docs/design.md "The layer-step" steps 2-6."""
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
        body, transfers, only_wave = self.body, self.transfers, len(plan.waves) == 1
        work = body.begin(module, hidden_states, top_k_index, HostRouting(read.ids.numpy(), plan.waves))
        for w, wave in enumerate(plan.waves):
            transfers.page_in(wave.loads)  # the wave's rows into their slots; compute waits for them
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
        """Page ``loads`` in now (a prefetch): the next compute of this layer waits for them."""
        self.transfers.page_in(loads, now=False)

    def collect_copy_time(self) -> None:
        """On CUDA, wait for this layer's in-flight page-in timing events (each its own event,
        not the whole device) and fold their elapsed times into ``self.stats.page_in_s``."""
        self.stats.add_page_in_s([self.transfers.take_times(block=True)[0]])

    def release(self) -> None:
        """Wait for copies still in flight into the slots (before the executor is dropped)."""
        self.transfers.drain()
