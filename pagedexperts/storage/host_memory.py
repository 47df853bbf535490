"""Host memory of a paged model, counted before any allocation: the tier sizes and the check.

Owns: ``HostMemoryPlan``, everything that will live in host memory for the chosen device (the
expert store or the disk tier's R host rows per layer and staging buffers, and when the device
is the CPU its K slots per layer, the non-expert weights and a KV-cache estimate, each counted
by the caller), the available memory (``host_memory_available_bytes``), the choice
of R from ``--host-memory-gb`` G (the store's budget), the minimum G and the check against
available memory, with every byte named. Also ``advise_huge_pages``
(transparent huge pages for the store where the OS offers them).
Standard library plus ctypes. Does not: allocate (``host_store``, ``host_tier``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@dataclass(frozen=True)
class HostMemoryPlan:
    """Host bytes of a paged model. ``host_rows`` R = E: the full store, no disk tier.

    G (``--host-memory-gb``) budgets the expert store on the host: all E rows per layer, or
    the disk tier's R rows plus its staging. The rest (the slots, the non-expert weights and
    KV when the device is the CPU) is counted in ``total_bytes`` against available memory.
    """

    num_layers: int
    num_experts: int
    expert_bytes: int
    host_rows: int
    slot_bytes_on_host: int  # K x L x expert bytes on a CPU device, else 0
    staging_bytes: int  # disk tier read-ahead buffers (0 without a disk tier)
    non_expert_bytes_on_host: int
    kv_bytes_on_host: int

    @property
    def disk_tier(self) -> bool:
        return self.host_rows < self.num_experts

    @property
    def store_bytes(self) -> int:
        return self.host_rows * self.num_layers * self.expert_bytes

    @property
    def total_bytes(self) -> int:
        return (self.store_bytes + self.staging_bytes + self.slot_bytes_on_host + self.non_expert_bytes_on_host
                + self.kv_bytes_on_host)

    def describe(self) -> str:
        what = f"host rows R={self.host_rows} of E={self.num_experts} per layer" if self.disk_tier else "full expert store"
        return (f"{what} {_gb(self.store_bytes)}, slots on host {_gb(self.slot_bytes_on_host)}, "
                f"staging {_gb(self.staging_bytes)}, non-expert weights {_gb(self.non_expert_bytes_on_host)}, "
                f"KV estimate {_gb(self.kv_bytes_on_host)}; total {_gb(self.total_bytes)}")


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


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB"


def plan_host_memory(*, budget_bytes: int | None, available_bytes: int | None, num_layers: int,
                     num_experts: int, expert_bytes: int, slot_bytes_on_host: int, staging_bytes: int,
                     non_expert_bytes_on_host: int, kv_bytes_on_host: int) -> HostMemoryPlan:
    """Choose R and check host memory, before any allocation.

    ``budget_bytes`` G None: what is available after the slots, non-expert weights and KV
    estimate on the host. R = E when the full store fits in G (no staging then); else the most
    rows that fit beside the staging buffers.

    Raises:
        ValueError: G below the minimum (one host row per layer + staging); names the minimum
            and --host-memory-gb.
        MemoryError: the total exceeds available memory; names every part.
    """
    others = slot_bytes_on_host + non_expert_bytes_on_host + kv_bytes_on_host
    explicit = budget_bytes is not None
    if budget_bytes is None:
        budget_bytes = (available_bytes - others) if available_bytes is not None else None
    full = num_experts * num_layers * expert_bytes
    common = dict(num_layers=num_layers, num_experts=num_experts, expert_bytes=expert_bytes,
                  slot_bytes_on_host=slot_bytes_on_host, non_expert_bytes_on_host=non_expert_bytes_on_host,
                  kv_bytes_on_host=kv_bytes_on_host)
    if budget_bytes is None or full <= budget_bytes:
        plan = HostMemoryPlan(host_rows=num_experts, staging_bytes=0, **common)
    else:
        minimum = num_layers * expert_bytes + staging_bytes
        if budget_bytes < minimum and not explicit:  # too little memory for anything: say so in full
            check_available(HostMemoryPlan(host_rows=num_experts, staging_bytes=0, **common), available_bytes)
        if budget_bytes < minimum:
            source = (f"--host-memory-gb {budget_bytes / 1e9:.4g}" if explicit else
                      f"available host memory after slots, non-expert weights and KV ({_gb(budget_bytes)})")
            raise ValueError(
                f"{source} is below the minimum for the disk tier: {minimum:,} bytes ({minimum / 1e9:.4g} GB) = "
                f"one host row per layer ({num_layers} x {expert_bytes:,}) + staging ({staging_bytes:,}); "
                "raise --host-memory-gb"
            )
        rows = (budget_bytes - staging_bytes) // (num_layers * expert_bytes)
        plan = HostMemoryPlan(host_rows=int(min(rows, num_experts - 1)), staging_bytes=staging_bytes, **common)
    check_available(plan, available_bytes)
    return plan


def check_available(plan: HostMemoryPlan, available_bytes: int | None) -> None:
    """Raise MemoryError when ``plan.total_bytes`` exceed ``available_bytes`` (None: unknown)."""
    if available_bytes is not None and plan.total_bytes > available_bytes:
        raise MemoryError(
            f"the model needs {plan.total_bytes:,} bytes ({_gb(plan.total_bytes)}) of host memory "
            f"({plan.describe()}) but only {available_bytes:,} bytes ({_gb(available_bytes)}) is available; "
            "free memory, lower --num-resident, give a smaller --host-memory-gb (the disk tier reads "
            "the other experts from the checkpoint) or use a quantized checkpoint"
        )


def advise_huge_pages(tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned interior of a CPU tensor's memory, before
    its first touch, where the kernel offers transparent huge pages ("madvise" or "always").
    Returns whether the advice was given (False: too small, not Linux, or refused)."""
    start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + size) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
