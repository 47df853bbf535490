"""Oracle for tests/residency/test_planner_equivalence.py: the wave planner and policies as they were
before the O(log K) planner (pagedexperts/residency.py and simulate.BeladyPolicy at commit
30579a3), kept verbatim so the new planner can be checked to make exactly the same decisions.
It rebuilds the candidate list over all K slots for every miss: O(misses x K). Do not edit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

EMPTY = -1  # slot content of a slot that holds no expert yet


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
        # (last use, slot) packed into one int: a C-level min, ties on the lowest slot
        last, n = self._last_use, self.num_slots
        return min([last[s] * n + s for s in candidates]) % n


class LFUPolicy(EvictionPolicy):
    """Least frequently used, with aging: evict the resident expert routed to in the fewest steps.

    Each expert (resident or not: the count survives eviction, so a popular expert evicted once
    comes back with its history) has a count, +1 for every step whose union holds it. Every
    ``half_life`` steps all counts are halved (integer floor), so the counts follow a drifting
    working set; ``half_life=0`` never ages. Ties: least recently used, then lowest slot.
    """

    name = "lfu"
    DEFAULT_HALF_LIFE = 128  # steps; best mean hit rate on the tune halves (bench/policy_eval.py)

    def __init__(self, num_slots: int, *, half_life: int = DEFAULT_HALF_LIFE) -> None:
        super().__init__(num_slots)
        self.half_life = half_life
        self._count: dict[int, int] = {}
        self._steps = 0
        self._lru = LRUPolicy(num_slots)

    def on_step(self, union: Sequence[int]) -> None:
        self._steps += 1
        if self.half_life and self._steps % self.half_life == 0:
            self._count = {e: c // 2 for e, c in self._count.items() if c > 1}
        for e in union:
            self._count[e] = self._count.get(e, 0) + 1

    def on_access(self, slot: int, expert: int) -> None:
        self._lru.on_access(slot, expert)

    def on_load(self, slot: int, expert: int) -> None:
        self._lru.on_load(slot, expert)

    def victim(self, candidates: Sequence[int], expert_of_slot: Sequence[int]) -> int:
        count, last = self._count, self._lru._last_use
        return min([(count.get(expert_of_slot[s], 0), last[s], s) for s in candidates])[2]


class FrequencyLRUPolicy(EvictionPolicy):
    """Frequency-weighted LRU: recency, stretched by how often the expert was used while resident.

    A slot's keep-score is ``uses / (age + 1)``: ``uses`` the steps that routed to its expert
    since it was loaded (1 at load; reset when the slot is refilled, like a cache entry's hit
    counter), ``age`` the steps since its last use. Evict the lowest score: an expert used once
    and idle for 3 steps (1/4) goes before one used 8 times and idle for 9 (8/10). With every
    ``uses`` equal it is exactly LRU. Ties: least recently used, then lowest slot. Simple by
    intent (an exact ratio, no tuned constant).
    """

    name = "flru"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._steps = 0
        self._uses = [0] * num_slots
        self._last_step = [0] * num_slots
        self._lru = LRUPolicy(num_slots)

    def on_step(self, union: Sequence[int]) -> None:
        self._steps += 1

    def on_access(self, slot: int, expert: int) -> None:
        self._uses[slot] += 1
        self._last_step[slot] = self._steps
        self._lru.on_access(slot, expert)

    def on_load(self, slot: int, expert: int) -> None:
        self._uses[slot] = 1
        self._last_step[slot] = self._steps
        self._lru.on_load(slot, expert)

    def victim(self, candidates: Sequence[int], expert_of_slot: Sequence[int]) -> int:
        uses, last, lru, now = self._uses, self._last_step, self._lru._last_use, self._steps
        return min(candidates, key=lambda s: (uses[s] / (now - last[s] + 1), lru[s], s))


class AdaptivePolicy(EvictionPolicy):
    """Adaptive: per layer, follow whichever of several eviction rules is winning right now.

    Each candidate rule (``CANDIDATES``: LRU, LFU with a short and a long half-life) runs a
    ghost residency of K slots on the same routing (expert ids only, no bytes) and earns the hits
    it would have had, in an exponentially decaying window (``window`` steps). The real slots
    are ranked by the current leader; each rule also keeps its own state over the real slots, so
    switching leaders is instant. Ties between rules go to the earlier in ``CANDIDATES``, so
    with no evidence (and whenever recency wins) it is LRU. Layers differ (deep layers reuse
    more, layer 0 the least) and so do workloads; one fixed rule cannot suit all of them.
    Cost: one extra ``Residency.plan`` per rule per layer per step (tens of microseconds).
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
            self._score[i] = self._score[i] * self.decay + ghost.plan(union).hits
        for rule in self._rules:
            rule.on_step(union)

    def on_access(self, slot: int, expert: int) -> None:
        for rule in self._rules:
            rule.on_access(slot, expert)

    def on_load(self, slot: int, expert: int) -> None:
        for rule in self._rules:
            rule.on_load(slot, expert)

    def victim(self, candidates: Sequence[int], expert_of_slot: Sequence[int]) -> int:
        return self._rules[self.leader].victim(candidates, expert_of_slot)


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
        self._filled = 0  # slots [0, filled) hold an expert
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
        resident = self.slot_of_expert
        hits, misses = [], []
        for e in union:
            (hits if e in resident else misses).append(e)
        on_access = policy.on_access
        for e in hits:
            on_access(resident[e], e)
        if not misses and hits:  # the common decode case: one wave, nothing to load
            wave = Wave(tuple(hits), tuple([resident[e] for e in hits]), ())
            return StepPlan((wave,), len(hits), 0)
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
            slot = self._take_slot(in_wave)
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

    def _take_slot(self, protected: set[int]) -> int | None:
        """The lowest empty slot, else the policy's victim among occupied slots not in
        ``protected``; None when every slot is protected. Slots fill in ascending order and
        never empty again, so the empty ones are always ``[filled, K)``."""
        if self._filled < self.num_slots:
            self._filled += 1
            return self._filled - 1
        candidates = [s for s in range(self.num_slots) if s not in protected]
        return self.policy.victim(candidates, self.expert_of_slot) if candidates else None

    def prefetch(self, experts: Sequence[int], *, budget: int) -> tuple[Load, ...]:
        """Page in up to ``budget`` of ``experts`` (priority order) before the step routes.

        Experts already resident are skipped; each other one takes an empty slot (lowest first)
        or the policy's victim among slots that hold none of ``experts`` and were not filled by
        this call, so a prefetch never evicts an expert it predicts. Stops early when no slot is
        left to take. The policy sees each placement as a load (``on_load``). Returns the loads.
        """
        protected = {self.slot_of_expert[e] for e in experts if e in self.slot_of_expert}
        loads: list[Load] = []
        for e in experts:
            if len(loads) >= budget:
                break
            if e in self.slot_of_expert or not 0 <= e < self.num_experts:
                continue
            slot = self._take_slot(protected)
            if slot is None:
                break
            if self.expert_of_slot[slot] != EMPTY:
                del self.slot_of_expert[self.expert_of_slot[slot]]
            self.expert_of_slot[slot] = e
            self.slot_of_expert[e] = slot
            self.policy.on_load(slot, e)
            protected.add(slot)
            loads.append(Load(expert=e, slot=slot))
        return tuple(loads)

    def resident(self) -> dict[int, int]:
        """Expert id -> slot id of every resident expert (a copy)."""
        return dict(self.slot_of_expert)


class BeladyPolicy(EvictionPolicy):
    """Belady's optimal offline policy: evict the resident expert whose next use is furthest.

    Needs the future: ``unions[t]`` is the set of experts step t routes to in this layer, for
    every step the residency will plan, in order. ``on_step`` advances t. Next use counts steps
    after the current one (experts of the current step not in the current wave have already
    been computed by an earlier wave). Never-used-again experts go first; ties by lowest slot.
    """

    name = "belady"

    def __init__(self, num_slots: int, unions: Sequence[Sequence[int]]) -> None:
        super().__init__(num_slots)
        self._uses: dict[int, list[int]] = {}
        for t, union in enumerate(unions):
            for e in union:
                self._uses.setdefault(int(e), []).append(t)
        self._ptr = dict.fromkeys(self._uses, 0)  # index of each expert's next use in _uses
        self._t = -1

    def on_step(self, union: Sequence[int]) -> None:
        """Advance to the next step; each routed expert's next use moves past it.

        Raises:
            ValueError: ``union`` differs from the future the policy was given.
        """
        self._t += 1
        for e in union:
            uses, i = self._uses.get(e, ()), self._ptr.get(e, 0)
            if i >= len(uses) or uses[i] != self._t:
                raise ValueError(f"Belady: step {self._t} routes to expert {e}, not in the future it was given")
            self._ptr[e] = i + 1

    def _next_use(self, expert: int) -> float:
        uses, i = self._uses.get(expert, ()), self._ptr.get(expert, 0)
        return uses[i] if i < len(uses) else float("inf")

    def victim(self, candidates: Sequence[int], expert_of_slot: Sequence[int]) -> int:
        return min(candidates, key=lambda s: (-self._next_use(expert_of_slot[s]), s))
