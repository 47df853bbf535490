"""Link benchmark: host-to-device copy bandwidth, pinned and pageable, over a range of sizes.

Owns timing ``tensor.to(device)`` copies with CUDA events (median of repeats), in GB/s (1e9 B/s);
``measure`` returns None without an accelerator. Does not: decide anything from the numbers.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

DEFAULT_SIZES_MB = (1.0, 4.0, 16.0, 64.0, 256.0)


@dataclass(frozen=True)
class LinkResult:
    """Bandwidth of one copy size and host memory kind: ``gbps`` = ``num_bytes`` / ``median_s`` / 1e9
    over ``repeats`` copies; ``label`` names the size ("1 MB", "expert")."""

    label: str
    memory: str
    num_bytes: int
    repeats: int
    median_s: float
    gbps: float

    def as_dict(self) -> dict:
        return asdict(self)


def accelerator_name() -> str | None:
    """The CUDA device's name, or None where torch sees no CUDA device."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def time_copy(*, num_bytes: int, pinned: bool, repeats: int, warmup: int = 2) -> float:
    """Median seconds of one host-to-device copy of ``num_bytes`` (uint8), timed by CUDA events.
    Raises RuntimeError: no CUDA device (call ``accelerator_name`` first)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device to copy to")
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=pinned)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(*, sizes: list[tuple[str, int]], repeats: int = 10) -> list[LinkResult] | None:
    """Bandwidth for each (label, bytes) in ``sizes``, pinned and pageable; None without CUDA.
    Raises ValueError: ``repeats`` < 1 (``--repeats``) or a size < 1 byte."""
    if repeats < 1:
        raise ValueError(f"--repeats {repeats} must be >= 1")
    if any(n < 1 for _, n in sizes):
        raise ValueError("copy sizes must be >= 1 byte (--sizes-mb)")
    if accelerator_name() is None:
        return None
    out = []
    for label, n in sizes:
        for pinned in (True, False):
            s = time_copy(num_bytes=n, pinned=pinned, repeats=repeats)
            out.append(LinkResult(label=label, memory="pinned" if pinned else "pageable", num_bytes=n,
                                  repeats=repeats, median_s=s, gbps=n / s / 1e9))
    return out
