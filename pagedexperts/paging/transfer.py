"""Host <-> device transfers of one paged layer: the one read-back, uploads, page-ins in order.

Owns: the single device-to-host transfer of a layer-step (``read_step``: the top-k ids, the
prefetch prediction and the step's padding count in one read into pinned memory, parsed once),
host-to-device uploads of small host-made index tensors (slot map, a wave's rows) from pinned
buffers, the running expert -> slot map on the device, and, on CUDA, the ordering of page-in
copies on the copy stream against the compute stream:

- a page-in's copies wait for every compute issued before them (the ``compute_done`` event,
  recorded on the compute stream as the page-in is issued), so a slot is overwritten only after
  the compute that last read it, and fresh slots only after their zero fill;
- every copy issued into a layer (its own page-ins and the previous layer's prefetches) is
  waited on by that layer's next compute (``copied`` event, ``page_in``);
- the slot tensors are ``record_stream``-ed on the copy stream, and ``drain`` waits for in-flight
  copies before a runner is dropped (``loading.runners.repage``), so no freed block is reused
  under a copy.

A page-in is one call (``SlotTransfers.page_in``). How its rows get into the slots is chosen once
per layer: from a store that holds every row in host memory the slot table copies them itself
(``formats.slots.SlotTable.copy_rows``: the plain table one tensor at a time, a table that
dequantizes or repacks through its ``write_rows``); a store that does not (the disk tier reads
its misses first) hands each row to the table
(``storage.host_store.ExpertStore.copy_to_slots``, which calls the table's ``write_rows``).

Page-in times on CUDA come from a bounded ring of timing events (``CopyTimer``), folded in as
they complete; nothing here synchronizes the whole device. Does not: choose what to copy
(``residency``) or compute anything (``paging.steps``).

Legend: T tokens of a step, k top_k, E experts, K slots.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from pagedexperts.formats.slots import SlotTable

COPY_TIMER_EVENTS = 64  # timing event pairs kept per layer before the oldest must be folded


def read_back(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Read integer tensors [T, c_i] (or 0-dim ones) to the host in ONE device-to-host transfer:
    one host tensor per part, int64, in the parts' own shapes (a 0-dim part of an empty step
    reads as 0).

    On CUDA the parts are concatenated along dim 1 (0-dim ones broadcast to [T, 1]) and read
    into pinned memory, waiting for the current stream once (the one hard sync of a
    layer-step); the results are views of that buffer. On CPU the parts already are host
    memory: they are returned detached, with no copy and no concatenation.
    """
    if parts[0].device.type == "cpu":
        return tuple(p.detach().to(torch.int64) for p in parts)
    rows = parts[0].shape[0]
    cols = [p if p.dim() == 2 else p.reshape(1, 1).expand(rows, 1) for p in parts]
    flat = torch.cat([c.to(torch.int64) for c in cols], dim=1) if len(cols) > 1 else cols[0].to(torch.int64)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    torch.cuda.current_stream(flat.device).synchronize()
    out, start = [], 0
    for part, col in zip(parts, cols):
        width = col.shape[1]
        if part.dim() == 2:
            out.append(host[:, start:start + width])
        else:
            out.append(host[0, start] if rows else torch.zeros((), dtype=torch.int64))
        start += width
    return tuple(out)


class StepRead(NamedTuple):
    """One layer-step's read-back, on the host: top-k ids [T, k] (int64), the prefetch
    prediction [T, k'] or None, and the step's padding rows (0 without a padding count)."""

    ids: torch.Tensor
    predicted: torch.Tensor | None
    padding: int

    def union(self) -> list[int]:
        """The step's union: the distinct expert ids of ``ids``, as a Python list (any order).

        A set over ``tolist()`` is several times cheaper than ``torch.unique`` for decode-sized
        steps; ``torch.unique`` wins for large prefills.
        """
        if self.ids.numel() <= 4096:
            return list(set(self.ids.reshape(-1).tolist()))
        return torch.unique(self.ids).tolist()


def read_step(top_k_index: torch.Tensor, predicted: torch.Tensor | None = None,
              padding_count: torch.Tensor | None = None) -> StepRead:
    """The step's one device-to-host transfer (``read_back``) of the top-k ids [T, k], the
    next layer's predicted ids [T, k'] (or None) and the padding rows (0-dim, or None), parsed.
    Every runner reads its step through here (the executors and the baselines)."""
    parts = [top_k_index]
    if predicted is not None:
        parts.append(predicted)
    if padding_count is not None:
        parts.append(padding_count)
    host = read_back(parts)
    padding = int(host[-1]) if padding_count is not None else 0
    return StepRead(host[0], host[1] if predicted is not None else None, padding)


def upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array (int64) as a fresh device tensor, without a device sync.

    On CUDA the values are first copied into a pinned block of torch's caching host allocator,
    which keeps the block from reuse until the non-blocking copy has run, so the caller may
    mutate ``values`` at once. On CPU: a copy (the caller may mutate ``values``).
    """
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if device.type == "cpu":
        return host.clone()
    return host.pin_memory().to(device, non_blocking=True)


class CopyTimer:
    """A bounded ring of (start, end) timing events around copy batches on the copy stream.

    ``begin``/``end`` bracket one batch; completed pairs are folded into ``elapsed_s`` as new
    ones are taken (``query``, no wait); only when ``capacity`` pairs are still in flight is the
    oldest waited for (its own event, never the whole device). ``make_event`` is injectable so
    the bookkeeping is testable without CUDA.
    """

    def __init__(self, make_event: Callable[[], object], capacity: int = COPY_TIMER_EVENTS) -> None:
        self._make_event = make_event
        self._free: list[tuple] = []
        self._in_flight: deque[tuple] = deque()
        self._open: tuple | None = None
        self.capacity = capacity
        self.created = 0
        self.elapsed_s = 0.0

    def begin(self, stream) -> None:
        self._fold(block=len(self._in_flight) >= self.capacity)
        if self._free:
            pair = self._free.pop()
        else:
            pair = (self._make_event(), self._make_event())
            self.created += 2
        pair[0].record(stream)
        self._open = pair

    def end(self, stream) -> None:
        pair, self._open = self._open, None
        pair[1].record(stream)
        self._in_flight.append(pair)

    def collect(self) -> float:
        """Wait for every in-flight pair (their end events only); return and reset the total."""
        while self._in_flight:
            self._fold(block=True)
        out, self.elapsed_s = self.elapsed_s, 0.0
        return out

    def _fold(self, *, block: bool) -> None:
        while self._in_flight:
            start, end = self._in_flight[0]
            if block:
                end.synchronize()
                block = False
            elif not end.query():
                return
            self.elapsed_s += start.elapsed_time(end) / 1e3
            self._free.append(self._in_flight.popleft())


class SlotTransfers:
    """Page-in copies into one layer's [K, ...] slots and their ordering (see module docstring).

    Args:
        slots: the slot table (``formats.slots.SlotTable``), name -> [K, ...] slot tensor on
            ``device`` (just allocated).
        device: the slots' device.
        copy_stream: CUDA stream for page-ins, or None (CPU: copies are synchronous memcpys).
        store: the layer's host store (``storage.host_store.ExpertStore``) the rows come from.
    """

    def __init__(self, slots: SlotTable, device: torch.device, copy_stream=None, *, store) -> None:
        self.slots = slots
        self.device = device
        self.copy_stream = copy_stream
        rows = store.rows_in_memory()
        # how a page-in writes its rows, chosen once (module docstring): loads -> None
        self._copy = (functools.partial(slots.copy_rows, rows, pinned=store.pinned) if rows is not None
                      else functools.partial(store.copy_to_slots, slots=slots))
        # expert -> slot at its last page-in (plan or prefetch): exact for every resident
        # expert, stale for evicted ones, which a single-wave step never looks up. Mirrored on
        # the device in _slot_map (uploaded when _slot_map_stale).
        self._slot_of = np.full(store.num_experts, -1, dtype=np.int64)
        self._slot_map: torch.Tensor | None = None
        self._slot_map_stale = True
        self.map_s = 0.0  # host seconds spent on slot maps since the last take_times
        self.timer = None
        self._compute_done = self._copied = None
        self._copy_pending = False
        self.host_copy_s = 0.0  # CPU: seconds of synchronous page-in copies since last take
        if copy_stream is not None:
            for t in slots.values():
                t.record_stream(copy_stream)
            self._compute_done = torch.cuda.Event()
            self._copied = torch.cuda.Event()
            self.timer = CopyTimer(lambda: torch.cuda.Event(enable_timing=True))

    def page_in(self, loads, *, now: bool = True) -> None:
        """Copy each load's (``residency.planner.Load``: expert, slot) rows into its slot and
        note the placements in the running expert -> slot map. On CUDA the copies run on the
        copy stream after every compute issued before them (so after the compute that last read
        the slots, and after their zero fill). ``now``: the compute stream
        waits for them (and for every earlier copy into these slots, e.g. the previous layer's
        prefetch) before its next kernel, a wave's page-in; False: at the next ``page_in``, a
        prefetch. On CPU the copies are synchronous memcpys, timed on the host."""
        if loads:
            for expert, slot in loads:
                self._slot_of[expert] = slot
            self._slot_map_stale = True
            stream = self.copy_stream
            if stream is None:
                t0 = time.perf_counter()
                self._copy(loads)
                self.host_copy_s += time.perf_counter() - t0
                return
            self._compute_done.record(torch.cuda.current_stream(self.device))
            stream.wait_event(self._compute_done)
            with torch.cuda.stream(stream):
                self.timer.begin(stream)
                self._copy(loads)
                self.timer.end(stream)
                self._copied.record(stream)
            self._copy_pending = True
        if now and self._copy_pending:
            torch.cuda.current_stream(self.device).wait_event(self._copied)
            self._copy_pending = False

    def slot_map(self, wave, *, only_wave: bool) -> torch.Tensor:
        """The slot map [E] (int64, on the device) that the wave's top-k ids are remapped with.
        ``only_wave``: the step has this one wave, so every routed expert is resident and the
        running map serves as is (uploaded only when it changed); otherwise experts outside
        the wave map to -1."""
        t0 = time.perf_counter()
        if only_wave:
            if self._slot_map_stale:
                self._slot_map = upload(self._slot_of, self.device)
                self._slot_map_stale = False
            slot_map = self._slot_map
        else:
            slot_of = np.full(len(self._slot_of), -1, dtype=np.int64)
            slot_of[list(wave.experts)] = wave.slots
            slot_map = upload(slot_of, self.device)
        self.map_s += time.perf_counter() - t0
        return slot_map

    def take_times(self, *, block: bool) -> tuple[float, float]:
        """(page-in seconds, slot-map seconds) since the last take. Page-ins: host-timed copies on
        CPU; on CUDA the completed timing pairs (``block``: wait for all in flight first, per
        event). Slot maps: host seconds (part of the step's plan time)."""
        map_s, self.map_s = self.map_s, 0.0
        if self.timer is None:
            out, self.host_copy_s = self.host_copy_s, 0.0
            return out, map_s
        if block:
            return self.timer.collect(), map_s
        self.timer._fold(block=False)
        out, self.timer.elapsed_s = self.timer.elapsed_s, 0.0
        return out, map_s

    def drain(self) -> None:
        """Wait for copies in flight into these slots (before the slots are dropped)."""
        if self.copy_stream is not None:
            self._copied.synchronize()  # returns at once if never recorded
