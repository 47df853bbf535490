"""Residency: which routed experts occupy the K slots of one MoE layer, and the wave plan of a step.

Owns: the expert <-> slot map of one layer, the eviction policy that picks victims, and the
planner that turns a step's union of routed experts into waves of at most K experts, each with
the loads (expert, slot) it needs. Tensor-free on purpose (standard library only): the runtime
pager and the trace simulator import this same code, so their hit/miss counts cannot drift.
Does not: copy bytes (``store``), compute experts (``pager``), or count stats (``stats``).

Terms (DESIGN.md): E routed experts, K slots, union = distinct experts a step routes to in the
layer. A step needs ceil(|union| / K) waves; resident experts go in the first wave, then
misses. A miss's victim slot is never one the current wave uses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, Sequence

EMPTY = -1  # slot content of a slot that holds no expert yet


@dataclass(frozen=True)
class Load:
    """One page-in: copy expert ``expert``'s rows from the host store into slot ``slot``."""

    expert: int
    slot: int


@dataclass(frozen=True)
class Wave:
    """Experts computed together: ``experts[i]`` sits in ``slots[i]`` once ``loads`` are done.

    ``loads`` is the subset of (expert, slot) pairs that must be paged in before the wave runs.
    """

    experts: tuple[int, ...]
    slots: tuple[int, ...]
    loads: tuple[Load, ...]


@dataclass(frozen=True)
class StepPlan:
    """The plan of one layer in one step: waves in order, and the step's hit/miss counts.

    Accounting (DESIGN.md): one hit or miss per distinct routed expert per layer per step.
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


class EvictionPolicy:
    """Base class of eviction policies: ranks occupied slots for eviction; tensor-free.

    The residency calls ``on_access`` for each resident expert a step routes to (a hit),
    ``on_load`` after an expert is placed in a slot (a miss), ``on_step`` once per step with the
    step's union before planning, and ``victim`` to choose among ``candidates`` (occupied slots
    not used by the current wave). Subclasses override ``victim`` and whichever hooks they need.
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

    def victim(self, candidates: Sequence[int], expert_of_slot: Sequence[int]) -> int:
        """Return the slot to evict among ``candidates`` (non-empty, all occupied)."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used: evict the slot whose expert was routed to longest ago.

    Recency is a global counter bumped on every access or load; within a step, experts are
    touched in ascending expert id, so ties cannot occur and plans are deterministic.
    """

    name = "lru"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._clock = itertools.count(1)
        self._last_use = [0] * num_slots

    def on_access(self, slot: int, expert: int) -> None:
        self._last_use[slot] = next(self._clock)

    def on_load(self, slot: int, expert: int) -> None:
        self._last_use[slot] = next(self._clock)

    def victim(self, candidates: Sequence[int], expert_of_slot: Sequence[int]) -> int:
        last_use = self._last_use
        return min(candidates, key=lambda s: (last_use[s], s))


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


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


@dataclass
class Residency:
    """The slot map of one MoE layer plus its policy; plans each step's waves.

    Args:
        num_experts: E, routed experts of the layer.
        num_slots: K, slots on the device, 1 <= K <= E.
        policy: the eviction policy (default LRU over K slots).

    Raises:
        ValueError: K out of [1, E] (the message names --num-resident).
    """

    num_experts: int
    num_slots: int
    policy: EvictionPolicy | None = None
    expert_of_slot: list[int] = field(init=False)
    slot_of_expert: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.num_slots <= self.num_experts:
            raise ValueError(
                f"num_resident K={self.num_slots} must be in [1, E={self.num_experts}]; "
                "change --num-resident"
            )
        if self.policy is None:
            self.policy = LRUPolicy(self.num_slots)
        self.expert_of_slot = [EMPTY] * self.num_slots
        self.slot_of_expert = {}

    def plan(self, routed: Iterable[int]) -> StepPlan:
        """Plan one step: the union of ``routed`` expert ids -> waves with their loads.

        Resident experts (hits) go first, then misses in ascending id; each wave holds at most
        K experts. Each miss takes an empty slot (lowest id first) or else the policy's victim
        among occupied slots not used by the current wave. Updates the slot map and policy.

        Raises:
            ValueError: an expert id outside [0, E).
        """
        union = sorted(set(routed))
        if union and (union[0] < 0 or union[-1] >= self.num_experts):
            bad = union[0] if union[0] < 0 else union[-1]
            raise ValueError(f"routed expert id {bad} outside [0, E={self.num_experts})")
        policy = self.policy
        policy.on_step(union)
        hits = [e for e in union if e in self.slot_of_expert]
        misses = [e for e in union if e not in self.slot_of_expert]
        for e in hits:
            policy.on_access(self.slot_of_expert[e], e)
        order = hits + misses
        k = self.num_slots
        waves = tuple(self._plan_wave(order[i : i + k]) for i in range(0, len(order), k))
        return StepPlan(waves=waves, hits=len(hits), misses=len(misses))

    def _plan_wave(self, experts: list[int]) -> Wave:
        in_wave = {self.slot_of_expert[e] for e in experts if e in self.slot_of_expert}
        loads = []
        for e in experts:
            if e in self.slot_of_expert:
                continue
            slot = self._free_slot(in_wave)
            old = self.expert_of_slot[slot]
            if old != EMPTY:
                del self.slot_of_expert[old]
            self.expert_of_slot[slot] = e
            self.slot_of_expert[e] = slot
            self.policy.on_load(slot, e)
            in_wave.add(slot)
            loads.append(Load(expert=e, slot=slot))
        slots = tuple(self.slot_of_expert[e] for e in experts)
        return Wave(experts=tuple(experts), slots=slots, loads=tuple(loads))

    def _free_slot(self, in_wave: set[int]) -> int:
        eos = self.expert_of_slot
        for s in range(self.num_slots):
            if eos[s] == EMPTY:
                return s
        candidates = [s for s in range(self.num_slots) if s not in in_wave]
        return self.policy.victim(candidates, eos)

    def resident(self) -> dict[int, int]:
        """Expert id -> slot id of every resident expert (a copy)."""
        return dict(self.slot_of_expert)
