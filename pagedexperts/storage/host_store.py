"""The host expert store of one MoE layer: every routed expert's tensors in host memory.

Owns: one host allocation per per-expert tensor of the layer, shaped [E, ...] (on a CUDA
host: plain memory of exactly E x row bytes, then page-locked in place with
``cudaHostRegister`` and unregistered on ``release``; plain memory on CPU), and byte movement
from a store row into a device slot (non-blocking on a copy stream on CUDA). Does not: decide
which expert goes where (``residency``) or compute anything (``pager``).

Why register, not ``pin_memory=True``: torch's pinned host allocator rounds every block up to
a power of two (Qwen3-30B-A3B: gate_up 768 -> 1024 MiB, down 384 -> 512 MiB per layer, +33%
host RAM, unseen by the host-memory check). Registration pins exactly the bytes allocated.

Legend: E routed experts, K slots; "row" = one expert's slice ``tensor[e]``.
"""

from __future__ import annotations

import logging
import os
import weakref

import torch

from pagedexperts.formats.base import TensorSpec  # noqa: F401  (its old home; kept importable)

logger = logging.getLogger(__name__)


def host_memory_available_bytes() -> int | None:
    """Bytes of host memory available for new allocations (Linux MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(needed_bytes: int, *, what: str = "host expert store") -> None:
    """Raise MemoryError before any allocation if ``needed_bytes`` exceed available memory.

    Raises:
        MemoryError: names the bytes needed and available and what to change.
    """
    available = host_memory_available_bytes()
    if available is not None and needed_bytes > available:
        raise MemoryError(
            f"{what} needs {needed_bytes:,} bytes ({needed_bytes / 1e9:.3g} GB) of host memory "
            f"but only {available:,} bytes ({available / 1e9:.3g} GB) is available; free memory, "
            "use a smaller model or a quantized checkpoint (the store holds all E experts of "
            "every MoE layer)"
        )


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


def _unregister_all(ptrs: list[int]) -> None:
    for ptr in ptrs:
        code = host_unregister(ptr)
        if code != 0:
            logger.warning("cudaHostUnregister of host store block 0x%x failed (CUDA error %d)", ptr, code)
    ptrs.clear()


class HostExpertStore:
    """All E experts of one MoE layer in host memory, one [E, ...] tensor per per-expert tensor.

    Args:
        specs: the layer's per-expert tensors (name, row shape, dtype).
        num_experts: E.
        pin: page-lock the store (for async host-to-device copies on CUDA): each [E, ...]
            tensor is registered at its exact size. If a registration fails, the store falls
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
                self.release()
                self.fallback = (
                    f"page-locking {nbytes:,} bytes of host store tensor {name!r} failed (CUDA "
                    f"error {code}); using pageable memory: page-ins are synchronous and slower. "
                    "Raise the locked-memory limit (ulimit -l) or free host memory"
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

    def copy_to_slot(self, expert: int, slot: int, slots: dict[str, torch.Tensor]) -> None:
        """Copy every tensor row of ``expert`` into row ``slot`` of the [K, ...] ``slots``.

        Non-blocking when the store is pinned and the slot is on CUDA: the caller issues it on
        its copy stream and orders compute and slot reuse with events (``pager``). Dense slots
        of a quantized layer (``formats.slots.DenseSlots``) dequantize the rows at this copy.
        """
        write_expert = getattr(slots, "write_expert", None)
        if write_expert is not None:
            write_expert(self, expert, slot)
            return
        for name, host in self.tensors.items():
            dst = slots[name][slot]
            dst.copy_(host[expert], non_blocking=self.pinned and dst.is_cuda)
