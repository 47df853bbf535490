"""The host expert store of one MoE layer: the ``ExpertStore`` contract (the disk tier implements it
too) and ``HostExpertStore``, one [E, ...] host tensor per per-expert tensor, page-locked in place
at exact size when pinned (CUDA; docs/disk-tier.md "The host store's memory"), with byte movement
from a row into a slot or a device-side gather. Does not decide placement or compute.

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
    """Page-lock ``tensor``'s bytes in place (``cudaHostRegister``); the CUDA error code (0: success)."""
    nbytes = tensor.numel() * tensor.element_size()
    return int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, HOST_REGISTER_FLAGS))


def host_unregister(data_ptr: int) -> int:
    """Undo ``host_register`` (``cudaHostUnregister``); returns the CUDA error code."""
    return int(torch.cuda.cudart().cudaHostUnregister(data_ptr))


def clear_pending_cuda_error() -> str | None:
    """Consume and return this thread's pending CUDA error (None: none), which torch would otherwise
    raise at an unrelated later op."""
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
    """One MoE layer's E experts as executors, the fill and the runtime see them; ``expert_bytes``: one
    expert, all its tensors (the unit of a page-in)."""

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
        """Page every row of ``expert`` into row ``slot`` of the slot table ``slots`` (its
        ``hold_rows``: copied, or read in place)."""

    def rows_in_memory(self) -> dict[str, torch.Tensor] | None:
        """The [E, ...] tensors when every row is in host memory
        (``formats.slots.SlotTable.copy_rows``); else None."""
        return None

    def copy_to_slots(self, loads, slots) -> int:
        """``copy_to_slot`` of each load (``residency.planner.Load``), in order: one step's page-ins;
        how many the slots read in place (0 here)."""
        for load in loads:
            self.copy_to_slot(load.expert, load.slot, slots)
        return 0

    def gather_problem(self, device: torch.device) -> str | None:
        """Why a device-side gather on ``device`` cannot read this store, or None."""
        return (f"a {type(self).__name__} does not hold every expert in host memory (the disk tier reads "
                "on demand on the host): use --decide host, or raise --host-memory-gb")

    def gather_source(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The [E, ...] tensors a device-side gather reads (ValueError: ``gather_problem``'s)."""
        raise ValueError(self.gather_problem(device))

    @abstractmethod
    def fill_from(self, extents: dict[str, list[list]]) -> list[tuple]:
        """Take every expert's byte ranges (``storage.safetensors_index.Extent``); the (extent, flat
        row) reads to do now."""

    def after_fill(self) -> None:
        """Called once the fill has read every row (e.g. to advise huge pages)."""

    def read_ahead(self, experts) -> int:
        """Start reading ``experts`` from disk in the background; returns the reads started (0 here)."""
        return 0

    tier_stats = None  # the host and disk tier counters (``stats.tiers.TierStats``); None: no tiers
    # where every row was read from when not the checkpoint (a stored kernel layout's path): the fill reads none
    rows_from: str | None = None

    def reset(self) -> None:
        """Forget what was paged through the store (after the start-up check); counters zeroed."""


class HostExpertStore(ExpertStore):
    """All E experts of one MoE layer in host memory, ``tensors`` name -> [E, *spec.shape]; ``pin``:
    page-lock at exact size (CUDA), falling back to pageable memory with a WARNING and ``fallback``
    set."""

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
        """Unregister the page-locked tensors (they stay valid, pageable); also on garbage collection."""
        _unregister_all(self._registered)
        self.pinned, self.pinned_bytes = False, 0

    @property
    def host_bytes(self) -> int:
        return self.expert_bytes * self.num_experts

    def write_row(self, name: str, expert: int, value: torch.Tensor, *, rows: slice | tuple | None = None) -> None:
        """Copy ``value`` into ``expert``'s row of ``name`` (``rows``: a slice of its first
        per-expert dim, or an index tuple). ValueError names the tensor, shapes and expert."""
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
        """Hold every expert in another layout: ``convert({name: [n, ...]})`` -> {spec.name: [n,
        *spec.shape]}, ``chunk`` at a time. ValueError if page-locked."""
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
        """Page every row of ``expert`` into row ``slot`` (the rows never change once filled: a slot may
        read them in place); non-blocking from a pinned store to CUDA."""
        slots.hold_rows({name: host[expert] for name, host in self.tensors.items()}, slot, pinned=self.pinned)

    def rows_in_memory(self) -> dict[str, torch.Tensor]:
        """This store's [E, ...] tensors."""
        return self.tensors

    def copy_to_slots(self, loads, slots) -> int:
        """``copy_to_slot`` of each load, in order; how many the slots read in place."""
        return slots.copy_rows(self.tensors, loads, pinned=self.pinned)

    def gather_problem(self, device: torch.device) -> str | None:
        """None, except on CUDA for a pageable store (the gather reads page-locked, mapped rows)."""
        if torch.device(device).type == "cuda" and not self.pinned:
            return (f"on CUDA it reads the page-locked, mapped host store; this store is pageable "
                    f"({self.fallback or 'pin=False'}): use --decide host")
        return None

    def gather_source(self, device: torch.device) -> dict[str, torch.Tensor]:
        """This store's [E, ...] tensors."""
        problem = self.gather_problem(device)
        if problem is not None:
            raise ValueError(problem)
        return self.tensors

    def fill_from(self, extents: dict[str, list[list]]) -> list[tuple]:
        """Every (extent, flat row) read of the fill: the store holds all E."""
        return [(ext, self.tensors[name][e].view(-1)) for name, rows in extents.items()
                for e, row in enumerate(rows) for ext in row]

    def after_fill(self) -> None:
        """Advise transparent huge pages over the filled rows (docs/disk-tier.md)."""
        for table in self.tensors.values():
            advise_huge_pages(table)
