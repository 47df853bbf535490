"""Eviction: the ``EvictionPolicy`` contract, the rank-key bases (``RankedPolicy``,
``HeapRankedPolicy``) and the rules that rank slots by their own history (``LRUPolicy``,
``LFUPolicy``, ``FrequencyLRUPolicy``); standard library only, tensor-free. The rules and their
costs: docs/residency.md. Does not keep the slot map or plan waves (``residency.planner``); the
adaptive policy and the ``--policy`` registry are ``residency.policies``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import Counter, OrderedDict, deque
from typing import Container, Iterable, Sequence

EMPTY = -1  # slot content of a slot that holds no expert yet


class EvictionPolicy:
    """Ranks occupied slots for eviction; tensor-free. Per step the residency calls ``on_step(union)``,
    ``on_hits`` (ascending expert id), then per wave ``victims`` and ``on_loads``. ``victims(n,
    protected, ...)`` must equal n successive ``victim`` calls, each excluding ``protected`` and the
    slots chosen before. Slot ids in [0, K), expert ids in [0, E)."""

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
        """Up to ``count`` slots to evict, in order, among occupied slots not in ``protected``
        (successive ``victim`` calls)."""
        candidates = [s for s in range(self.num_slots) if s not in protected]
        out = []
        for _ in range(min(count, len(candidates))):
            slot = self.victim(candidates, expert_of_slot)
            candidates.remove(slot)
            out.append(slot)
        return out


class LRUPolicy(EvictionPolicy):
    """Least recently used: evict the slot whose expert was routed to longest ago (touched in ascending
    expert id within a step, so plans are deterministic)."""

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
    """A rule given as a rank key per slot, a tuple ending with the slot (ties to the lowest slot):
    evict the lowest. ``victims`` ranks the unprotected slots once per call."""

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
    """A ranked policy whose rank changes only for slots touched (``_touch``) or after ``_rerank_all``:
    a lazily refreshed heap, O(log K) per victim, one O(K) ranking when a call needs K/4 victims or
    more."""

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


class LFUPolicy(HeapRankedPolicy):
    """LFU with aging: evict the resident expert routed to in the fewest steps. Counts survive eviction
    and are halved every ``half_life`` steps (0: never). Ties: least recently used, then lowest
    slot."""

    name = "lfu"
    DEFAULT_HALF_LIFE = 128  # steps; best mean hit rate on the tune halves (bench/policy_eval.py)

    def __init__(self, num_slots: int, *, half_life: int = DEFAULT_HALF_LIFE) -> None:
        super().__init__(num_slots)
        self.half_life = half_life
        self._count: Counter[int] = Counter()
        self._steps = 0
        self._clock = itertools.count(1)
        self._last_use = dict.fromkeys(range(num_slots), 0)  # slot -> clock at its last touch
        # the slots by (last use, slot), oldest first, while known without a sort (after a
        # ranking or a load of all K slots, until the next touch); else None
        self._recency: list[int] | None = list(range(num_slots))

    def on_step(self, union: Sequence[int]) -> None:
        self._steps += 1
        if self.half_life and self._steps % self.half_life == 0:
            self._count = Counter({e: c // 2 for e, c in self._count.items() if c > 1})
            self._rerank_all()
        self._count.update(union)  # +1 for each expert of the union (distinct ids), in C

    def on_access(self, slot: int, expert: int) -> None:
        self._last_use[slot] = next(self._clock)
        self._touched.add(slot)
        self._recency = None

    on_load = on_access

    def on_hits(self, slots: Sequence[int], experts: Sequence[int]) -> None:
        self._last_use.update(zip(slots, self._clock))
        self._touched.update(slots)
        self._recency = None

    def on_loads(self, slots: Sequence[int], experts: Sequence[int]) -> None:
        self._last_use.update(zip(slots, self._clock))
        self._touched.update(slots)
        # a wave that refills every slot leaves them in its load order, oldest first
        self._recency = list(slots) if len(slots) == self.num_slots else None

    def rank(self, slot: int, expert_of_slot: Sequence[int]) -> tuple:
        return (self._count.get(expert_of_slot[slot], 0), self._last_use[slot], slot)

    def _rank_victims(self, count: int, protected: Container[int], expert_of_slot: Sequence[int]) -> list[int]:
        # the unprotected slots by (count, last use, slot): two stable sorts with C key functions,
        # the first skipped while the recency order is known (the waves of a step after the first)
        recency = self._recency
        if recency is not None:
            slots = list(itertools.filterfalse(protected.__contains__, recency)) if protected else recency
        elif protected:  # the first wave of a step, after its hits: few slots left to rank
            slots = sorted(itertools.filterfalse(protected.__contains__, range(self.num_slots)),
                           key=self._last_use.__getitem__)
        else:
            slots = self._recency = sorted(range(self.num_slots), key=self._last_use.__getitem__)
        counts = list(map(self._count.__getitem__, expert_of_slot))  # by slot; a Counter: 0 if unseen
        slots = sorted(slots, key=counts.__getitem__)
        return slots if count >= len(slots) else slots[:count]

    def _keys(self, slots: Iterable[int], expert_of_slot: Sequence[int]) -> list[tuple]:
        slots = list(slots)  # the ranks of rank(), built in C
        counts = map(self._count.get, map(expert_of_slot.__getitem__, slots), itertools.repeat(0))
        return list(zip(counts, map(self._last_use.__getitem__, slots), slots))


class FrequencyLRUPolicy(RankedPolicy):
    """Frequency-weighted LRU: evict the lowest ``uses / (age + 1)`` (``uses``: steps that routed to
    the expert since its load; ``age``: steps since its last use). Equal uses: exactly LRU. Ties:
    least recently used, then lowest slot."""

    name = "flru"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._steps = 0
        self._uses = [0] * num_slots
        self._last_step = [0] * num_slots
        self._clock = itertools.count(1)
        self._last_use = [0] * num_slots

    def on_step(self, union: Sequence[int]) -> None:
        self._steps += 1

    def on_access(self, slot: int, expert: int) -> None:
        self._uses[slot] += 1
        self._last_step[slot] = self._steps
        self._last_use[slot] = next(self._clock)

    def on_load(self, slot: int, expert: int) -> None:
        self._uses[slot] = 1
        self._last_step[slot] = self._steps
        self._last_use[slot] = next(self._clock)

    def rank(self, slot: int, expert_of_slot: Sequence[int]) -> tuple:
        return (self._uses[slot] / (self._steps - self._last_step[slot] + 1), self._last_use[slot], slot)


# consume(iterator): run an iterator of side effects to the end in C (the planner's bulk
# slot-map updates); a partial, not a def, so a call adds no Python frame (~0.1 us, twice a wave)
consume = functools.partial(deque, maxlen=0)
