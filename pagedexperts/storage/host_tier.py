"""The disk tier (``TieredExpertStore``): the ``host_store.ExpertStore`` contract over R host rows per
MoE layer, placed by a host-side ``Residency``, the other experts read from the checkpoint (one
``os.preadv`` per extent) when a page-in needs them; ``ReadAhead`` fills shared staging rows with
predicted experts. Read-ahead and parallel reads never change a decision; a read error is sticky
(``DiskReadError`` on every later page-in). docs/disk-tier.md.

Legend: E routed experts, K device slots, R host rows per layer; a logical "row" holds its bytes in
a physical row {name: tensor}, swapped with a staging row when a read-ahead is taken.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from pagedexperts.residency.planner import Load, Residency
from pagedexperts.residency.policies import make_policy
from pagedexperts.stats.tiers import TierStats
from pagedexperts.storage.host_store import ExpertStore, HostExpertStore
from pagedexperts.storage.safetensors_index import DiskReadError, Extent, one_run, read_extent, read_run

READ_WORKERS = 4  # on-demand reads in flight at once (a step's host misses, or one expert's extents)
# Read-ahead pays when most of its reads are used: an unused one costs a read that an on-demand
# miss would not have made. A layer judges its last READ_AHEAD_WINDOW read-aheads; under
# READ_AHEAD_MIN_USED of them used, it pauses for READ_AHEAD_PAUSE steps, then tries again.
READ_AHEAD_WINDOW = 16
READ_AHEAD_MIN_USED = 0.5
READ_AHEAD_PAUSE = 256

logger = logging.getLogger(__name__)


def physical_rows(store: HostExpertStore) -> list[dict[str, torch.Tensor]]:
    """The rows of ``store`` as {name: tensor [*spec.shape]} views, one dict per row."""
    return [{name: t[i] for name, t in store.tensors.items()} for i in range(store.num_experts)]


class ReadAhead:
    """A thread pool and ``num_buffers`` expert-sized staging rows shared by all layers; ``pin``:
    page-locked as the host rows are (a taken read-ahead becomes a host row)."""

    def __init__(self, specs, *, num_buffers: int, pin: bool = False, workers: int = 2,
                 read_workers: int = READ_WORKERS) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedexperts-readahead")
        # on-demand reads: a step's host misses (or one expert's extents) in flight together
        self.extent_pool = ThreadPoolExecutor(max_workers=read_workers, thread_name_prefix="pagedexperts-read")
        self._staging = HostExpertStore(list(specs), num_buffers, pin=pin)  # one allocation, pinned like rows
        self.free = physical_rows(self._staging)
        self.lock = threading.Lock()

    def shutdown(self) -> None:
        """Stop the threads (reads in flight finish first); for a ``ReadAhead`` replaced at load."""
        self.pool.shutdown(wait=True)
        self.extent_pool.shutdown(wait=True)

    def take(self) -> dict | None:
        with self.lock:
            return self.free.pop() if self.free else None

    def give_back(self, buffer: dict) -> None:
        with self.lock:
            self.free.append(buffer)


class TieredExpertStore(ExpertStore):
    """E experts of one MoE layer: R = ``host_rows`` in host rows, all E readable from the checkpoint;
    ``read_ahead`` None: no read-ahead. ValueError: R outside [1, E] (names --host-memory-gb)."""

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
        self._rows = physical_rows(self._host)  # row -> its bytes (a staging row after a swap)
        self.residency = Residency(num_experts, host_rows, make_policy(policy, host_rows))
        self.tier_stats = TierStats()
        self._row_expert = [-1] * host_rows  # expert whose bytes a row holds (-1: none / failed)
        self._row_events: list = [None] * host_rows  # CUDA: last copy out of the row
        self._lent: dict[int, tuple] = {}  # row -> (slot table, slot) that may read it in place
        self._sources: dict[str, list[list[Extent]]] | None = None
        self._check: Callable | None = None  # the stored layout's per-expert check (``use_source``)
        self._checked: set[int] = set()  # experts whose first read passed it
        self._read_ahead = read_ahead
        self._ahead: dict[int, tuple[Future, dict]] = {}
        self._stats_lock = threading.Lock()
        self.failed: DiskReadError | None = None
        self._window = (0, 0)  # (read_ahead_issued, read_ahead_used) when the window began
        self._pause_left = 0  # read_ahead calls still skipped
        self._warned = False

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

    def row_tensors(self, row: int) -> dict[str, torch.Tensor]:
        """The bytes of host row ``row``: {name: [*spec.shape]}."""
        return self._rows[row]

    def reset(self) -> None:
        """Empty host rows and zeroed counters, as after loading."""
        self.residency = Residency(self.num_experts, self.host_rows, make_policy(self.residency.policy.name, self.host_rows))
        self._row_expert = [-1] * self.host_rows
        self.tier_stats = TierStats.carried(len(self._ahead))
        self._window, self._pause_left = (0, 0), 0

    def fill_from(self, extents: dict[str, list[list[Extent]]]) -> list[tuple]:
        """Keep every expert's byte ranges to read on demand; the fill reads nothing into this store."""
        self._sources = extents
        return []

    def copy_to_slot(self, expert: int, slot: int, slots: dict[str, torch.Tensor]) -> None:
        """``copy_to_slots`` of one load."""
        self.copy_to_slots([Load(expert, slot)], slots)

    def copy_to_slots(self, loads, slots) -> int:
        """Page each load's expert into its slot via its host row (claimed in order, host misses read
        together); how many the slots read in place. DiskReadError: the checkpoint could not be read,
        now or earlier."""
        batch: list[tuple[int, int, int, Callable | None]] = []  # (expert, row, slot, what fills the row)
        held = 0
        for load in loads:
            row, fill = self._claim(load.expert)
            if any(row == r for _, r, _, _ in batch):
                held += self._finish(batch, slots)
            batch.append((load.expert, row, load.slot, fill))
        return held + self._finish(batch, slots)

    def _claim(self, expert: int) -> tuple[int, Callable | None]:
        """(host row of ``expert``, None on a host hit else the call filling it: a taken read-ahead or
        a disk read)."""
        if self.failed is not None:
            raise self.failed
        resident, row = self.residency.access(expert)
        hit = resident and self._row_expert[row] == expert  # a row whose read failed holds nothing
        self.tier_stats.record_host_access(hit)
        if hit:
            return row, None
        if self._row_events[row] is not None:
            self._row_events[row].synchronize()  # the row's last copy to the device is done
            self._row_events[row] = None
        self._row_expert[row] = -1
        ahead = self._ahead.pop(expert, None)
        self.tier_stats.read_ahead_held = len(self._ahead)
        if ahead is not None:
            return row, lambda: self._take_read_ahead(row, ahead)
        return row, lambda: self._read(expert, {n: t.view(-1) for n, t in self._rows[row].items()})

    def _finish(self, batch: list, slots) -> int:
        """Fill the batch's rows (its disk reads in parallel), then copy each into its slot (or lend it
        to the slot: ``_copy_row``)."""
        reads = [fill for *_, fill in batch if fill is not None]
        for _, row, _, fill in batch:
            if fill is not None:
                self._release(row)  # here, not at the claim: an earlier batch may have lent the row since
        try:
            if len(reads) > 1 and self._read_ahead is not None:
                for future in [self._read_ahead.extent_pool.submit(fill) for fill in reads]:
                    future.result()
            else:
                for fill in reads:
                    fill()
        except DiskReadError as exc:
            self.failed = exc
            raise
        held = 0
        for expert, row, slot, fill in batch:
            if fill is not None:
                self._row_expert[row] = expert
            held += self._copy_row(row, slot, slots)
        batch.clear()
        return held

    def _copy_row(self, row: int, slot: int, slots) -> bool:
        """Page host row ``row`` into ``slot``: True when the slot reads it in place."""
        if slots.hold_rows(self._rows[row], slot, pinned=self.pinned):  # no copy: lent until ``_release``
            self._lent[row] = (slots, slot)
            return True
        if self.pinned and next(iter(slots.values())).is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            self._row_events[row] = event
        return False

    def _release(self, row: int) -> None:
        """Before ``row``'s bytes are overwritten or handed to the staging pool: a slot still reading
        them in place keeps them, and the row takes that slot's spare bytes instead (no copy)."""
        lent = self._lent.pop(row, None)
        if lent is not None:
            slots, slot = lent
            self._rows[row] = slots.release_rows(self._rows[row], slot)

    def _take_read_ahead(self, row: int, ahead: tuple[Future, dict]) -> None:
        """The staging row becomes host row ``row`` (no copy); the old row joins the staging pool."""
        future, buffer = ahead
        try:
            future.result()
        except BaseException:
            self._read_ahead.give_back(buffer)
            raise
        self._rows[row], old = buffer, self._rows[row]
        self._read_ahead.give_back(old)
        with self._stats_lock:
            self.tier_stats.read_ahead_used += 1
            self.tier_stats.read_ahead_bytes_used += self.expert_bytes

    def read_rows(self, first: int, n: int) -> dict[str, torch.Tensor]:
        """Experts ``first..first+n-1`` read into fresh tensors {name: [n, *spec.shape]};
        DiskReadError."""
        out = {s.name: torch.empty((n, *s.shape), dtype=s.dtype) for s in self.specs}
        for i in range(n):
            self._read(first + i, {name: t[i].view(-1) for name, t in out.items()})
        return out

    def use_source(self, specs, extents: dict[str, list[list[Extent]]], read_ahead: ReadAhead | None, *,
                   check: Callable[[int, list[torch.Tensor]], str | None] | None = None) -> None:
        """Read experts as ``specs`` at ``extents`` from now on (e.g. a stored kernel layout); host
        rows reallocated within the old bytes and emptied. Before any page-in. ``check(expert,
        tensors in spec order)``: why the bytes read are damaged, or None; run on each expert's first
        read (a damaged one raises ``DiskReadError``, sticky)."""
        old_bytes = self.host_bytes
        self.specs = list(specs)
        self.expert_bytes = sum(s.row_bytes for s in self.specs)
        self.host_rows = max(1, min(self.num_experts, old_bytes // self.expert_bytes))
        del self._rows
        self._host = HostExpertStore(self.specs, self.host_rows, pin=self._host.pinned)
        self._rows = physical_rows(self._host)
        self._row_events, self._lent = [None] * self.host_rows, {}  # rows renumbered: none lent
        self._sources, self._read_ahead, self._ahead = extents, read_ahead, {}
        self._check, self._checked = check, set()
        self.reset()

    def _read(self, expert: int, dst: dict[str, torch.Tensor]) -> None:
        """Read ``expert``'s extents into the flat rows ``dst`` (one ``preadv`` for back-to-back
        extents)."""
        if self._sources is None:
            raise DiskReadError(f"layer {self.layer}: the disk tier has no checkpoint attached (loader bug)")
        t0 = time.perf_counter()
        jobs = [(ext.path, (ext, dst[name])) for name, rows in self._sources.items() for ext in rows[expert]]
        jobs.sort(key=lambda j: (str(j[0]), j[1][0].offset))
        in_pool = threading.current_thread().name.startswith("pagedexperts-read")
        contiguous = one_run([job for _, job in jobs])
        if contiguous:
            self._read_run(expert, jobs)
        elif not in_pool and self._read_ahead is not None and len(jobs) > 1:  # one expert: its extents in flight together
            for f in [self._read_ahead.extent_pool.submit(self._read_extent, expert, p, j) for p, j in jobs]:
                f.result()
        else:
            for path, job in jobs:
                self._read_extent(expert, path, job)
        if self._check is not None and expert not in self._checked:
            damage = self._check(expert, [dst[s.name] for s in self.specs])
            if damage is not None:
                raise DiskReadError(f"{damage}; delete it (the next load rebuilds it) or run with --no-stored-layout")
            self._checked.add(expert)
        with self._stats_lock:
            self.tier_stats.record_read(nbytes=sum(job[0].nbytes for _, job in jobs), preads=1 if contiguous else len(jobs),
                                        seconds=time.perf_counter() - t0)

    def _read_run(self, expert: int, jobs) -> None:
        """One ``preadv`` of back-to-back extents (``safetensors_index.one_run``) into their rows."""
        path, (first, _) = jobs[0]
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise DiskReadError(f"cannot read expert {expert} of layer {self.layer} from checkpoint file {path}: {exc}; "
                                "the checkpoint (or its stored kernel layout) must stay in place while the model runs "
                                "(disk tier, --host-memory-gb)") from exc
        try:
            read_run(fd, [job for _, job in jobs])
        except DiskReadError:
            raise
        except OSError as exc:
            raise DiskReadError(f"reading expert {expert} of layer {self.layer} from {path} failed: {exc}") from exc
        finally:
            os.close(fd)

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
        """Read ``experts`` (priority order) in no host row into free staging rows in the background;
        the reads started (0 without read-ahead or while paused)."""
        ra = self._read_ahead
        if ra is None or self.failed is not None:
            return 0
        if self._pause_left > 0:
            self._pause_left -= 1
            self.tier_stats.read_ahead_paused += 1
            return 0
        wanted = set(experts)
        for e, (future, buffer) in list(self._ahead.items()):
            if e not in wanted and future.done():
                del self._ahead[e]
                ra.give_back(buffer)
                with self._stats_lock:
                    self.tier_stats.read_ahead_wasted += 1
                    self.tier_stats.read_ahead_bytes_wasted += self.expert_bytes
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
        self.tier_stats.read_ahead_held = len(self._ahead)
        self._judge_read_ahead()
        return started

    def _judge_read_ahead(self) -> None:
        """Pause READ_AHEAD_PAUSE steps when under READ_AHEAD_MIN_USED of the last READ_AHEAD_WINDOW
        were used."""
        t = self.tier_stats
        if t.read_ahead_issued < self._window[0] or t.read_ahead_used < self._window[1]:
            self._window = (0, 0)  # the counters were zeroed (``reset_stats``): a window starts with them
        issued, used = t.read_ahead_issued - self._window[0], t.read_ahead_used - self._window[1]
        if issued < READ_AHEAD_WINDOW:
            return
        self._window = (t.read_ahead_issued, t.read_ahead_used)
        if used >= READ_AHEAD_MIN_USED * issued:
            return
        self._pause_left = READ_AHEAD_PAUSE
        if not self._warned:
            self._warned = True
            logger.warning("layer %d: read-ahead paused for %d steps: %d of its last %d read-aheads were used "
                           "(under %.0f%%: each unused one is a read that costs disk time); it then tries again "
                           "(--no-read-ahead turns it off)", self.layer, READ_AHEAD_PAUSE, used, issued,
                           100 * READ_AHEAD_MIN_USED)

    def _holds(self, expert: int) -> bool:
        row = self.residency.slot_of_expert.get(expert)
        return row is not None and self._row_expert[row] == expert

