"""The host expert store of one MoE layer: every routed expert's tensors in host memory.

Owns: the ``ExpertStore`` contract (what a layer-step executor, the loader's fill and the
runtime ask of any store: rows into a slot, the device-side gather of a device-planned step,
read-ahead, counters; the disk tier's
``storage.host_tier.TieredExpertStore`` implements it too), and ``HostExpertStore``: one host
allocation per per-expert tensor of the layer, shaped [E, ...] (on a CUDA
host: plain memory of exactly E x row bytes, then page-locked in place with
``cudaHostRegister`` and unregistered on ``release``; plain memory on CPU), and byte movement
from a store row into a device slot (non-blocking on a copy stream on CUDA), or from the rows a
device-side plan names (``gather``: a ``paging.kernels.page_in`` kernel reads the page-locked,
mapped store). Does not: decide which expert goes where (``residency``) or compute anything
(``paging``).

Why register, not ``pin_memory=True``: torch's pinned host allocator rounds every block up to
a power of two (Qwen3-30B-A3B: gate_up 768 -> 1024 MiB, down 384 -> 512 MiB per layer, +33%
host RAM, unseen by the host-memory check). Registration pins exactly the bytes allocated.

Legend: E routed experts, K slots; "row" = one expert's slice ``tensor[e]``.
"""

from __future__ import annotations

import logging
import weakref
from abc import ABC, abstractmethod

import torch

from pagedexperts.formats.base import TensorSpec
from pagedexperts.storage.host_memory import advise_huge_pages

logger = logging.getLogger(__name__)


# cudaHostRegisterPortable | cudaHostRegisterMapped (CUDA runtime API): usable from every
# context, and with a device address (cudaHostGetDevicePointer) for device-side gathers.
HOST_REGISTER_FLAGS = 1 | 2


def host_register(tensor: torch.Tensor) -> int:
    """Page-lock ``tensor``'s bytes in place (``cudaHostRegister``); returns the CUDA error code
    (0 = success)."""
    nbytes = tensor.numel() * tensor.element_size()
    return int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, HOST_REGISTER_FLAGS))


def host_unregister(data_ptr: int) -> int:
    """Undo ``host_register`` (``cudaHostUnregister``); returns the CUDA error code."""
    return int(torch.cuda.cudart().cudaHostUnregister(data_ptr))


def clear_pending_cuda_error() -> str | None:
    """Consume the CUDA runtime's pending error of this thread and return its message (None:
    none was pending). A failed ``cudaHostRegister`` leaves its error as the thread's last
    error, which torch's check after its next kernel launch (``cudaGetLastError``) would raise
    at an unrelated op; one tiny launch here takes it (torch exposes no ``cudaGetLastError``)."""
    try:
        torch.zeros(1, device="cuda")
    except (RuntimeError, AssertionError) as exc:  # AssertionError: a torch without CUDA (tests)
        return str(exc).splitlines()[0]
    return None


def _unregister_all(ptrs: list[int]) -> None:
    for ptr in ptrs:
        code = host_unregister(ptr)
        if code != 0:
            logger.warning("cudaHostUnregister of host store block 0x%x failed (CUDA error %d)", ptr, code)
    ptrs.clear()


class ExpertStore(ABC):
    """The store of one MoE layer's E experts, as the executors, the fill and the runtime see it.

    Attributes: ``specs`` (the per-expert tensors), ``num_experts`` E, ``expert_bytes`` (one
    expert, all its tensors: the unit of a page-in), ``pinned`` and ``fallback`` (why not, as
    shown in the stats).
    """

    specs: list[TensorSpec]
    num_experts: int
    expert_bytes: int
    pinned: bool
    fallback: str | None

    @property
    @abstractmethod
    def host_bytes(self) -> int:
        """Bytes of host memory the store's rows take."""

    @abstractmethod
    def copy_to_slot(self, expert: int, slot: int, slots) -> None:
        """Copy every tensor row of ``expert`` into row ``slot`` of the slot table ``slots``
        (a ``formats.slots.SlotTable``: its ``write_rows``)."""

    def rows_in_memory(self) -> dict[str, torch.Tensor] | None:
        """The [E, ...] tensors (name -> tensor) when the store holds every expert's rows in host
        memory, for a page-in that the slot table copies itself (``formats.slots.SlotTable.copy_rows``);
        None here: rows are reached through ``copy_to_slots`` only (the disk tier reads first)."""
        return None

    def copy_to_slots(self, loads, slots) -> None:
        """``copy_to_slot`` of each load (``residency.planner.Load``: ``expert``, ``slot``), in
        order: one step's page-ins together (the disk tier reads its host misses in parallel)."""
        for load in loads:
            self.copy_to_slot(load.expert, load.slot, slots)

    def gather_problem(self, device: torch.device) -> str | None:
        """Why a device-side gather (``gather``) on ``device`` cannot read this store, or None.
        Here: the store does not hold every expert in host memory."""
        return (f"a {type(self).__name__} does not hold every expert in host memory (the disk tier reads "
                "on demand on the host): use --decide host, or raise --host-memory-gb")

    def gather_source(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The [E, ...] tensors (name -> tensor, every expert's row) that a device-side gather on
        ``device`` reads (``paging.kernels.page_in.PageIn`` builds its address table over them).

        Raises:
            ValueError: ``gather_problem``'s message (checked when the executor is built).
        """
        raise ValueError(self.gather_problem(device))

    @abstractmethod
    def fill_from(self, extents: dict[str, list[list]]) -> list[tuple]:
        """Take the checkpoint's byte ranges of every expert (tensor name -> [E] lists of
        ``storage.safetensors_index.Extent``): returns the (extent, flat destination row) reads
        the fill must do now (all of them for a full store; none for the disk tier, which keeps
        the ranges and reads on demand)."""

    def after_fill(self) -> None:
        """Called once the fill has read every row (e.g. to advise huge pages)."""

    def read_ahead(self, experts) -> int:
        """Start reading ``experts`` (priority order) from disk in the background; returns the
        reads started (0: this store holds every expert in memory)."""
        return 0

    tier_stats = None  # the host and disk tier counters (``stats.tiers.TierStats``); None: no tiers
    # where every row was read from when not the checkpoint (a stored kernel layout's path): the fill reads none
    rows_from: str | None = None

    def reset(self) -> None:
        """Forget what was paged through the store (after the start-up check); counters zeroed."""


class HostExpertStore(ExpertStore):
    """All E experts of one MoE layer in host memory, one [E, ...] tensor per per-expert tensor.

    Args:
        specs: the layer's per-expert tensors (name, row shape, dtype).
        num_experts: E.
        pin: page-lock the store (for async host-to-device copies on CUDA): each [E, ...]
            tensor is registered at its exact size. If a registration fails, the store
            consumes the CUDA error it left pending (``clear_pending_cuda_error``), falls
            back to pageable memory for all its tensors, logs a WARNING naming the bytes and
            the CUDA error, and sets ``pinned = False`` and ``fallback`` (shown in the paging
            stats).

    Attributes:
        tensors: name -> host tensor [E, *spec.shape].
        expert_bytes: bytes of one expert (all its tensors), the unit of one page-in.
        pinned_bytes: bytes page-locked now (== host_bytes when pinned, else 0).
    """

    def __init__(self, specs: list[TensorSpec], num_experts: int, *, pin: bool) -> None:
        self.specs = list(specs)
        self.num_experts = num_experts
        self.expert_bytes = sum(s.row_bytes for s in self.specs)
        self.fallback: str | None = None
        self.pinned = False
        self.pinned_bytes = 0
        self._registered: list[int] = []
        self._finalizer = weakref.finalize(self, _unregister_all, self._registered)
        self.tensors = {s.name: torch.empty((num_experts, *s.shape), dtype=s.dtype) for s in self.specs}
        if pin:
            self._pin()

    def _pin(self) -> None:
        """Register every tensor at its exact size; on a failure, unregister and fall back."""
        for name, t in self.tensors.items():
            nbytes = t.numel() * t.element_size()
            try:
                code = host_register(t)
            except (RuntimeError, AssertionError) as exc:  # no CUDA runtime
                code = f"{type(exc).__name__}: {exc}"
            if code != 0:
                if isinstance(code, int):  # the runtime ran and kept the error: take it now
                    clear_pending_cuda_error()
                self.release()
                self.fallback = (
                    f"page-locking {nbytes:,} bytes of host store tensor {name!r} failed (CUDA "
                    f"error {code}); using pageable memory: page-ins are synchronous and slower, "
                    "and --decide auto plans on the host. Raise the locked-memory limit (ulimit -l) "
                    "or free host memory"
                )
                logger.warning(self.fallback)
                return
            self._registered.append(t.data_ptr())
            self.pinned_bytes += nbytes
        self.pinned = True

    def release(self) -> None:
        """Unregister the page-locked tensors (they stay valid, pageable). Also run when the
        store is garbage collected."""
        _unregister_all(self._registered)
        self.pinned, self.pinned_bytes = False, 0

    @property
    def host_bytes(self) -> int:
        return self.expert_bytes * self.num_experts

    def write_row(self, name: str, expert: int, value: torch.Tensor, *, rows: slice | tuple | None = None) -> None:
        """Copy ``value`` into expert ``expert``'s row of tensor ``name`` (optionally a slice of
        its first per-expert dimension, or an index tuple, for checkpoints that store gate and up
        separately).

        Raises:
            ValueError: unknown tensor name, expert out of range, or a shape mismatch (the
                message names the tensor, the shapes and the expert).
        """
        if name not in self.tensors:
            raise ValueError(f"no per-expert tensor {name!r}; have {sorted(self.tensors)}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} outside [0, E={self.num_experts}) for {name!r}")
        dst = self.tensors[name][expert]
        if rows is not None:
            dst = dst[rows]
        if tuple(value.shape) != tuple(dst.shape):
            raise ValueError(
                f"expert tensor {name!r} of expert {expert}: checkpoint shape {tuple(value.shape)}"
                f" does not match the config's {tuple(dst.shape)}"
            )
        dst.copy_(value)

    def use_specs(self, specs: list[TensorSpec]) -> None:
        """Hold rows in ``specs`` from now on, uninitialised (a stored kernel layout is read into
        them next: ``fill_from`` its extents); the old tensors are freed first. Only an unpinned store.

        Raises:
            ValueError: a page-locked store (its registrations are of the old tensors)."""
        if self.pinned:
            raise ValueError("use_specs: a page-locked host store (CUDA) keeps its layout")
        self.tensors = {}
        self.tensors = {s.name: torch.empty((self.num_experts, *s.shape), dtype=s.dtype) for s in specs}
        self.specs = list(specs)
        self.expert_bytes = sum(s.row_bytes for s in self.specs)

    def convert_rows(self, specs: list[TensorSpec], convert, *, chunk: int = 16) -> None:
        """Hold every expert in another layout from now on: ``convert({name: [n, ...]})`` ->
        {spec.name: [n, *spec.shape]} for ``specs``, applied to ``chunk`` experts at a time
        (``formats.cpu_pack``: torch's CPU kernel layouts, so that a page-in is a copy). Only an
        unpinned store (a CPU device); the old tensors are freed when every row is converted.

        Raises:
            ValueError: a page-locked store (its registrations are of the old tensors)."""
        if self.pinned:
            raise ValueError("convert_rows: a page-locked host store (CUDA) keeps its layout")
        new = {s.name: torch.empty((self.num_experts, *s.shape), dtype=s.dtype) for s in specs}
        for first in range(0, self.num_experts, chunk):
            rows = {name: t[first: first + chunk] for name, t in self.tensors.items()}
            for name, value in convert(rows).items():
                new[name][first: first + value.shape[0]].copy_(value)
        self.tensors, self.specs = new, list(specs)
        self.expert_bytes = sum(s.row_bytes for s in self.specs)

    def copy_to_slot(self, expert: int, slot: int, slots) -> None:
        """Copy every tensor row of ``expert`` into row ``slot`` of the [K, ...] ``slots``.

        Non-blocking when the store is pinned and the slot is on CUDA: the caller issues it on
        its copy stream and orders compute and slot reuse with events (``paging.transfer``).
        A slot table that dequantizes or repacks at page-in (``formats.slots.DenseSlots``,
        ``formats.cpu_pack.CpuPackedSlots``) does so in its ``write_rows``.
        """
        slots.write_rows({name: host[expert] for name, host in self.tensors.items()}, slot, pinned=self.pinned)

    def rows_in_memory(self) -> dict[str, torch.Tensor]:
        """``ExpertStore.rows_in_memory``: this store's [E, ...] tensors (every row in memory)."""
        return self.tensors

    def copy_to_slots(self, loads, slots) -> None:
        """``copy_to_slot`` of each load, in order (one Python frame for the step's page-ins)."""
        tensors, pinned = self.tensors.items(), self.pinned
        for expert, slot in loads:
            slots.write_rows({name: host[expert] for name, host in tensors}, slot, pinned=pinned)

    def gather_problem(self, device: torch.device) -> str | None:
        """None, except on CUDA when the store is pageable: the gather reads the page-locked,
        mapped rows through their device address."""
        if torch.device(device).type == "cuda" and not self.pinned:
            return (f"on CUDA it reads the page-locked, mapped host store; this store is pageable "
                    f"({self.fallback or 'pin=False'}): use --decide host")
        return None

    def gather_source(self, device: torch.device) -> dict[str, torch.Tensor]:
        """``ExpertStore.gather_source``: this store's [E, ...] tensors (every row in memory)."""
        problem = self.gather_problem(device)
        if problem is not None:
            raise ValueError(problem)
        return self.tensors

    def fill_from(self, extents: dict[str, list[list]]) -> list[tuple]:
        """Every (extent, flat row of this store) read of the fill: the store holds all E."""
        return [(ext, self.tensors[name][e].view(-1)) for name, rows in extents.items()
                for e, row in enumerate(rows) for ext in row]

    def after_fill(self) -> None:
        """Advise transparent huge pages over the filled rows: khugepaged collapses them in the
        background. Advised before the first touch, faults stall in direct compaction
        ("madvise" defrag): measured 0.3-6 GB/s against about 1 GB/s without
        (bench/disk_tier_bench.py)."""
        for table in self.tensors.values():
            advise_huge_pages(table)
