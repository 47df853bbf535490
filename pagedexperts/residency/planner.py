"""Residency: which routed experts occupy the K slots of one MoE layer, and the wave plan of a step.

Owns: the expert <-> slot map of one layer, its eviction policy (the contract and the rules are
``residency.eviction``, the ``--policy`` registry ``residency.policies``), the one check of K,
and the planner that turns a step's union of routed experts into waves of at most K experts,
each with the loads (expert, slot) it needs.
Tensor-free on purpose (standard library only): the runtime executor and the trace simulator
import this same code, so their hit/miss counts cannot drift. Planning costs O(|union|) plus
the policy's victims (O(log K) each, or one O(K) ranking per wave that evicts K/4 or more).
Does not: copy bytes (``storage``), compute experts (``paging``), or count stats (``stats``).

Terms (docs/design.md): E routed experts, K slots, union = distinct experts a step routes to in the
layer. A step needs ceil(|union| / K) waves; resident experts go in the first wave, then
misses. A miss's victim slot is never one the current wave uses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

from pagedexperts.residency.eviction import EMPTY, EvictionPolicy, LFUPolicy, consume


class Load(NamedTuple):
    """One page-in: copy expert ``expert``'s rows from the host store into slot ``slot``.

    Plan records are NamedTuples (typed, immutable, and built in C: planning runs once per
    layer per step, between the model's kernels, where every microsecond shows).
    """

    expert: int
    slot: int


class Wave(NamedTuple):
    """Experts computed together: ``experts[i]`` sits in ``slots[i]`` once ``loads`` are done.

    ``loads`` is the subset of (expert, slot) pairs that must be paged in before the wave runs.
    """

    experts: tuple[int, ...]
    slots: tuple[int, ...]
    loads: tuple[Load, ...]


class StepPlan(NamedTuple):
    """The plan of one layer in one step: waves in order, and the step's hit/miss counts.

    Accounting (docs/design.md "Terms"): one hit or miss per distinct routed expert per layer per step.
    """

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
    """Load records for (expert, slot) pairs, built in C (a Python-level ``Load(...)`` per miss
    costs ~0.3 us, a quarter of a miss's planning)."""
    return tuple(map(tuple.__new__, itertools.repeat(Load), zip(experts, slots)))


DEFAULT_RESIDENT_FRACTION = 0.25  # default K = E / 4 (at least top_k)


def default_num_resident(*, num_experts: int, top_k: int) -> int:
    """K when none is given: max(top_k, E x DEFAULT_RESIDENT_FRACTION)."""
    return max(top_k, int(num_experts * DEFAULT_RESIDENT_FRACTION))


def num_resident_problem(num_resident: int, *, num_experts: int, min_slots: int,
                         flag: str = "--num-resident") -> str | None:
    """Why K = ``num_resident`` slots cannot page E experts of which a token routes to
    ``min_slots`` (top_k; 1 for a bare residency), or None when min_slots <= K <= E."""
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
    """``num_resident`` when min_slots <= K <= E (the one K-range check: runtime, loader and
    simulator).

    Raises:
        ValueError: K out of range (``num_resident_problem``'s message, naming ``flag``).
    """
    problem = num_resident_problem(num_resident, num_experts=num_experts, min_slots=min_slots, flag=flag)
    if problem is not None:
        raise ValueError(problem)
    return num_resident


def begin_step(policy, union, hits_of):
    """The start of a step, the one rule of both deciders (``Residency`` here, and the device
    decide's torch reference ``paging.kernels.decide``, which passes tensor hooks over its
    device state; its Triton kernel is held to that reference by tests):

    1. ``policy.on_step(union)`` before any hit is touched (LFU: steps += 1, every
       ``half_life`` steps the counts halved, then +1 for each expert of the union);
    2. ``hits, hit_slots = hits_of(union)``: the union's resident experts in ascending id
       and their slots, read before any wave places a miss;
    3. ``policy.on_hits(hit_slots, hits)``: the hits touched in that order (LRU/LFU: each
       slot's last use is the clock + 1 + its rank among the hits).

    ``union``, ``hits`` and ``hit_slots`` are whatever the decider holds them as (sorted id
    lists here; an [E] mask and the slot-of-expert tensor on the device). Returns (hits,
    hit_slots). The waves then take hits first, then misses, each in ascending id.
    """
    policy.on_step(union)
    hits, hit_slots = hits_of(union)
    policy.on_hits(hit_slots, hits)
    return hits, hit_slots


@dataclass
class Residency:
    """The slot map of one MoE layer plus its policy; plans each step's waves.

    Args:
        num_experts: E, routed experts of the layer.
        num_slots: K, slots on the device, 1 <= K <= E.
        policy: the eviction policy; None: LFU with aging over K slots, the ``--policy``
            default (``residency.policies.DEFAULT_POLICY``; tests/residency/test_policies.py holds the
            two equal).

    Raises:
        ValueError: K out of [1, E] (``check_num_resident``: names --num-resident).
    """

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
        """Plan one step: the union of ``routed`` expert ids -> waves with their loads.

        Resident experts (hits) go first, then misses in ascending id; each wave holds at most
        K experts. Each miss takes an empty slot (lowest id first) or else the policy's victim
        among occupied slots not used by the current wave. Updates the slot map and policy.
        Cost: O(|union|) plus the policy's victims, O(log K) per miss or O(K) per wave that
        evicts at least K/4 (so never O(K) per miss).

        Raises:
            ValueError: an expert id outside [0, E).
        """
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
        """One expert as a one-expert step (a cache of single accesses, e.g. the disk tier's host
        rows): (whether it was resident, its slot now). The state changes as ``plan``'s."""
        plan = self.plan((expert,))
        return plan.hits == 1, plan.waves[0].slots[0]

    def replay_step(self, union: Sequence[int]) -> int:
        """``plan`` without the wave records, for a ghost residency: ``union`` sorted, distinct
        and in range (not checked). Returns the step's hits; the state changes as ``plan``'s."""
        hits, hit_slots = self._begin_step(union)
        if len(hits) < len(union):
            misses = list(itertools.filterfalse(self.slot_of_expert.__contains__, union))
            for _, wave_hit_slots, wave_misses in self._waves(hits, hit_slots, misses):
                self._place(wave_misses, wave_hit_slots)
        return len(hits)

    def _begin_step(self, union: Sequence[int]) -> tuple[list[int], list[int]]:
        """``begin_step`` over this residency's policy and slot map: (hits, their slots)."""
        return begin_step(self.policy, union, self._hits_of)

    def _hits_of(self, union: Sequence[int]) -> tuple[list[int], list[int]]:
        """The union's resident experts (ascending id, as ``union`` is) and their slots."""
        resident = self.slot_of_expert
        hits = list(filter(resident.__contains__, union))
        return hits, list(map(resident.__getitem__, hits))

    def _waves(self, hits: list[int], hit_slots: list[int], misses: list[int]):
        """Split hits + misses into waves of at most K: yields (hits, their slots, misses).

        Hits come first, so only a wave without misses can precede one with hits: no wave
        evicts a hit of a later wave, and the hit slots read at the step's start stay true.
        """
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
        """Give each of ``experts`` (not resident) a slot: empty ones first (lowest id), then
        the policy's victims among slots not in ``protected`` nor filled here; updates the slot
        map and tells the policy. Returns the slots, in order (shorter if slots run out)."""
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
        """Page in up to ``budget`` of ``experts`` (priority order) before the step routes.

        Experts already resident are skipped; each other one takes an empty slot (lowest first)
        or the policy's victim among slots that hold none of ``experts`` and were not filled by
        this call, so a prefetch never evicts an expert it predicts. Stops early when no slot is
        left to take. The policy sees each placement as a load (``on_load``). Returns the loads.
        """
        resident = self.slot_of_expert
        protected = [resident[e] for e in experts if e in resident]
        wanted = [e for e in dict.fromkeys(experts) if e not in resident and 0 <= e < self.num_experts]
        wanted = wanted[:max(budget, 0)]
        slots = self._place(wanted, protected)
        return _loads(wanted, slots)

    def resident(self) -> dict[int, int]:
        """Expert id -> slot id of every resident expert (a copy)."""
        return dict(self.slot_of_expert)
