"""The host expert store of one MoE layer: every routed expert's tensors in host memory.

Owns: one host allocation per per-expert tensor of the layer, shaped [E, ...] (pinned on a
CUDA host, allocated once at exact size; plain memory on CPU), and byte movement from a
store row into a device slot (non-blocking on a copy stream on CUDA). Does not: decide which
expert goes where (``residency``) or compute anything (``pager``).

Legend: E routed experts, K slots; "row" = one expert's slice ``tensor[e]``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorSpec:
    """One per-expert tensor: its name on the experts module, per-expert shape, dtype."""

    name: str
    shape: tuple[int, ...]  # shape of one expert's row, without the leading E
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


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


class HostExpertStore:
    """All E experts of one MoE layer in host memory, one [E, ...] tensor per per-expert tensor.

    Args:
        specs: the layer's per-expert tensors (name, row shape, dtype).
        num_experts: E.
        pin: allocate page-locked memory (for async host-to-device copies on CUDA). If the
            pinned allocation fails, the store falls back to pageable memory, logs a WARNING
            and sets ``pinned = False`` and ``fallback`` (shown in the paging stats).

    Attributes:
        tensors: name -> host tensor [E, *spec.shape].
        expert_bytes: bytes of one expert (all its tensors), the unit of one page-in.
    """

    def __init__(self, specs: list[TensorSpec], num_experts: int, *, pin: bool) -> None:
        self.specs = list(specs)
        self.num_experts = num_experts
        self.expert_bytes = sum(s.row_bytes for s in self.specs)
        self.fallback: str | None = None
        self.pinned = pin
        self.tensors: dict[str, torch.Tensor] = {}
        for spec in self.specs:
            self.tensors[spec.name] = self._allocate(spec)

    def _allocate(self, spec: TensorSpec) -> torch.Tensor:
        shape = (self.num_experts, *spec.shape)
        if self.pinned:
            try:
                return torch.empty(shape, dtype=spec.dtype, pin_memory=True)
            except RuntimeError as exc:
                nbytes = self.num_experts * spec.row_bytes
                self.pinned = False
                self.fallback = (
                    f"pinned allocation of {nbytes / 1e6:.1f} MB failed ({exc}); using pageable "
                    "memory: page-ins are synchronous and slower. Raise the locked-memory limit "
                    "(ulimit -l) or free host memory"
                )
                logger.warning(self.fallback)
        return torch.empty(shape, dtype=spec.dtype)

    @property
    def host_bytes(self) -> int:
        return self.expert_bytes * self.num_experts

    def write_row(self, name: str, expert: int, value: torch.Tensor, *, rows: slice | None = None) -> None:
        """Copy ``value`` into expert ``expert``'s row of tensor ``name`` (optionally a slice of
        its first per-expert dimension, for checkpoints that store gate and up separately).

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
        its copy stream and orders compute and slot reuse with events (``pager``).
        """
        for name, host in self.tensors.items():
            dst = slots[name][slot]
            dst.copy_(host[expert], non_blocking=self.pinned and dst.is_cuda)
