"""Eviction policies beyond LRU and the ``--policy`` registry (standard library only).

Owns: LFU with aging, frequency-weighted LRU and the adaptive policy (ghost residencies of the
candidate rules, run by the same planner), ``POLICIES``, ``DEFAULT_POLICY`` and ``make_policy``.
The contract and the LRU and rank-key bases are ``residency.policy``. Does not: keep the slot
map or plan waves (``residency.planner``).
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Container, Iterable, Sequence

from pagedexperts.residency.planner import Residency
from pagedexperts.residency.policy import EvictionPolicy, HeapRankedPolicy, LRUPolicy, RankedPolicy


class LFUPolicy(HeapRankedPolicy):
    """Least frequently used, with aging: evict the resident expert routed to in the fewest steps.

    Each expert (resident or not: the count survives eviction, so a popular expert evicted once
    comes back with its history) has a count, +1 for every step whose union holds it. Every
    ``half_life`` steps all counts are halved (integer floor), so the counts follow a drifting
    working set; ``half_life=0`` never ages. Ties: least recently used, then lowest slot.
    A resident expert's count changes only in a step that routes to it (a hit, so its slot is
    touched) or at aging (every slot re-ranked): the lazy heap of ``HeapRankedPolicy`` holds.
    """

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
    """Frequency-weighted LRU: recency, stretched by how often the expert was used while resident.

    A slot's keep-score is ``uses / (age + 1)``: ``uses`` the steps that routed to its expert
    since it was loaded (1 at load; reset when the slot is refilled, like a cache entry's hit
    counter), ``age`` the steps since its last use. Evict the lowest score: an expert used once
    and idle for 3 steps (1/4) goes before one used 8 times and idle for 9 (8/10). With every
    ``uses`` equal it is exactly LRU. Ties: least recently used, then lowest slot. Simple by
    intent (an exact ratio, no tuned constant). Every score changes with the step count, so
    ``victims`` ranks the unprotected slots once per wave (``RankedPolicy``).
    """

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


class AdaptivePolicy(EvictionPolicy):
    """Adaptive: per layer, follow whichever of several eviction rules is winning right now.

    Each candidate rule (``CANDIDATES``: LRU, LFU with a short and a long half-life) runs a
    ghost residency of K slots on the same routing (expert ids only, no bytes) and earns the hits
    it would have had, in an exponentially decaying window (``window`` steps). The real slots
    are ranked by the current leader; each rule also keeps its own state over the real slots, so
    switching leaders is instant. Ties between rules go to the earlier in ``CANDIDATES``, so
    with no evidence (and whenever recency wins) it is LRU. Layers differ (deep layers reuse
    more, layer 0 the least) and so do workloads; one fixed rule cannot suit all of them.
    Cost: one extra ``Residency.plan`` per rule per layer per step, without its wave records.
    """

    name = "adaptive"
    CANDIDATES: tuple[tuple[str, dict], ...] = (
        ("lru", {}),
        ("lfu", {"half_life": 16}),
        ("lfu", {"half_life": 128}),
    )
    DEFAULT_WINDOW = 64  # steps; tuned on the tune half of the traces (bench/policy_eval.py)

    def __init__(self, num_slots: int, *, window: int = DEFAULT_WINDOW) -> None:
        super().__init__(num_slots)
        self.decay = 1.0 - 1.0 / window
        self._rules = [POLICIES[n](num_slots, **kw) for n, kw in self.CANDIDATES]
        self._ghosts = [Residency(_ANY_EXPERT, num_slots, POLICIES[n](num_slots, **kw)) for n, kw in self.CANDIDATES]
        self._score = [0.0] * len(self._rules)
        self.leader = 0

    def on_step(self, union: Sequence[int]) -> None:
        # The leader is chosen from the steps before this one, then the ghosts see this step.
        best = max(self._score)
        self.leader = self._score.index(best)
        for i, ghost in enumerate(self._ghosts):
            self._score[i] = self._score[i] * self.decay + ghost.replay_step(union)
        for rule in self._rules:
            rule.on_step(union)

    def on_access(self, slot: int, expert: int) -> None:
        for rule in self._rules:
            rule.on_access(slot, expert)

    def on_load(self, slot: int, expert: int) -> None:
        for rule in self._rules:
            rule.on_load(slot, expert)

    def on_hits(self, slots: Sequence[int], experts: Sequence[int]) -> None:
        for rule in self._rules:
            rule.on_hits(slots, experts)

    def on_loads(self, slots: Sequence[int], experts: Sequence[int]) -> None:
        for rule in self._rules:
            rule.on_loads(slots, experts)

    def victim(self, candidates: Sequence[int], expert_of_slot: Sequence[int]) -> int:
        return self._rules[self.leader].victim(candidates, expert_of_slot)

    def victims(self, count: int, protected: Container[int], expert_of_slot: Sequence[int]) -> list[int]:
        return self._rules[self.leader].victims(count, protected, expert_of_slot)


_ANY_EXPERT = 1 << 30  # E of a ghost residency: ids are checked by the real one

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "flru": FrequencyLRUPolicy,
    "adaptive": AdaptivePolicy,
}
DEFAULT_POLICY = "lfu"  # the --policy default: best measured (bench/policy_eval.py, issue 8)


def make_policy(name: str, num_slots: int) -> EvictionPolicy:
    """Build the eviction policy called ``name`` for ``num_slots`` slots.

    Raises:
        ValueError: unknown name; the message lists the valid ``--policy`` choices.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)} (--policy)"
        ) from None
    return cls(num_slots)
