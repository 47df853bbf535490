"""Residency: one MoE layer's expert <-> slot map, its eviction policy, the one check of K, and the
planner that turns a step's union of routed experts into waves of at most K experts with their loads
(hits first, then misses; a miss's victim is never a slot of the current wave). Tensor-free
(standard library only): the runtime and the trace simulator run this same code, so their counts
cannot drift. Costs: docs/residency.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

from pagedexperts.residency.eviction import EMPTY, EvictionPolicy, LFUPolicy, consume


class Load(NamedTuple):
    """One page-in: expert ``expert``'s rows from the host store into slot ``slot``."""

    expert: int
    slot: int


class Wave(NamedTuple):
    """Experts computed together: ``experts[i]`` sits in ``slots[i]`` once ``loads`` (the pairs to page
    in first) are done."""

    experts: tuple[int, ...]
    slots: tuple[int, ...]
    loads: tuple[Load, ...]


class StepPlan(NamedTuple):
    """One layer's plan for one step: waves in order and the step's hits and misses (one per distinct
    routed expert, docs/design.md "Terms")."""

    waves: tuple[Wave, ...]
    hits: int
    misses: int

    @property
    def union_size(self) -> int:
        return self.hits + self.misses

    @property
    def loads(self) -> tuple[Load, ...]:
        return tuple(itertools.chain.from_iterable(w.loads for w in self.waves))


def _loads(experts: Sequence[int], slots: Sequence[int]) -> tuple[Load, ...]:
    """Load records for (expert, slot) pairs, built in C (a Python ``Load(...)`` per miss costs ~0.3
    us)."""
    return tuple(map(tuple.__new__, itertools.repeat(Load), zip(experts, slots)))


DEFAULT_RESIDENT_FRACTION = 0.25  # default K = E / 4 (at least top_k)


def default_num_resident(*, num_experts: int, top_k: int) -> int:
    """K when none is given: max(top_k, E x DEFAULT_RESIDENT_FRACTION)."""
    return max(top_k, int(num_experts * DEFAULT_RESIDENT_FRACTION))


def num_resident_problem(num_resident: int, *, num_experts: int, min_slots: int,
                         flag: str = "--num-resident") -> str | None:
    """Why K = ``num_resident`` slots cannot page E experts with ``min_slots`` per token, or None when
    min_slots <= K <= E."""
    if num_resident < min_slots:
        if min_slots == 1:
            return f"{flag} K={num_resident} must be in [1, E={num_experts}]; raise {flag}"
        return (f"{flag} K={num_resident} is below top_k={min_slots}: one token routes to "
                f"{min_slots} experts, so at least {min_slots} slots are needed; raise {flag}")
    if num_resident > num_experts:
        return (f"{flag} K={num_resident} exceeds the E={num_experts} routed experts per "
                f"layer; use {flag} {num_experts} (all resident) or less")
    return None


def check_num_resident(num_resident: int, *, num_experts: int, min_slots: int, flag: str = "--num-resident") -> int:
    """``num_resident`` when min_slots <= K <= E: the one K check (runtime, loader, simulator).
    ValueError naming ``flag`` otherwise."""
    problem = num_resident_problem(num_resident, num_experts=num_experts, min_slots=min_slots, flag=flag)
    if problem is not None:
        raise ValueError(problem)
    return num_resident


def begin_step(policy, union, hits_of):
    """The start of a step, one rule for ``Residency`` and the device decide
    (``paging.kernels.decide``, with tensor hooks): ``policy.on_step(union)``; the union's resident
    experts and their slots (``hits_of``, ascending id, before any miss is placed);
    ``policy.on_hits``. Returns (hits, hit_slots)."""
    policy.on_step(union)
    hits, hit_slots = hits_of(union)
    policy.on_hits(hit_slots, hits)
    return hits, hit_slots


@dataclass
class Residency:
    """The slot map of one MoE layer plus its policy (None: ``LFUPolicy``, the ``--policy`` default; a test
    holds the two equal); plans each step's waves. ValueError: K outside [1, E] (names --num-resident)."""

    num_experts: int
    num_slots: int
    policy: EvictionPolicy | None = None
    expert_of_slot: list[int] = field(init=False)
    slot_of_expert: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        check_num_resident(self.num_slots, num_experts=self.num_experts, min_slots=1)
        if self.policy is None:
            self.policy = LFUPolicy(self.num_slots)
        self.expert_of_slot = [EMPTY] * self.num_slots
        self._filled = 0  # slots [0, filled) hold an expert
        self.slot_of_expert = {}

    def plan(self, routed: Iterable[int]) -> StepPlan:
        """Plan one step: the union of ``routed`` ids -> waves of at most K, hits first, then misses in
        ascending id, each taking an empty slot (lowest first) or the policy's victim outside the
        current wave. Updates the map and policy. ValueError: an id outside [0, E)."""
        union = sorted(set(routed))
        if union and (union[0] < 0 or union[-1] >= self.num_experts):
            bad = union[0] if union[0] < 0 else union[-1]
            raise ValueError(f"routed expert id {bad} outside [0, E={self.num_experts})")
        hits, hit_slots = begin_step(self.policy, union, self._hits_of)
        if len(hits) == len(union) and hits:  # the common decode case: one wave, nothing to load
            return StepPlan((Wave(tuple(hits), tuple(hit_slots), ()),), len(hits), 0)
        misses = list(itertools.filterfalse(self.slot_of_expert.__contains__, union))
        place, new_wave, waves = self._place, tuple.__new__, []  # Wave(...) would add a Python call
        if union and len(union) <= self.num_slots:  # one wave: what ``_waves`` yields, without its generator
            slots = place(misses, hit_slots)
            wave = new_wave(Wave, (tuple(hits + misses), tuple(hit_slots + slots), _loads(misses, slots)))
            return StepPlan(waves=(wave,), hits=len(hits), misses=len(misses))
        for wave_hits, wave_hit_slots, wave_misses in self._waves(hits, hit_slots, misses):
            slots = place(wave_misses, wave_hit_slots)
            waves.append(new_wave(Wave, (tuple(wave_hits + wave_misses), tuple(wave_hit_slots + slots),
                                         _loads(wave_misses, slots))))
        return StepPlan(waves=tuple(waves), hits=len(hits), misses=len(misses))

    def access(self, expert: int) -> tuple[bool, int]:
        """One expert as a one-expert step (e.g. the disk tier's host rows): (was resident, its slot).
        State changes as ``plan``'s."""
        plan = self.plan((expert,))
        return plan.hits == 1, plan.waves[0].slots[0]

    def replay_step(self, union: Sequence[int]) -> int:
        """``plan`` without wave records, for a ghost residency (``union`` sorted, distinct, in range:
        unchecked); returns the hits."""
        hits, hit_slots = self._begin_step(union)
        if len(hits) < len(union):
            misses = list(itertools.filterfalse(self.slot_of_expert.__contains__, union))
            for _, wave_hit_slots, wave_misses in self._waves(hits, hit_slots, misses):
                self._place(wave_misses, wave_hit_slots)
        return len(hits)

    def _begin_step(self, union: Sequence[int]) -> tuple[list[int], list[int]]:
        return begin_step(self.policy, union, self._hits_of)

    def _hits_of(self, union: Sequence[int]) -> tuple[list[int], list[int]]:
        """The union's resident experts (ascending id) and their slots."""
        resident = self.slot_of_expert
        hits = list(filter(resident.__contains__, union))
        return hits, list(map(resident.__getitem__, hits))

    def _waves(self, hits: list[int], hit_slots: list[int], misses: list[int]):
        """Hits + misses in waves of at most K: (hits, their slots, misses); hits come first, so no
        wave evicts a later wave's hit."""
        k, num_hits = self.num_slots, len(hits)
        only_hits = num_hits - num_hits % k  # hits in waves without misses
        for i in range(0, only_hits, k):
            yield hits[i:i + k], hit_slots[i:i + k], []
        first = 0  # misses in the wave of the remaining hits
        if num_hits > only_hits:
            first = k - (num_hits - only_hits)
            yield hits[only_hits:], hit_slots[only_hits:], misses[:first]
        for i in range(first, len(misses), k):
            yield [], [], misses[i:i + k]

    def _place(self, experts: list[int], protected: list[int]) -> list[int]:
        """Slots for ``experts`` (not resident): empty first (lowest id), then victims outside
        ``protected`` and this call; shorter if slots run out."""
        if not experts:
            return []
        eos, soe, n, free = self.expert_of_slot, self.slot_of_expert, len(experts), self.num_slots - self._filled
        if free <= 0:  # the steady state: every slot holds an expert
            slots = self.policy.victims(n, set(protected) if protected else (), eos)
            if len(slots) == self.num_slots:  # every resident expert leaves
                soe.clear()
            else:
                consume(map(soe.pop, map(eos.__getitem__, slots)))  # evicted experts leave the map
        else:
            free = min(n, free)
            slots = list(range(self._filled, self._filled + free))
            self._filled += free
            if n > free:
                victims = self.policy.victims(n - free, {*protected, *slots}, eos)
                consume(map(soe.pop, map(eos.__getitem__, victims)))
                slots += victims
        consume(map(eos.__setitem__, slots, experts))
        soe.update(zip(experts, slots))
        self.policy.on_loads(slots, experts if len(slots) == n else experts[:len(slots)])
        return slots

    def prefetch(self, experts: Sequence[int], *, budget: int) -> tuple[Load, ...]:
        """Page in up to ``budget`` of ``experts`` (priority order), skipping resident ones and never
        evicting one of them; the policy sees each as a load. Returns the loads."""
        resident = self.slot_of_expert
        protected = [resident[e] for e in experts if e in resident]
        wanted = [e for e in dict.fromkeys(experts) if e not in resident and 0 <= e < self.num_experts]
        wanted = wanted[:max(budget, 0)]
        slots = self._place(wanted, protected)
        return _loads(wanted, slots)

    def resident(self) -> dict[int, int]:
        """Expert id -> slot id of every resident expert (a copy)."""
        return dict(self.slot_of_expert)
