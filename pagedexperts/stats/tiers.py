"""Counters of the host and disk tiers, standard library only: ``TierStats``, one layer's host
hits/misses, disk reads, bytes and read times, their sums and percentiles.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedexperts.stats.times import nearest_rank

READ_TIME_WINDOW = 4096  # most recent disk reads kept for the p50/p99


@dataclass
class TierStats:
    """Counters of the host and disk tiers of one layer (sums; times in seconds).

    ``host_hits``/``host_misses``: device page-ins served from a host row / not. Every host
    miss is one expert read from disk, on demand or earlier by read-ahead (``read_ahead_used``).
    ``disk_reads``: experts read from disk (on demand + read-ahead), ``disk_preads`` the
    positional reads they took, ``disk_bytes_read`` their bytes. ``read_times`` keeps the last
    READ_TIME_WINDOW per-expert read times for the percentiles. Read-ahead: ``read_ahead_issued``
    = ``read_ahead_used`` (taken by a page-in) + ``read_ahead_wasted`` (read, then dropped unused)
    + ``read_ahead_held`` (in flight or waiting, each in a staging row: a level, not a sum, summed
    over layers when merged) since the counters were zeroed (``carried``: those held then count as
    issued after); ``read_ahead_bytes_used`` / ``_wasted`` their bytes.
    """

    host_hits: int = 0
    host_misses: int = 0
    disk_reads: int = 0
    disk_preads: int = 0
    disk_bytes_read: int = 0
    disk_read_s: float = 0.0
    read_ahead_issued: int = 0
    read_ahead_used: int = 0
    read_ahead_paused: int = 0  # steps a layer skipped read-ahead (its read-aheads mostly unused)
    read_ahead_wasted: int = 0  # read-aheads read and dropped unused
    read_ahead_bytes_used: int = 0  # bytes of the read-aheads a page-in took
    read_ahead_bytes_wasted: int = 0  # bytes of the read-aheads dropped unused
    read_ahead_held: int = 0  # read-aheads now in a staging row, neither taken nor dropped (a level)
    read_times: deque = field(default_factory=lambda: deque(maxlen=READ_TIME_WINDOW), repr=False)

    @classmethod
    def carried(cls, held: int) -> "TierStats":
        """Zeroed counters over ``held`` read-aheads still in staging rows: issued = held, so issued =
        used + wasted + held holds after a reset too."""
        return cls(read_ahead_issued=held, read_ahead_held=held)

    def record_host_access(self, hit: bool) -> None:
        """One device page-in seen by the host rows: a hit (served from a host row) or a miss
        (the expert is read from disk). The runtime's disk tier and the simulator count here."""
        if hit:
            self.host_hits += 1
        else:
            self.host_misses += 1

    def record_read(self, *, nbytes: int, preads: int, seconds: float) -> None:
        self.disk_reads += 1
        self.disk_preads += preads
        self.disk_bytes_read += nbytes
        self.disk_read_s += seconds
        self.read_times.append(seconds)

    def merge(self, other: "TierStats") -> None:
        for name in ("host_hits", "host_misses", "disk_reads", "disk_preads", "disk_bytes_read",
                     "disk_read_s", "read_ahead_issued", "read_ahead_used", "read_ahead_paused", "read_ahead_wasted",
                     "read_ahead_bytes_used", "read_ahead_bytes_wasted", "read_ahead_held"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.read_times.extend(other.read_times)

    @property
    def host_hit_rate(self) -> float:
        total = self.host_hits + self.host_misses
        return self.host_hits / total if total else 0.0

    def as_dict(self) -> dict:
        times = sorted(self.read_times)
        pick = lambda q: nearest_rank(times, q) if times else 0.0  # noqa: E731
        return dict(host_hits=self.host_hits, host_misses=self.host_misses, host_hit_rate=self.host_hit_rate,
                    disk_reads=self.disk_reads, disk_preads=self.disk_preads,
                    disk_bytes_read=self.disk_bytes_read, disk_read_s=self.disk_read_s,
                    disk_read_p50_s=pick(0.5), disk_read_p99_s=pick(0.99),
                    read_ahead_issued=self.read_ahead_issued, read_ahead_used=self.read_ahead_used,
                    read_ahead_paused=self.read_ahead_paused, read_ahead_wasted=self.read_ahead_wasted,
                    read_ahead_bytes_used=self.read_ahead_bytes_used,
                    read_ahead_bytes_wasted=self.read_ahead_bytes_wasted, read_ahead_held=self.read_ahead_held)
