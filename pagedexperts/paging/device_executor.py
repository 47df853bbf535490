"""The device-planned layer-step of one MoE layer: decide, page in, compute, no host read.

Owns: the [K, ...] slot tensors of one layer, its ``DeviceResidency`` and ``DeviceCounters``
(state and counters in device tensors, ``device_residency``), its host store, its body, and the
experts step: decide the step and remap its entries
on the device (``device_residency.DeviceResidency.decide``), then per wave (a fixed
W = ceil(min(T k, E) / K) for the shape) page in the wave's loads (the store's rows read on
the device, the count read on the device: ``device_residency.DeviceResidency.page_in_over``;
W = 1 at every T with ``--beyond-k in-place``, whose body reads the rest in place)
and compute the wave's entries with its body (the inner implementation's device-planned
``paging.steps.contract.LayerStep``: begin, run each wave, combine). It implements the
``runner_contract.PagedExecutor`` contract beside ``host_executor.HostExecutor`` (``step``:
module, hidden [T, H], top_k_index [T, k], top_k_weights [T, k], padding rows -> [T, H]), so
``loading.runners`` attaches either (``--decide``). Fixed shapes, no
device-to-host transfer, no decision taken in Python per step: every Python branch depends
only on T, k, K and the configuration.
Does not: route, prefetch or trace (both need the routing on the host: ``copy_in`` and a
trace hook are refused, and the configuration check refuses ``--prefetch`` with
``--decide device``), load checkpoints, or know a format or a kernel of the experts (the body).

Exactness: the bodies keep the host path's layouts and combine (``paging.steps``),
so the output equals the host-planned executor's and the unpaged experts'
(tests/paging/test_device_pager.py).

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T k entries, W waves.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from pagedexperts.paging.device_residency import DeviceCounters, DeviceResidency, device_rule
from pagedexperts.paging.runner_contract import PagedExecutor, TraceHook
from pagedexperts.paging.steps.contract import DeviceRouting, SlotSetup
from pagedexperts.residency.policies import DEFAULT_POLICY
from pagedexperts.stats.accounting import LayerStats
from pagedexperts.storage.host_store import ExpertStore


class DeviceExecutor(PagedExecutor):
    """Device-planned paged experts of one MoE layer (a ``runner_contract.PagedExecutor``; ``decide``
    "device": ``inner`` must have a device-planned body).

    Args:
        layer: index of the decoder layer. store: the layer's host store ([E, ...] tensors;
            on CUDA page-locked and mapped, ``HostExpertStore(pin=True)``).
        num_slots: K, 1 <= K <= E. device: where slots, state and compute live.
        inner: experts implementation with a device-planned body (``paging.steps.table``).
        policy: ``--policy`` name with a device decide ("lru", "lfu"); half_life: LFU's, or
            None for ``residency.eviction.LFUPolicy``'s default.
        backend: "torch" (plain tensor ops; store and slots on one device) or "triton".
        setup: the layer's slot table and how its rows are read
            (``paging.steps.contract.SlotSetup``, ``loading.runners`` builds it); None = the
            plain slot table allocated like the store's tensors.
        beyond_k: "waves" (a union larger than K runs in W waves) or "in-place" (one wave: the
            routed experts that get no slot are read in place from the store's host rows;
            the body must read them: ``fused``); admit_per_step: with "in-place", page-ins per
            step at most (None: K). ``device_residency.device_rule`` checks both.

    Raises:
        ValueError: an unsupported policy, inner, backend or slot table (each names its flag);
            backend "torch" off CPU; a store a device gather cannot read
            (``ExpertStore.gather_problem``: the disk tier, or on CUDA a pageable store).
    """

    decide = "device"

    def __init__(self, *, layer: int, store: ExpertStore, num_slots: int, device, inner: str,
                 policy: str = DEFAULT_POLICY, half_life: int | None = None, backend: str = "torch",
                 setup: SlotSetup | None = None, beyond_k: str = "waves", admit_per_step: int | None = None) -> None:
        device = torch.device(device)
        _check_store(store, device)
        rule = device_rule(policy, half_life=half_life, beyond_k=beyond_k, admit_per_step=admit_per_step)
        # the counters exist before the base class resets ``stats`` (the setter below)
        self.counters = DeviceCounters(device, expert_bytes=store.expert_bytes)
        setup = dataclasses.replace(setup or SlotSetup(), in_place=rule.in_place)
        super().__init__(layer=layer, store=store, device=device, inner=inner, num_slots=num_slots, setup=setup)
        self.residency = DeviceResidency(store.num_experts, num_slots, self.device, rule=rule, backend=backend)
        if backend == "torch" and self.device.type != "cpu":
            raise ValueError("kernel backend 'torch' pages in with tensor ops over the store, which "
                             "lives in host memory; use backend 'triton' on CUDA")
        self._page_in = self.residency.page_in_over(store.gather_source(self.device), self.slots)
        self._on_device = on_device(self.device)  # Triton launches on the current device

    def _inner_set(self, name: str) -> None:
        """Build ``name``'s body; with in-place reads, only a body that reads host rows.

        Raises:
            ValueError: --beyond-k in-place with a body that reads slot rows only (names both flags)."""
        super()._inner_set(name)
        if self.setup.in_place and not self.body.reads_in_place:
            raise ValueError(f"--beyond-k in-place reads host rows in the fused kernels; --experts-implementation "
                             f"{name} reads slots only: use --experts-implementation fused or --beyond-k waves")

    @property
    def trace_hook(self) -> TraceHook | None:
        """Always None: tracing reads the routing on the host.

        Raises (on setting a hook):
            ValueError: names --record-trace and --decide.
        """
        return None

    @trace_hook.setter
    def trace_hook(self, hook: TraceHook | None) -> None:
        if hook is not None:
            raise ValueError("--record-trace reads every step's routing on the host; the device-planned "
                             "step reads nothing back: use --decide host to record a trace")

    @property
    def stats(self) -> LayerStats:
        """The layer's counters as ``LayerStats`` (one device read; no times, no host syncs)."""
        return self.counters.to_layer_stats()

    @stats.setter
    def stats(self, value: LayerStats) -> None:
        """``executor.stats = LayerStats()`` resets the counters (as the runtime's reset_stats).

        Raises:
            ValueError: a non-empty LayerStats (device counters can only be reset).
        """
        if value != LayerStats():
            raise ValueError("device counters can only be reset (assign an empty LayerStats)")
        self.counters.reset()

    def step(self, module, hidden_states, top_k_index, top_k_weights, padding_count=None) -> torch.Tensor:
        """The experts step (``runner_contract.ExpertsRunner.step``): hidden_states [T, H], top_k_index
        [T, k] (int64 expert ids, on the device), top_k_weights [T, k], padding rows (0-dim
        device tensor, or None) -> [T, H] in hidden_states.dtype, equal to the unpaged model's
        output with the same inner implementation. No device-to-host transfer. Runs with the
        slots' device current (Triton launches on the current device: ``--device cuda:N``)."""
        with self._on_device:
            ids = top_k_index.detach()
            shape = self.residency.decide(ids)
            plan, body = shape.plan, self.body
            work = body.begin(module, hidden_states, ids, DeviceRouting(shape.entry_slot, shape.entry_wave))
            for w in range(shape.num_waves):
                self._page_in(plan.src, plan.dst, plan.count, w, shape.max_loads)
                body.run_wave(work, w)
            self.counters.add_step(plan.step, rows=int(hidden_states.shape[0]), padding=padding_count)
            return body.combine(work, top_k_weights)

    def waves_for(self, num_entries: int) -> int:
        """W of this layer's steps of S = ``num_entries`` entries (fixed per shape; 1 at every
        S with --beyond-k in-place)."""
        return self.residency.waves_for(num_entries)

    def capture_problem(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """None (no read-back, fixed shapes), unless the body's waves cannot be captured
        (``paging.steps.contract.LayerStep.capture_problem``: the body says why)."""
        return self.body.capture_problem()

    def is_resident(self, expert: int) -> bool:
        """Whether ``expert`` holds a slot now (reads the device)."""
        return expert in self.residency.resident()

    def copy_in(self, loads) -> None:
        """Refused: a prefetch is planned on the host from read-back predictions.

        Raises:
            ValueError: names --prefetch and --decide.
        """
        raise ValueError("--prefetch plans page-ins on the host from read-back predictions; the "
                         "device-planned step reads nothing back: use --decide host with --prefetch")


def on_device(device: torch.device):
    """A context with ``device`` current when it is a CUDA device (``torch.cuda.device``),
    else nothing: Triton launches its kernels on the current device, not the tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_store(store: ExpertStore, device: torch.device) -> None:
    """Refuse a store the device decide cannot page from (ValueError naming the flag; the slot
    table it cannot page into is refused by ``DeviceResidency.page_in_over``)."""
    problem = store.gather_problem(device)
    if problem is not None:
        raise ValueError(f"the device decide pages in with a device-side gather: {problem}")
