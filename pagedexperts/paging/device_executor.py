"""The device-planned layer-step (``--decide device``): decide, page in and compute one MoE layer with
no device-to-host transfer and fixed shapes, so a CUDA graph can hold it; every Python branch
depends only on T, k, K and the configuration. Refuses prefetch and tracing (each needs the routing
on the host). docs/design-layer-step.md "How a wave runs".
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
    """Device-planned paged experts of one MoE layer; ``inner`` must have a device-planned body.
    ``backend`` "torch" (CPU only) or "triton"; ``beyond_k`` "waves" or "in-place"
    (``admit_per_step``: page-ins per step, None = K).

    ValueError (naming the flag): an unsupported policy, inner, backend or slot table, or a store a
    device gather cannot read (``ExpertStore.gather_problem``)."""

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
        """Build ``name``'s body; ValueError for --beyond-k in-place with a body that reads slots only."""
        super()._inner_set(name)
        if self.setup.in_place and not self.body.reads_in_place:
            raise ValueError(f"--beyond-k in-place reads host rows in the fused kernels; --experts-implementation "
                             f"{name} reads slots only: use --experts-implementation fused or --beyond-k waves")

    @property
    def trace_hook(self) -> TraceHook | None:
        """Always None: tracing reads the routing on the host (setting a hook raises ValueError)."""
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
        """Assigning an empty ``LayerStats`` resets the counters; any other value raises ValueError."""
        if value != LayerStats():
            raise ValueError("device counters can only be reset (assign an empty LayerStats)")
        self.counters.reset()

    def step(self, module, hidden_states, top_k_index, top_k_weights, padding_count=None) -> torch.Tensor:
        """The experts step, with no device-to-host transfer, run with the slots' device current."""
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
        """W of this layer's steps of S = ``num_entries`` entries (1 with --beyond-k in-place)."""
        return self.residency.waves_for(num_entries)

    def capture_problem(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """The body's reason its waves cannot be captured, or None."""
        return self.body.capture_problem()

    def is_resident(self, expert: int) -> bool:
        """Whether ``expert`` holds a slot now (reads the device)."""
        return expert in self.residency.resident()

    def copy_in(self, loads) -> None:
        """Refused (ValueError): a prefetch is planned on the host from read-back predictions."""
        raise ValueError("--prefetch plans page-ins on the host from read-back predictions; the "
                         "device-planned step reads nothing back: use --decide host with --prefetch")


def on_device(device: torch.device):
    """``torch.cuda.device(device)`` on CUDA, else a null context (Triton launches on the current
    device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_store(store: ExpertStore, device: torch.device) -> None:
    """Refuse (ValueError naming the flag) a store the device decide cannot page from."""
    problem = store.gather_problem(device)
    if problem is not None:
        raise ValueError(f"the device decide pages in with a device-side gather: {problem}")
