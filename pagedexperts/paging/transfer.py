"""Host <-> device transfers of one paged layer: the step's one read-back (``read_step``), uploads of
host-made index tensors, the expert -> slot map, and page-ins ordered against compute
(docs/design-layer-step.md "How a wave runs"). On CUDA a slot is overwritten only after the compute
that last read it, the next compute waits for every copy into the layer, and nothing synchronizes
the whole device.
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
    """Integer tensors [T, c_i] (or 0-dim) read to the host as int64 in ONE transfer (on CUDA one
    concatenated read into pinned memory: the step's one hard sync; on CPU detached, uncopied)."""
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
    """A step's read-back: ids [T, k] int64, the prefetch prediction [T, k'] or None, padding rows
    (int)."""

    ids: torch.Tensor
    predicted: torch.Tensor | None
    padding: int

    def union(self) -> list[int]:
        """The distinct expert ids of ``ids`` (a set over ``tolist()``: cheaper than ``torch.unique``
        at decode)."""
        if self.ids.numel() <= 4096:
            return list(set(self.ids.reshape(-1).tolist()))
        return torch.unique(self.ids).tolist()


def read_step(top_k_index: torch.Tensor, predicted: torch.Tensor | None = None,
              padding_count: torch.Tensor | None = None) -> StepRead:
    """The step's one read-back of ids [T, k], predicted ids [T, k'] or None and padding (0-dim or
    None)."""
    parts = [top_k_index]
    if predicted is not None:
        parts.append(predicted)
    if padding_count is not None:
        parts.append(padding_count)
    host = read_back(parts)
    padding = int(host[-1]) if padding_count is not None else 0
    return StepRead(host[0], host[1] if predicted is not None else None, padding)


def upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host int64 array as a fresh device tensor without a sync; the caller may mutate ``values`` at
    once."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if device.type == "cpu":
        return host.clone()
    return host.pin_memory().to(device, non_blocking=True)


class CopyTimer:
    """A bounded ring of (start, end) copy timing events: completed pairs fold into ``elapsed_s``
    without waiting; only with ``capacity`` in flight is the oldest waited for. ``make_event`` is
    injectable."""

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
    """Page-in copies into one layer's [K, ...] slot table and their ordering; ``copy_stream`` None on
    CPU."""

    def __init__(self, slots: SlotTable, device: torch.device, copy_stream=None, *, store) -> None:
        self.slots = slots
        self.device = device
        self.copy_stream = copy_stream
        rows = store.rows_in_memory()
        # how a page-in writes its rows, chosen once: the slot table copies a store that holds every
        # row in memory; a store that does not (the disk tier reads first) writes each row itself
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

    def page_in(self, loads, *, now: bool = True) -> int:
        """Copy each load's rows into its slot and record it in the slot map; how many the slots read
        in place instead (no copy; 0 on CUDA). ``now``: the next compute waits for them; False (a
        prefetch): the next ``page_in`` does."""
        if loads:
            for expert, slot in loads:
                self._slot_of[expert] = slot
            self._slot_map_stale = True
            stream = self.copy_stream
            if stream is None:
                t0 = time.perf_counter()
                held = self._copy(loads)
                self.host_copy_s += time.perf_counter() - t0
                return held
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
        return 0

    def slot_map(self, wave, *, only_wave: bool) -> torch.Tensor:
        """The slot map [E] int64 on the device; experts outside the wave map to -1 unless
        ``only_wave``."""
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
        """(page-in s, slot-map s) since the last take; ``block``: on CUDA wait for timings in flight."""
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
