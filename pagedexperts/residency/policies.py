"""The ``--policy`` registry (``POLICIES``, ``DEFAULT_POLICY``, ``make_policy``) and
``AdaptivePolicy``, which runs ghost residencies of the planner and so sits above
``residency.planner``. Standard library only, tensor-free.
"""

from __future__ import annotations

from typing import Container, Sequence

from pagedexperts.residency.eviction import EvictionPolicy, FrequencyLRUPolicy, LFUPolicy, LRUPolicy
from pagedexperts.residency.planner import Residency


class AdaptivePolicy(EvictionPolicy):
    """Per layer, rank slots by whichever candidate rule (``CANDIDATES``) would have had the most hits
    in a decaying window of ``window`` steps, each scored on a ghost residency of K slots
    (docs/residency.md). No evidence: LRU."""

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
    """The eviction policy ``name`` for ``num_slots`` slots; ValueError lists the ``--policy`` choices."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)} (--policy)"
        ) from None
    return cls(num_slots)
