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

Exactness. The reference ("inner") implementation is called once per wave on the wave's
(token, k) entries as if each entry were a token with top_k = 1 and routing weight 1, in the
row order the inner uses per expert, so every entry's output is computed by the same kernel
from the same rows as in the unpaged model; the entries are then weighted with the same
elementwise product (in the promoted dtype: fp32 router weights times bf16 entries stay fp32)
and combined exactly as the inner implementation combines them: ``grouped_mm`` and
``batched_mm`` sum the k entries of a token in one ``sum(dim=1)``; ``eager`` adds them one by
one in ascending expert id (its ``index_add_`` loop). Every entry is computed once and summed
once, so paged output is bit-identical to the unpaged model with the same implementation.

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T * k entries.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import numpy as np
import torch

from pagedexperts.prefetch import PrefetchStats
from pagedexperts.residency import EvictionPolicy, Residency, StepPlan, Wave
from pagedexperts.stats import LayerStats
from pagedexperts.store import HostExpertStore
from pagedexperts.transfer import SlotTransfers, read_back, upload

# Inner implementations whose combine rule the pager knows (see module docstring).
SUM_COMBINE = ("grouped_mm", "batched_mm")
SEQUENTIAL_COMBINE = ("eager",)
INNER_IMPLEMENTATIONS = SUM_COMBINE + SEQUENTIAL_COMBINE


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
        self.slots = slots if slots is not None else {
            spec.name: torch.zeros((num_slots, *spec.shape), dtype=spec.dtype, device=self.device)
            for spec in store.specs
        }
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
        # Prefetch hook (pagedexperts.prefetch): this layer's predictor of the next layer, and
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

    # -- page-in, slot map, read-back (transfers); the compute is _run_waves / _combine --

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

    def _wave_rows(self, wave: Wave, entry_ids_host: np.ndarray) -> tuple[torch.Tensor, int]:
        """Rows [S_w] (int64, on the device) of the entries routed into ``wave``, found on the
        host from the read-back ids in entry order (no device sync), and their count."""
        rows = np.flatnonzero(np.isin(entry_ids_host, wave.experts))
        return upload(rows, self.device), len(rows)

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
        num_tokens, top_k = top_k_index.shape
        inner = resolve_inner(module, self.inner)
        # Each (token, k) entry as its own row with top_k = 1: [S, H], [S, 1]. Row order: eager
        # visits an expert's rows k-major (its one_hot(...).permute(2, 1, 0)), the others
        # token-major; the row order inside one expert's GEMM can change its bits (CPU fp32).
        k_major = self.inner in SEQUENTIAL_COMBINE
        if k_major:
            entry_hidden = hidden.repeat(top_k, 1)
            entry_ids = top_k_index.t().reshape(-1, 1)
        else:
            entry_hidden = hidden.repeat_interleave(top_k, dim=0)
            entry_ids = top_k_index.reshape(-1, 1)
        # Unit weights: the inner returns each entry unweighted in hidden.dtype (exact), and the
        # routing weight is applied in _combine, so an fp32 weight (Mixtral, DeepSeek routers)
        # times a bf16 entry is not rounded to bf16 before the sum, as in the unpaged sum.
        unit = torch.ones_like(entry_ids, dtype=top_k_weights.dtype)
        if len(plan.waves) == 1:
            slot_map = self._page_in(plan.waves[0], only_wave=True)
            self._issue_prefetch()
            view = self.wave_view(module, plan.waves[0].slots)
            entry_out = inner(view, entry_hidden, slot_map[entry_ids], unit)
            self._mark_compute_done()
        else:
            entry_out = None
            entry_ids_host = (ids_host.t() if k_major else ids_host).reshape(-1).numpy()
            for wave in plan.waves:
                slot_map = self._page_in(wave, only_wave=False)
                if wave is plan.waves[0]:
                    self._issue_prefetch()
                view = self.wave_view(module, wave.slots)
                rows, num_rows = self._wave_rows(wave, entry_ids_host)
                # torch.bmm of a batch of one takes another CPU kernel than larger batches: pad
                # a one-entry wave with a copy of its row (batched_mm only), drop the copy after.
                pad = self.inner == "batched_mm" and num_rows == 1 and entry_ids.shape[0] > 1
                run = rows.repeat(2) if pad else rows
                out_w = inner(view, entry_hidden[run], slot_map[entry_ids[run]], unit[run])[:num_rows]
                if entry_out is None:
                    entry_out = torch.empty(
                        (entry_ids.shape[0], out_w.shape[1]), dtype=out_w.dtype, device=out_w.device
                    )
                entry_out[rows] = out_w
                self._mark_compute_done()
        if k_major:
            entries = entry_out.view(top_k, num_tokens, -1).transpose(0, 1)
        else:
            entries = entry_out.view(num_tokens, top_k, -1)
        return self._combine(entries * top_k_weights.unsqueeze(-1), top_k_index, hidden.dtype)

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

    def _combine(self, entries: torch.Tensor, top_k_index: torch.Tensor, dtype) -> torch.Tensor:
        """Weighted entries [T, k, H] -> [T, H], in the inner implementation's own summation order."""
        if self.inner in SUM_COMBINE:
            return entries.sum(dim=1).to(dtype)
        order = torch.argsort(top_k_index, dim=1, stable=True)  # ascending expert id per token
        ordered = torch.gather(entries, 1, order.unsqueeze(-1).expand_as(entries))
        out = torch.zeros(entries.shape[0], entries.shape[2], dtype=dtype, device=entries.device)
        for j in range(entries.shape[1]):
            out = out + ordered[:, j].to(dtype)
        return out

    def collect_copy_time(self) -> None:
        """On CUDA, wait for this layer's in-flight page-in timing events (each its own event,
        not the whole device) and fold their elapsed times into ``stats.page_in_s``."""
        self.stats.add_page_in_s([self.transfers.take_copy_s(block=True)])

    def release(self) -> None:
        """Wait for copies still in flight into the slots (before the pager is dropped)."""
        self.transfers.drain()
