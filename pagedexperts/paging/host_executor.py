"""The per-layer paging runtime: K device slots, the residency, the host store, the waves.

Owns: the [K, ...] slot tensors of one MoE layer on the device, its ``Residency`` (policy and
slot map), its ``HostExpertStore``, its ``LayerStats``, and the experts step of DESIGN.md
(steps 2-6): read the top-k ids to the host, plan waves, page in the misses, compute each wave
with the model's own experts implementation over the slot tensors, and merge.
Does not: route (the model's router runs unchanged), load checkpoints (``loader``), know
the architecture (``models``), or order copies against compute (``transfer``).

Syncs. A layer-step makes exactly one device-to-host transfer (``transfer.read_back``: the
top-k ids, the next layer's prefetch prediction and the step's padding count together); the
slot map lives on the device and is re-uploaded from pinned memory only when it changed, and a
multi-wave step's rows per wave are computed on the host from the read-back ids and uploaded.
``tests/test_syncs.py`` counts this by instrumentation.

Exactness. Each wave's entries are computed by ``wave_compute`` with the model's own experts
math over the slot tensors, every kernel handed the unpaged model's row order and buffer shape,
and combined in the implementation's own order: paged output is bit-identical to the unpaged
model with the same implementation (README "What is exact").

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T * k entries.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import numpy as np
import torch

from pagedexperts.formats.slots import allocate
from pagedexperts.paging.prefetch import PrefetchStats
from pagedexperts.residency.planner import Residency, StepPlan, Wave
from pagedexperts.residency.policy import EvictionPolicy
from pagedexperts.stats.accounting import LayerStats
from pagedexperts.storage.host_store import HostExpertStore
from pagedexperts.paging.waves import INNER_IMPLEMENTATIONS, step_entries
from pagedexperts.paging.transfer import SlotTransfers, read_back, upload



def routed_union(ids_host: torch.Tensor) -> list[int]:
    """Distinct expert ids of a step's top-k ids [T, k] (a CPU tensor), as a Python list.

    A set over ``tolist()`` is several times cheaper than ``torch.unique`` for decode-sized
    steps; ``torch.unique`` wins for large prefills.
    """
    if ids_host.numel() <= 4096:
        return list(set(ids_host.reshape(-1).tolist()))
    return torch.unique(ids_host).tolist()


class SlotView:
    """Stand-in for an experts module during one wave: the module's own attributes and methods,
    except that the per-expert tensors are the [K, ...] slot tensors and ``num_experts`` is K.
    """

    def __init__(self, module: torch.nn.Module, slots: dict[str, torch.Tensor]) -> None:
        self.__dict__.update(slots)
        self.num_experts = next(iter(slots.values())).shape[0]
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def resolve_inner(module: torch.nn.Module, name: str) -> Callable:
    """The experts function ``name`` of transformers' registry (``eager``: the class's own loop).

    Looked up once per (experts class, name): runners call this every layer step.

    Raises:
        ValueError: ``name`` not in INNER_IMPLEMENTATIONS (lists them).
    """
    return _inner_for(type(module), name)


@functools.lru_cache(maxsize=None)
def _inner_for(cls: type, name: str) -> Callable:
    if name not in INNER_IMPLEMENTATIONS:
        raise ValueError(
            f"experts implementation {name!r} is not supported under paging; choose one of "
            f"{list(INNER_IMPLEMENTATIONS)} (--experts-implementation)"
        )
    if name == "eager":
        return cls.forward.__wrapped__
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS[name]


class ExpertPager:
    """Paged experts of one MoE layer.

    Args:
        layer: index of the decoder layer (for stats and traces).
        store: the layer's host store ([E, ...] tensors).
        num_slots: K, 1 <= K <= E (checked by ``Residency``).
        device: where the slot tensors live and the experts are computed.
        inner: name of the experts implementation used on the slots (INNER_IMPLEMENTATIONS).
        policy: eviction policy over K slots (default LRU).
        copy_stream: CUDA stream for page-ins (None on CPU).
        slots: the [K, ...] slot tensors, when a quantized format needs them other than as
            the store's packed tensors (``formats.slots.DenseSlots``); None = allocate them
            like the store's tensors.
        dequantizer: for packed slots of a quantized format, turns each wave's slots into
            dense tensors (``formats.slots.WaveDequantizer``); None = the slots are dense.
    """

    def __init__(
        self,
        *,
        layer: int,
        store: HostExpertStore,
        num_slots: int,
        device: torch.device,
        inner: str,
        policy: EvictionPolicy | None = None,
        copy_stream: "torch.cuda.Stream | None" = None,
        slots: dict[str, torch.Tensor] | None = None,
        dequantizer=None,
    ) -> None:
        self.layer = layer
        self.store = store
        self.residency = Residency(store.num_experts, num_slots, policy)
        self.device = torch.device(device)
        self.inner = inner
        self.copy_stream = copy_stream
        self.stats = LayerStats()
        self.slots = slots if slots is not None else allocate(store.specs, num_slots, self.device)
        self.transfers = SlotTransfers(self.slots, self.device, copy_stream)
        self.dequantizer = dequantizer
        # expert -> slot at its last page-in (plan or prefetch): exact for every resident
        # expert, stale for evicted ones, which a single-wave step never looks up. Mirrored on
        # the device in _slot_map (uploaded when _slot_map_stale).
        self._slot_of = np.full(store.num_experts, -1, dtype=np.int64)
        self._slot_map: torch.Tensor | None = None
        self._slot_map_stale = True
        self.trace_hook: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        # padding rows of the current step as a 0-dim device tensor (set by the recording hook
        # before each model step, read back with the top-k ids), or None: no padding
        self.padding_count: torch.Tensor | None = None
        # Prefetch hook (pagedexperts.paging.prefetch): this layer's predictor of the next layer, and
        # the counters of prefetches INTO this layer. None = prefetch off.
        self.prefetcher = None
        self.prefetch_stats = PrefetchStats()

    @property
    def num_slots(self) -> int:
        return self.residency.num_slots

    @property
    def num_experts(self) -> int:
        return self.store.num_experts

    def __call__(self, module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """The experts step: hidden_states [T, H], top_k_index [T, k] (expert ids, int64),
        top_k_weights [T, k] -> output [T, H] in hidden_states.dtype, equal to the unpaged
        model's output with the same inner implementation.
        """
        predicted = None
        if self.prefetcher is not None:
            predicted = self.prefetcher.predict_ids(hidden_states)  # timed in prefetch_stats.predict_s
        t0 = time.perf_counter()
        ids_host, predicted_host, padding = self._read_step(top_k_index, predicted)
        t_read = time.perf_counter()
        if self.trace_hook is not None:  # tracing reads the weights too (not the hot path)
            self.trace_hook(self.layer, ids_host.clone(), top_k_weights.detach().to("cpu"))
        if predicted_host is not None:
            self.prefetcher.take_prediction(predicted_host)
        t1 = time.perf_counter()  # host bookkeeping starts here (tracing and prediction apart)
        union = routed_union(ids_host)
        plan = self.residency.plan(union)
        if self.prefetch_stats.pending:
            self.prefetch_stats.observe(union)
        t2 = time.perf_counter()
        self._map_s = 0.0
        out = self._run_waves(module, plan, hidden_states, top_k_index, top_k_weights, ids_host)
        self.stats.record_step(
            hits=plan.hits,
            misses=plan.misses,
            waves=len(plan.waves),
            tokens=int(hidden_states.shape[0]) - padding,
            padding_tokens=padding,
            expert_bytes=self.store.expert_bytes,
            page_in_s=self.transfers.take_copy_s(block=False),
            plan_s=t2 - t1 + self._map_s,
            sync_s=t_read - t0,
        )
        return out

    # -- page-in, slot map, read-back (transfers); the compute is _run_waves (wave_compute) --

    def _read_step(self, top_k_index, predicted):
        """The step's one device-to-host transfer: (top-k ids [T, k], predicted ids [T, k'] or
        None, padding rows) on the host."""
        parts = [top_k_index.detach()]
        if predicted is not None:
            parts.append(predicted)
        if self.padding_count is not None:
            parts.append(self.padding_count)
        host = read_back(parts)
        k = top_k_index.shape[1]
        ids_host = host[:, :k]
        predicted_host = host[:, k : k + predicted.shape[1]] if predicted is not None else None
        padding = int(host[0, -1]) if self.padding_count is not None and host.shape[0] else 0
        return ids_host, predicted_host, padding

    def _page_in(self, wave: Wave, *, only_wave: bool) -> torch.Tensor:
        """Copy the wave's loads into their slots and make the compute wait for them; return
        the slot map [E] (int64, on the device) that the wave's top-k ids are remapped with.
        ``only_wave``: the step has this one wave, so every routed expert is resident and the
        running map serves as is; otherwise experts outside the wave map to -1."""
        self.transfers.copy_in(self.store, wave.loads)
        self.transfers.before_compute()
        t1 = time.perf_counter()
        self.note_loads(wave.loads)
        if only_wave:
            if self._slot_map_stale:
                self._slot_map = upload(self._slot_of, self.device)
                self._slot_map_stale = False
            slot_map = self._slot_map
        else:
            slot_of = np.full(self.num_experts, -1, dtype=np.int64)
            slot_of[list(wave.experts)] = wave.slots
            slot_map = upload(slot_of, self.device)
        self._map_s += time.perf_counter() - t1
        return slot_map

    def note_loads(self, loads) -> None:
        """Record page-ins (from a plan or a prefetch) in the running expert -> slot map."""
        for load in loads:
            self._slot_of[load.expert] = load.slot
        if loads:
            self._slot_map_stale = True

    def copy_in(self, loads) -> None:
        """Page ``loads`` in now (a prefetch): the next compute of this layer waits for them."""
        self.note_loads(loads)
        self.transfers.copy_in(self.store, loads)

    def _run_waves(self, module, plan: StepPlan, hidden, top_k_index, top_k_weights, ids_host) -> torch.Tensor:
        step = step_entries(self.inner, module, hidden, top_k_index, ids_host.numpy())
        single = len(plan.waves) == 1
        for wave in plan.waves:
            slot_map = self._page_in(wave, only_wave=single)
            if wave is plan.waves[0]:
                self._issue_prefetch()
            step.run_wave(self.wave_view(module, wave.slots), slot_map, wave, only_wave=single)
            self._mark_compute_done()
        return step.combine(top_k_weights)

    def wave_view(self, module, wave_slots) -> SlotView:
        """The experts module as the inner sees it for one wave: the slot tensors, or for
        packed slots of a quantized format the wave's slots dequantized (dense scratch)."""
        if self.dequantizer is None:
            return SlotView(module, self.slots)
        return SlotView(module, self.dequantizer.wave_tensors(self.slots, wave_slots))

    def _issue_prefetch(self) -> None:
        """Prefetch hook: after this layer's first page-ins, start the next layer's predicted ones."""
        if self.prefetcher is not None:
            self.prefetcher.issue()

    def _mark_compute_done(self) -> None:
        self.transfers.compute_done()

    def collect_copy_time(self) -> None:
        """On CUDA, wait for this layer's in-flight page-in timing events (each its own event,
        not the whole device) and fold their elapsed times into ``stats.page_in_s``."""
        self.stats.add_page_in_s([self.transfers.take_copy_s(block=True)])

    def release(self) -> None:
        """Wait for copies still in flight into the slots (before the pager is dropped)."""
        self.transfers.drain()
