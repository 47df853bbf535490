"""The eviction-policy contract and the rules the others are built from (standard library only).

Owns: ``EvictionPolicy`` (the hooks the residency calls per step, hit and load, and ``victims``,
the slots a wave's misses take), ``LRUPolicy`` (the planner's default), the rank-key bases
(``RankedPolicy``: one ranking per wave; ``HeapRankedPolicy``: a lazily refreshed heap, O(log K)
per victim), ``EMPTY`` and ``consume``. Does not: keep the expert <-> slot map or plan waves
(``residency.planner``); the other rules and the ``--policy`` registry are ``residency.policies``,
Belady's offline bound ``residency.belady``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import OrderedDict, deque
from typing import Container, Iterable, Sequence

EMPTY = -1  # slot content of a slot that holds no expert yet


class EvictionPolicy:
    """Base class of eviction policies: ranks occupied slots for eviction; tensor-free.

    The residency calls ``on_step`` once per step with the step's union before planning,
    ``on_hits`` with the resident experts the step routes to (ascending expert id), and, per
    wave, ``victims`` for the slots its misses need (once the empty slots are used up), then
    ``on_loads`` with the (slot, expert) placements. ``victims(n, protected, ...)`` must equal
    n successive ``victim`` calls, each over the slots not in ``protected`` nor chosen before,
    so a placement may change the rank of the slot it fills only (true of every rule here).
    Subclasses override ``victim`` (the rule) and, for speed, ``victims`` and the hooks.
    Slot ids are ints in [0, K); expert ids ints in [0, E).
    """

    name = "base"

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots

    def on_step(self, union: Sequence[int]) -> None:
        """Called once per step, before planning, with the step's sorted union of experts."""

    def on_access(self, slot: int, expert: int) -> None:
        """A resident expert in ``slot`` is routed to this step (a hit)."""

    def on_load(self, slot: int, expert: int) -> None:
        """``expert`` was just placed in ``slot`` (a miss)."""

    def on_hits(self, slots: Sequence[int], experts: Sequence[int]) -> None:
        """``on_access`` for each (slot, expert) pair, in order."""
        for slot, expert in zip(slots, experts):
            self.on_access(slot, expert)

    def on_loads(self, slots: Sequence[int], experts: Sequence[int]) -> None:
        """``on_load`` for each (slot, expert) pair, in order."""
        for slot, expert in zip(slots, experts):
            self.on_load(slot, expert)

    def victim(self, candidates: Sequence[int], expert_of_slot: Sequence[int]) -> int:
        """Return the slot to evict among ``candidates`` (non-empty, all occupied)."""
        raise NotImplementedError

    def victims(self, count: int, protected: Container[int], expert_of_slot: Sequence[int]) -> list[int]:
        """Up to ``count`` slots to evict, in eviction order, among slots not in ``protected``
        (all occupied): successive ``victim`` calls, each without the slots chosen before."""
        candidates = [s for s in range(self.num_slots) if s not in protected]
        out = []
        for _ in range(min(count, len(candidates))):
            slot = self.victim(candidates, expert_of_slot)
            candidates.remove(slot)
            out.append(slot)
        return out


class LRUPolicy(EvictionPolicy):
    """Least recently used: evict the slot whose expert was routed to longest ago.

    The slots are kept in an ordered map, least recent first (fresh slots in ascending id);
    every access or load moves a slot to the end. Within a step, experts are touched in
    ascending expert id, so plans are deterministic. ``victims`` reads the front: O(1) per
    victim plus the protected slots it skips (the wave's own, the most recent: none in practice).
    """

    name = "lru"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._order = OrderedDict.fromkeys(range(num_slots))  # least recent first

    def on_access(self, slot: int, expert: int) -> None:
        self._order.move_to_end(slot)

    on_load = on_access

    def on_hits(self, slots: Sequence[int], experts: Sequence[int]) -> None:
        consume(map(self._order.move_to_end, slots))

    on_loads = on_hits

    def victim(self, candidates: Sequence[int], expert_of_slot: Sequence[int]) -> int:
        allowed = set(candidates)
        return next(s for s in self._order if s in allowed)

    def victims(self, count: int, protected: Container[int], expert_of_slot: Sequence[int]) -> list[int]:
        return list(itertools.islice(itertools.filterfalse(protected.__contains__, self._order), max(count, 0)))


class RankedPolicy(EvictionPolicy):
    """A policy whose rule is a rank key per slot: evict the lowest ``rank(slot, ...)``, a
    tuple that ends with the slot (so keys are distinct and ties go to the lowest slot).

    ``victims`` here ranks every unprotected slot once per call: O(K) per wave, not per miss.
    Subclasses may override ``_keys`` (the ranks of many slots) with a faster equivalent.
    """

    def rank(self, slot: int, expert_of_slot: Sequence[int]) -> tuple:
        raise NotImplementedError

    def _keys(self, slots: Iterable[int], expert_of_slot: Sequence[int]) -> list[tuple]:
        rank = self.rank
        return [rank(s, expert_of_slot) for s in slots]

    def victim(self, candidates: Sequence[int], expert_of_slot: Sequence[int]) -> int:
        return min(self._keys(candidates, expert_of_slot))[-1]

    def victims(self, count: int, protected: Container[int], expert_of_slot: Sequence[int]) -> list[int]:
        keys = self._keys(itertools.filterfalse(protected.__contains__, range(self.num_slots)), expert_of_slot)
        keys.sort()
        return [key[-1] for key in keys[:max(count, 0)]]


class HeapRankedPolicy(RankedPolicy):
    """A ranked policy whose rank changes only for slots it is told about: a slot touched by
    ``on_access``/``on_load`` (subclasses call ``_touch``), or every slot after ``_rerank_all``.

    Keeps a heap of rank keys, refreshed lazily: touched slots are re-pushed when victims are
    next asked for (a hit costs O(1) until then), outdated keys are dropped as they surface.
    A few victims cost O(log K) each. When a call needs at least K/4 victims, or K/4 slots were
    touched since the last call, the unprotected slots are ranked at once instead (one O(K)
    pass, paid for by those victims or hits), so no miss costs O(K): ``_rank_victims``, which
    subclasses may override with a faster equivalent.
    """

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._heap: list[tuple] = []
        self._touched: set[int] = set()
        self._stale = True  # every key may be outdated: rebuild before the next use

    def _touch(self, slot: int) -> None:
        self._touched.add(slot)

    def _rerank_all(self) -> None:
        self._stale = True

    def victims(self, count: int, protected: Container[int], expert_of_slot: Sequence[int]) -> list[int]:
        if count <= 0:
            return []
        k, heap = self.num_slots, self._heap
        if 4 * count >= k or 4 * len(self._touched) >= k:  # rank the unprotected slots once
            self._stale = True
            self._touched.clear()
            return self._rank_victims(count, protected, expert_of_slot)
        if self._stale or len(heap) > 4 * k:  # rebuilt also when outdated keys pile up
            heap[:] = self._keys(range(k), expert_of_slot)
            heapq.heapify(heap)
            self._touched.clear()
            self._stale = False
        else:
            for key in self._keys(self._touched, expert_of_slot):
                heapq.heappush(heap, key)
            self._touched.clear()
        rank, out, kept, seen = self.rank, [], [], set()
        while heap and len(out) < count:
            key = heapq.heappop(heap)
            s = key[-1]
            if s in seen or key != rank(s, expert_of_slot):
                continue  # outdated (the slot's current key was pushed when it was touched) or a twin
            seen.add(s)
            (kept if s in protected else out).append(key)
        for key in kept:
            heapq.heappush(heap, key)
        return [key[-1] for key in out]  # popped: re-pushed when they are loaded (touched)

    _rank_victims = RankedPolicy.victims  # every unprotected slot ranked at once, O(K)


# consume(iterator): run an iterator of side effects to the end in C (the planner's bulk
# slot-map updates); a partial, not a def, so a call adds no Python frame (~0.1 us, twice a wave)
consume = functools.partial(deque, maxlen=0)
