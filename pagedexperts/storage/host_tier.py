"""The disk tier: a host cache of R experts per MoE layer over the checkpoint's own files.

Owns: ``TieredExpertStore``, the ``host_store.ExpertStore`` contract implemented over a host
cache when the full store does not fit in host memory. Each layer keeps
R of its E experts in host rows ([R, ...] per tensor, pinned on CUDA, allocated at exact size),
placed by a host-side ``Residency`` with the same policy classes as the device slots; a device
miss whose expert is not in a host row reads it from the checkpoint's safetensors files, one
``os.preadv`` per per-expert tensor extent, into the host row, then copies the row into the
slot. ``ReadAhead``: a small thread pool and a few expert-sized staging buffers shared by the
layers, filled with the next layer's predicted experts (``paging.prefetch``); a miss that finds its
expert there takes the buffer instead of reading, and never waits for a read-ahead of another
expert. Counters: ``stats.tiers.TierStats`` (host hits/misses, disk reads, bytes, read times).

Host-tier accounting: the host residency sees the sequence of device page-ins of its layer
(plan misses and prefetch loads, in order), each as a one-expert step (``Residency.access``,
counted by ``TierStats.record_host_access``: the simulator's two-level replay calls the same two).
Read-ahead changes only where the bytes come from, never a decision.
A read error is sticky: the store raises ``DiskReadError`` on every later page-in (no request
ever computes with a row that was not read).

Legend: E routed experts, K device slots, R host rows per layer.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedexperts.residency.planner import Residency
from pagedexperts.residency.policies import make_policy
from pagedexperts.stats.tiers import TierStats
from pagedexperts.storage.host_store import ExpertStore, HostExpertStore
from pagedexperts.storage.safetensors_index import DiskReadError, Extent, read_extent


class ReadAhead:
    """A thread pool and ``num_buffers`` expert-sized staging buffers shared by all layers.

    Args:
        specs: the per-expert tensors (every layer has the same).
        num_buffers: staging buffers (experts in flight or waiting to be used) at most.
        workers: reader threads.
    """

    def __init__(self, specs, *, num_buffers: int, workers: int = 2, extent_workers: int = 4) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedexperts-readahead")
        # on-demand reads: an expert's extents (e.g. gate, up, down) in flight together
        self.extent_pool = ThreadPoolExecutor(max_workers=extent_workers, thread_name_prefix="pagedexperts-read")
        self.free = [{s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs} for _ in range(num_buffers)]
        self.lock = threading.Lock()

    def take(self) -> dict | None:
        with self.lock:
            return self.free.pop() if self.free else None

    def give_back(self, buffer: dict) -> None:
        with self.lock:
            self.free.append(buffer)


class TieredExpertStore(ExpertStore):
    """E experts of one MoE layer: R in host rows, all E readable from the checkpoint files.

    Args:
        specs: the layer's per-expert tensors; num_experts: E; host_rows: R, 1 <= R <= E.
        policy: eviction policy name for the host rows (``residency.policies.POLICIES``).
        pin: page-lock the host rows (CUDA), at exact size and with the same fallback as
            ``HostExpertStore`` (``pinned``, ``fallback``); layer: for error messages.
        read_ahead: the model's shared ``ReadAhead`` (None: no read-ahead).

    Raises:
        ValueError: R out of [1, E] (names --host-memory-gb).
    """

    def __init__(self, specs, num_experts: int, host_rows: int, *, policy: str, pin: bool,
                 layer: int = -1, read_ahead: ReadAhead | None = None) -> None:
        if not 1 <= host_rows <= num_experts:
            raise ValueError(f"host rows R={host_rows} per layer must be in [1, E={num_experts}] (--host-memory-gb)")
        self.specs = list(specs)
        self.num_experts = num_experts
        self.host_rows = host_rows
        self.expert_bytes = sum(s.row_bytes for s in self.specs)
        self.layer = layer
        # the R host rows: a store of R "experts", page-locked at exact size like the full store
        self._host = HostExpertStore(self.specs, host_rows, pin=pin)
        self.rows = self._host.tensors
        self.residency = Residency(num_experts, host_rows, make_policy(policy, host_rows))
        self.tier_stats = TierStats()
        self._row_expert = [-1] * host_rows  # expert whose bytes a row holds (-1: none / failed)
        self._row_events: list = [None] * host_rows  # CUDA: last copy out of the row
        self._sources: dict[str, list[list[Extent]]] | None = None
        self._read_ahead = read_ahead
        self._ahead: dict[int, tuple[Future, dict]] = {}
        self._stats_lock = threading.Lock()
        self.failed: DiskReadError | None = None

    @property
    def host_bytes(self) -> int:
        return self.expert_bytes * self.host_rows

    @property
    def pinned(self) -> bool:
        return self._host.pinned

    @property
    def fallback(self) -> str | None:
        """Why the host rows are pageable though pinning was asked (``HostExpertStore``)."""
        return self._host.fallback

    def reset(self) -> None:
        """Empty host rows and zeroed counters, as after loading (e.g. after a start-up check
        paged samples through the tier)."""
        self.residency = Residency(self.num_experts, self.host_rows, make_policy(self.residency.policy.name, self.host_rows))
        self._row_expert = [-1] * self.host_rows
        self.tier_stats = TierStats()

    def fill_from(self, extents: dict[str, list[list[Extent]]]) -> list[tuple]:
        """Keep the checkpoint byte ranges of every expert (tensor name -> [E] lists of
        extents) to read on demand; the fill reads nothing into this store."""
        self._sources = extents
        return []

    def copy_to_slot(self, expert: int, slot: int, slots: dict[str, torch.Tensor]) -> None:
        """Copy ``expert`` into row ``slot`` of the [K, ...] ``slots``, via its host row (read
        from disk first on a host miss). Non-blocking from pinned rows to CUDA slots. Rows hold
        packed tensors (a quantized format's, as on disk); dense slots
        (``formats.slots.DenseSlots``) dequantize them at this copy.

        Raises:
            DiskReadError: the checkpoint file could not be read (now or at an earlier page-in).
        """
        row = self._host_row(expert)
        self._host.copy_to_slot(row, slot, slots)
        if self.pinned and next(iter(slots.values())).is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            self._row_events[row] = event

    def _host_row(self, expert: int) -> int:
        if self.failed is not None:
            raise self.failed
        resident, row = self.residency.access(expert)
        hit = resident and self._row_expert[row] == expert  # a row whose read failed holds nothing
        self.tier_stats.record_host_access(hit)
        if hit:
            return row
        if self._row_events[row] is not None:
            self._row_events[row].synchronize()  # the row's last copy to the device is done
        dst = {name: t[row].view(-1) for name, t in self.rows.items()}
        self._row_expert[row] = -1
        ahead = self._ahead.pop(expert, None)
        try:
            if ahead is not None:
                self._take_read_ahead(ahead, dst)
            else:
                self._read(expert, dst)
        except DiskReadError as exc:
            self.failed = exc
            raise
        self._row_expert[row] = expert
        return row

    def _take_read_ahead(self, ahead: tuple[Future, dict], dst: dict[str, torch.Tensor]) -> None:
        future, buffer = ahead
        try:
            future.result()
            for name, flat in dst.items():
                flat.copy_(buffer[name].view(-1))
        finally:
            self._read_ahead.give_back(buffer)
        self.tier_stats.read_ahead_used += 1

    def _read(self, expert: int, dst: dict[str, torch.Tensor]) -> None:
        """Read ``expert``'s extents into the flat rows ``dst`` (name -> 1-D CPU tensor)."""
        if self._sources is None:
            raise DiskReadError(f"layer {self.layer}: the disk tier has no checkpoint attached (loader bug)")
        t0 = time.perf_counter()
        by_file: dict = {}
        for name, rows in self._sources.items():
            for ext in rows[expert]:
                by_file.setdefault(ext.path, []).append((ext, dst[name]))
        jobs = [(path, job) for path, js in by_file.items() for job in js]
        on_demand = not threading.current_thread().name.startswith("pagedexperts-readahead")
        if on_demand and self._read_ahead is not None and len(jobs) > 1:  # several reads in flight
            for f in [self._read_ahead.extent_pool.submit(self._read_extent, expert, p, j) for p, j in jobs]:
                f.result()
        else:
            for path, job in jobs:
                self._read_extent(expert, path, job)
        preads = len(jobs)
        with self._stats_lock:
            self.tier_stats.record_read(nbytes=sum(e.nbytes for js in by_file.values() for e, _ in js),
                                        preads=preads, seconds=time.perf_counter() - t0)

    def _read_extent(self, expert: int, path, job) -> None:
        """One positional read of ``job`` = (extent, flat destination) from ``path``."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise DiskReadError(
                f"cannot read expert {expert} of layer {self.layer} from checkpoint file {path}: {exc}; "
                "the checkpoint must stay in place while the model runs (disk tier, --host-memory-gb)"
            ) from exc
        try:
            read_extent(fd, job[0], job[1], None)
        except OSError as exc:
            raise DiskReadError(f"reading expert {expert} of layer {self.layer} from {path} failed: {exc}") from exc
        finally:
            os.close(fd)

    def read_ahead(self, experts) -> int:
        """Start reading ``experts`` (priority order) that are in no host row into free staging
        buffers, in the background. Unused read-aheads of earlier calls are dropped once done.
        Returns the reads started."""
        ra = self._read_ahead
        if ra is None or self.failed is not None:
            return 0
        wanted = set(experts)
        for e, (future, buffer) in list(self._ahead.items()):
            if e not in wanted and future.done():
                del self._ahead[e]
                ra.give_back(buffer)
        started = 0
        for e in experts:
            if e in self._ahead or self._holds(e):
                continue
            buffer = ra.take()
            if buffer is None:
                break
            flat = {name: t.view(-1) for name, t in buffer.items()}
            self._ahead[e] = (ra.pool.submit(self._read, e, flat), buffer)
            started += 1
        self.tier_stats.read_ahead_issued += started
        return started

    def _holds(self, expert: int) -> bool:
        row = self.residency.slot_of_expert.get(expert)
        return row is not None and self._row_expert[row] == expert
