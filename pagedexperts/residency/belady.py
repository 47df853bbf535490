"""Belady's optimal offline policy, the bound the online policies are measured against (the simulator
only; standard library only).
"""

from __future__ import annotations

from typing import Sequence

from pagedexperts.residency.eviction import HeapRankedPolicy


class BeladyPolicy(HeapRankedPolicy):
    """Evict the resident expert whose next use is furthest (never-used-again first; ties by lowest
    slot). ``unions[t]``: the experts step t routes to in this layer, for every step the residency
    will plan; ``on_step`` advances t."""

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
        """Advance to the next step; ValueError if ``union`` differs from the given future."""
        self._t += 1
        for e in union:
            uses, i = self._uses.get(e, ()), self._ptr.get(e, 0)
            if i >= len(uses) or uses[i] != self._t:
                raise ValueError(f"Belady: step {self._t} routes to expert {e}, not in the future it was given")
            self._ptr[e] = i + 1

    def on_access(self, slot: int, expert: int) -> None:
        self._touch(slot)

    on_load = on_access

    def _next_use(self, expert: int) -> float:
        uses, i = self._uses.get(expert, ()), self._ptr.get(expert, 0)
        return uses[i] if i < len(uses) else float("inf")

    def rank(self, slot: int, expert_of_slot: Sequence[int]) -> tuple:
        return (-self._next_use(expert_of_slot[slot]), slot)
