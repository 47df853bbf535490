"""Host memory of a paged model, counted before any allocation: ``HostMemoryPlan`` (every part the
process will hold, named), the choice of R host rows from ``--host-memory-gb``, the memory available
(machine and memory cgroup) and the check against it; also ``advise_huge_pages``. docs/disk-tier.md.
Standard library plus ctypes; allocates nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux

# What the process holds beyond the counted parts, by device type (measured on CPU: the
# interpreter with torch, transformers and the tokenizer imported and a model built is ~0.55 GB
# RSS; decode activations at Qwen3-30B-A3B's shapes are a few MB; a CUDA context and its
# libraries add ~1 GB of host RSS). A prefill of thousands of tokens needs more: chunk it.
RUNTIME_ALLOWANCE_BYTES = {"cpu": 600_000_000, "cuda": 1_600_000_000}
# CPU: the runtime part is measured instead (``runtime_allowance``): the anonymous memory the
# process holds when the plan is made (the interpreter, torch, transformers, the tokenizer, the
# model built on meta) + this margin for what a step adds beyond the counted parts (activations,
# the allocator's slack, the lm_head's logits; measured at Qwen3-30B-A3B's shapes, 1 thread: 0.10 GB
# with packed int4 experts, 0.20 GB dequantizing them into dense slots: docs/disk-tier.md)
STEP_MARGIN_BYTES = 250_000_000
# a cgroup v1 limit at or above this is "no limit" (the kernel reports PAGE_COUNTER_MAX pages)
CGROUP_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class HostMemoryPlan:
    """Host bytes of a paged model (``host_rows`` R = E: the full store, no disk tier); ``total_bytes``
    is what ``--host-memory-gb`` budgets."""

    num_layers: int
    num_experts: int
    expert_bytes: int
    host_rows: int
    slot_bytes_on_host: int  # K x L x expert bytes on a CPU device, else 0
    staging_bytes: int  # disk tier read-ahead buffers (0 without a disk tier)
    non_expert_bytes_on_host: int
    kv_bytes_on_host: int
    runtime_bytes: int = 0  # ``runtime_allowance``'s bytes of the device type
    runtime_held_bytes: int = 0  # of them, held by the process when the plan was made (measured; 0: not)

    @property
    def disk_tier(self) -> bool:
        return self.host_rows < self.num_experts

    @property
    def store_bytes(self) -> int:
        return self.host_rows * self.num_layers * self.expert_bytes

    @property
    def fixed_bytes(self) -> int:
        """Everything but the store and its staging (what G pays first)."""
        return self.slot_bytes_on_host + self.non_expert_bytes_on_host + self.kv_bytes_on_host + self.runtime_bytes

    @property
    def total_bytes(self) -> int:
        return self.store_bytes + self.staging_bytes + self.fixed_bytes

    def describe(self) -> str:
        what = f"host rows R={self.host_rows} of E={self.num_experts} per layer" if self.disk_tier else "full expert store"
        return (f"{what} {_gb(self.store_bytes)}, staging {_gb(self.staging_bytes)}, slots on host "
                f"{_gb(self.slot_bytes_on_host)}, non-expert weights {_gb(self.non_expert_bytes_on_host)}, "
                f"KV estimate {_gb(self.kv_bytes_on_host)}, runtime allowance {_gb(self.runtime_bytes)}"
                + (f" (held now {_gb(self.runtime_held_bytes)} + step margin "
                   f"{_gb(self.runtime_bytes - self.runtime_held_bytes)})" if self.runtime_held_bytes else "")
                + f"; total {_gb(self.total_bytes)}")


def host_memory_available_bytes() -> int | None:
    """The smaller of Linux MemAvailable and the memory cgroup's room (``cgroup_available_bytes``), or
    None when neither is known."""
    known = [b for b in (_meminfo_available(), cgroup_available_bytes()) if b is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
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


def process_anon_bytes() -> int | None:
    """This process's anonymous resident bytes (RssAnon: what a memory cgroup charges beyond page
    cache), None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def runtime_allowance(device_type: str) -> tuple[int, int]:
    """(runtime bytes, of them held now) for a plan on ``device_type``: on CPU the anonymous memory
    held now + STEP_MARGIN_BYTES; where unknown and on CUDA, RUNTIME_ALLOWANCE_BYTES."""
    anon = process_anon_bytes() if device_type == "cpu" else None
    if anon is not None:
        return anon + STEP_MARGIN_BYTES, anon
    allowance = RUNTIME_ALLOWANCE_BYTES[device_type]
    return allowance, min(process_rss_bytes(), allowance)


def process_rss_bytes() -> int:
    """Resident bytes of this process now (/proc/self/statm; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def cgroup_available_bytes(*, proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") -> int | None:
    """What the process's memory cgroup still allows, or None without a limit: the minimum over it and
    its limited ancestors of limit - usage + inactive file pages (cgroup v2 ``memory.max`` /
    ``memory.current`` / ``memory.stat``; v1 ``memory.limit_in_bytes`` (>= 2^62: none) /
    ``memory.usage_in_bytes``). Source: the kernel's Documentation/admin-guide/cgroup-v2.rst and
    cgroup-v1/memory.rst."""
    found = []
    for version, directory, mount in _memory_cgroup_dirs(proc_cgroup, mountinfo):
        for d in (directory, *directory.parents):  # the cgroup, then its ancestors up to the mount
            room = _cgroup_room(d, version)
            if room is not None:
                found.append(room)
            if d == mount:
                break
    return max(0, min(found)) if found else None


def _memory_cgroup_dirs(proc_cgroup: str, mountinfo: str) -> list[tuple[int, Path, Path]]:
    """(version, the process's memory cgroup directory, its mount point) for v2 and v1, from
    /proc/self/cgroup and mountinfo."""
    try:
        cgroup_lines = Path(proc_cgroup).read_text().splitlines()
        mount_lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return []
    paths = {}
    for line in cgroup_lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
    out = []
    for line in mount_lines:
        if " - " not in line:
            continue
        fields, (fstype, _source, super_opts) = line.split(" - ", 1)[0].split(), line.split(" - ", 1)[1].split()[:3]
        version = 2 if fstype == "cgroup2" else 1 if fstype == "cgroup" and "memory" in super_opts.split(",") else 0
        if version not in paths or len(fields) < 5:
            continue
        root, mount = fields[3], Path(fields[4])
        rel = os.path.relpath(paths.pop(version), root)
        directory = mount / rel if not rel.startswith("..") else mount
        out.append((version, directory if directory.is_dir() else mount, mount))
    return out


def _cgroup_room(directory: Path, version: int) -> int | None:
    """limit - usage + inactive file pages of one cgroup directory, or None without a limit."""
    names = ("memory.max", "memory.current", "inactive_file") if version == 2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    try:
        limit_text = (directory / names[0]).read_text().strip()
        if limit_text == "max" or (version == 1 and int(limit_text) >= CGROUP_V1_UNLIMITED):
            return None
        usage = int((directory / names[1]).read_text())
        stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return None
    return int(limit_text) - usage + int(stat.get(names[2], 0))


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB"


def plan_host_memory(*, budget_bytes: int | None, available_bytes: int | None, num_layers: int,
                     num_experts: int, expert_bytes: int, slot_bytes_on_host: int, staging_bytes: int,
                     non_expert_bytes_on_host: int, kv_bytes_on_host: int, runtime_bytes: int,
                     runtime_held_bytes: int = 0, slots_read_full_store: bool = False) -> HostMemoryPlan:
    """Choose R and check host memory before any allocation. ``budget_bytes`` G (None: the available
    memory) covers ``HostMemoryPlan.total_bytes``; the store gets what the fixed parts leave: R = E
    if the full store fits, else the most rows beside the staging. ``slots_read_full_store``: the
    slots read a full store's rows in place (packed on a CPU), so the full plan counts no slot bytes.

    Raises ValueError (G below the minimum; names every part and --host-memory-gb) or MemoryError
    (the total exceeds available memory; names every part)."""
    common = dict(num_layers=num_layers, num_experts=num_experts, expert_bytes=expert_bytes,
                  slot_bytes_on_host=slot_bytes_on_host, non_expert_bytes_on_host=non_expert_bytes_on_host,
                  kv_bytes_on_host=kv_bytes_on_host, runtime_bytes=runtime_bytes,
                  runtime_held_bytes=runtime_held_bytes)
    full_plan = HostMemoryPlan(host_rows=num_experts, staging_bytes=0,
                               **{**common, "slot_bytes_on_host": 0 if slots_read_full_store else slot_bytes_on_host})
    explicit = budget_bytes is not None
    budget = budget_bytes if explicit else available_bytes
    if budget is None or full_plan.total_bytes <= budget:
        plan = full_plan
    else:
        smallest = HostMemoryPlan(host_rows=1, staging_bytes=staging_bytes, **common)
        if budget < smallest.total_bytes and not explicit:  # too little memory even for the disk tier
            raise MemoryError(_nothing_fits(full_plan, smallest, budget))
        if budget < smallest.total_bytes:
            raise ValueError(_below_minimum(budget, smallest, explicit))
        rows = (budget - smallest.fixed_bytes - staging_bytes) // (num_layers * expert_bytes)
        plan = HostMemoryPlan(host_rows=int(min(rows, num_experts - 1)), staging_bytes=staging_bytes, **common)
    check_available(plan, available_bytes)
    return plan


def _below_minimum(budget: int, smallest: HostMemoryPlan, explicit: bool) -> str:
    source = f"--host-memory-gb {budget / 1e9:.4g}" if explicit else f"available host memory ({_gb(budget)})"
    return (f"{source} is below the minimum for the disk tier: {smallest.total_bytes:,} bytes "
            f"({smallest.total_bytes / 1e9:.4g} GB) = one host row per layer ({smallest.num_layers} x "
            f"{smallest.expert_bytes:,}) + staging ({smallest.staging_bytes:,}) + slots on host "
            f"({smallest.slot_bytes_on_host:,}) + non-expert weights ({smallest.non_expert_bytes_on_host:,}) + "
            f"KV estimate ({smallest.kv_bytes_on_host:,}) + runtime allowance ({smallest.runtime_bytes:,}); "
            "raise --host-memory-gb or lower --num-resident")


def _nothing_fits(full: HostMemoryPlan, smallest: HostMemoryPlan, available: int) -> str:
    return (f"the model needs {full.total_bytes:,} bytes ({_gb(full.total_bytes)}) of host memory ({full.describe()}) "
            f"and with the disk tier at least {smallest.total_bytes:,} bytes ({_gb(smallest.total_bytes)}: one host "
            f"row per layer; {smallest.describe()}) but only {available:,} bytes ({_gb(available)}) is available "
            "(the smaller of the machine's and the memory cgroup's); free memory or lower --num-resident (the slots "
            "on host are K x layers x the slot's expert bytes)")


def check_available(plan: HostMemoryPlan, available_bytes: int | None) -> None:
    """MemoryError when ``plan.total_bytes`` exceed ``available_bytes`` (None: unknown, no check)."""
    if available_bytes is not None and plan.total_bytes > available_bytes:
        raise MemoryError(
            f"the model needs {plan.total_bytes:,} bytes ({_gb(plan.total_bytes)}) of host memory "
            f"({plan.describe()}) but only {available_bytes:,} bytes ({_gb(available_bytes)}) is available "
            "(the smaller of the machine's and the memory cgroup's); free memory, lower --num-resident, give a "
            "smaller --host-memory-gb (the disk tier reads the other experts from the checkpoint) or use a "
            "quantized checkpoint"
        )


def advise_huge_pages(tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned interior of a CPU tensor's memory where the kernel
    offers transparent huge pages; whether the advice was given (False: too small, not Linux,
    refused)."""
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
