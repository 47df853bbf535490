"""The device-planned layer-step of one MoE layer: decide, page in, remap, compute, no host read.

Owns: the [K, ...] slot tensors of one layer, its ``DeviceResidency`` (state in device
tensors), its host store, its ``DeviceCounters``, and the experts step: decide the step on
the device (``kernels.decide``), then per wave (a fixed W = ceil(min(T k, E) / K) for the
shape) page in the wave's loads (the store's ``gather``, a ``kernels.page_in`` kernel: the
count read on the device) and compute the wave's entries (the wave-compute contract: the
inner implementation's device step, ``paging.inner``, ``device_layout``), then combine. It implements the
``runner.PagedExecutor`` contract beside ``host_executor.HostExecutor`` (``step``:
module, hidden [T, H], top_k_index [T, k], top_k_weights [T, k], padding rows -> [T, H]), so
``loading.runners`` attaches either (``--decide``). Fixed shapes, no
device-to-host transfer, no decision taken in Python per step: every Python branch depends
only on T, k, K and the configuration.
Does not: route, prefetch or trace (both need the routing on the host: ``copy_in`` and a
trace hook are refused, and the configuration check refuses ``--prefetch`` with
``--decide device``), load checkpoints.

Exactness: the same layouts and combine as the host path (``device_layout``), so the output
equals the host-planned executor's and the unpaged experts' (tests/test_device_pager.py).

Legend: T tokens, H hidden, k top_k, E experts, K slots, S = T k entries, W waves.
"""

from __future__ import annotations

import contextlib

import torch

from pagedexperts.formats.slots import DenseSlots, PackedSlots, allocate
from pagedexperts.paging.device_residency import DeviceResidency, device_rule
from pagedexperts.paging.device_stats import DeviceCounters
from pagedexperts.paging.fused_step import slot_rows
from pagedexperts.paging.kernels.page_in import PageIn
from pagedexperts.paging.kernels.remap import remap_reference, remap_triton
from pagedexperts.paging.runner import PagedExecutor, TraceHook
from pagedexperts.paging.waves import SlotView
from pagedexperts.residency.policies import DEFAULT_POLICY
from pagedexperts.stats.accounting import LayerStats
from pagedexperts.storage.host_store import ExpertStore


class DeviceExecutor(PagedExecutor):
    """Device-planned paged experts of one MoE layer (a ``runner.PagedExecutor``; ``decide``
    "device": ``inner`` must have a device step).

    Args:
        layer: index of the decoder layer. store: the layer's host store ([E, ...] tensors;
            on CUDA page-locked and mapped, ``HostExpertStore(pin=True)``).
        num_slots: K, 1 <= K <= E. device: where slots, state and compute live.
        inner: experts implementation with a device step (``paging.inner.INNER_KERNELS``).
        policy: ``--policy`` name with a device decide ("lru", "lfu"); half_life: LFU's, or
            None for ``residency.eviction.LFUPolicy``'s default.
        backend: "torch" (reference ops; store and slots on one device) or "triton".
        slots: the [K, ...] slot tensors (``formats.slots.PackedSlots`` or a dict); None =
            allocate them like the store's tensors.
        dequantizer: for packed slots of a quantized format (``formats.slots.WaveDequantizer``):
            each wave dequantizes all K slots (fixed shape); None = dense slots, or an inner
            implementation that reads the packed slots itself (``fused``).
        layout: the layer's ``formats.base.ExpertLayout``: how ``fused`` reads the packed
            slot rows (``paging.fused_step.slot_rows``); None = dense experts.

    Raises:
        ValueError: an unsupported policy, inner, backend or slot table (each names its flag);
            backend "torch" off CPU; a store a device gather cannot read
            (``ExpertStore.gather_problem``: the disk tier, or on CUDA a pageable store).
    """

    decide = "device"

    def __init__(self, *, layer: int, store: ExpertStore, num_slots: int, device, inner: str,
                 policy: str = DEFAULT_POLICY, half_life: int | None = None, backend: str = "torch",
                 slots: dict[str, torch.Tensor] | None = None, dequantizer=None, layout=None) -> None:
        device = torch.device(device)
        _check_store(store, device, slots)
        # the counters exist before the base class resets ``stats`` (the setter below)
        self.counters = DeviceCounters(device, expert_bytes=store.expert_bytes)
        super().__init__(layer=layer, store=store, device=device, inner=inner)
        self.residency = DeviceResidency(store.num_experts, num_slots, self.device,
                                         rule=device_rule(policy, half_life=half_life), backend=backend)
        if backend == "torch" and self.device.type != "cpu":
            raise ValueError("kernel backend 'torch' pages in with tensor ops over the store, which "
                             "lives in host memory; use backend 'triton' on CUDA")
        self.slots = slots if slots is not None else PackedSlots(allocate(store.specs, num_slots, self.device))
        self.dequantizer = dequantizer
        self.layout = layout
        self._fused_rows = None  # the slots' address tables, built at the first fused wave
        self._page_in = PageIn(store.gather_source(self.device), self.slots, self.device, backend=backend)
        self._remap = remap_triton if backend == "triton" else remap_reference
        self._all_slots = torch.arange(num_slots, device=self.device)

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
        """The experts step (``runner.ExpertsRunner.step``): hidden_states [T, H], top_k_index
        [T, k] (int64 expert ids, on the device), top_k_weights [T, k], padding rows (0-dim
        device tensor, or None) -> [T, H] in hidden_states.dtype, equal to the unpaged model's
        output with the same inner implementation. No device-to-host transfer. Runs with the
        slots' device current (Triton launches on the current device: ``--device cuda:N``)."""
        with on_device(self.device):
            ids = top_k_index.detach()
            plan = self.residency.decide(ids)
            entry_slot = torch.empty(ids.numel(), dtype=torch.int64, device=ids.device)
            entry_wave = torch.empty_like(entry_slot)
            self._remap(ids, plan.expert_slot, plan.expert_wave, entry_slot, entry_wave)
            step = self.inner_kernel.device(module, hidden_states, ids, entry_slot, entry_wave)
            max_loads = min(ids.numel(), self.num_slots)  # a wave loads at most T k and at most K experts
            for w in range(plan.num_waves):
                self._page_in(plan.src, plan.dst, plan.count, w, max_loads)
                step.run_wave(self.wave_view(module), w)
            self.counters.add_step(plan.step, rows=int(hidden_states.shape[0]), padding=padding_count)
            return step.combine(top_k_weights)

    def wave_view(self, module, wave_slots=None) -> SlotView:
        """The experts module over the slot tensors. ``wave_slots`` is not used: every wave
        computes over all K slots (fixed shape; packed slots: all K dequantized, unless the
        inner implementation reads them packed: then the view carries ``fused_rows``, the
        slots' address tables, built once)."""
        if self.inner_kernel.packed:
            view = SlotView(module, self.slots)
            if self._fused_rows is None:
                self._fused_rows = slot_rows(self.layout, self.slots, transposed=bool(getattr(module, "is_transposed", False)))
            view.fused_rows = self._fused_rows
            return view
        if self.dequantizer is None:
            return SlotView(module, self.slots)
        return SlotView(module, self.dequantizer.wave_tensors(self.slots, self._all_slots))

    def capture_problem(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """None (no read-back, fixed shapes), except for packed slots of a quantized format
        dequantized per wave (none with ``fused``: it reads them packed, constants in its kernels)."""
        if self.dequantizer is not None and not self.inner_kernel.packed:
            return ("packed slots of a quantized format dequantize each wave with constants built on the host "
                    "(formats: torch.tensor(...) per call, a host-to-device copy a capture cannot hold); use "
                    "--no-cuda-graphs")
        return None

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


def _check_store(store: ExpertStore, device: torch.device, slots) -> None:
    """Refuse what the device decide cannot page from or into (ValueError naming the flag)."""
    problem = store.gather_problem(device)
    if problem is not None:
        raise ValueError(f"the device decide pages in with a device-side gather: {problem}")
    if isinstance(slots, DenseSlots):
        raise ValueError("dense slots of a quantized layer dequantize at page-in on the host path; "
                         "use --slot-format packed with --decide device")
