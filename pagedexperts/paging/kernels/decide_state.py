"""Decide state: one MoE layer's residency held in device tensors, and the waves a plan holds.

Owns ``DecideState`` (slot map both ways, per-slot last use, per-expert LFU counts, the clock
and step counter: what a decide of ``kernels.decide`` reads and updates in place, never
reallocated) and ``num_waves_for`` (W, the fixed number of waves a step's ``DecidePlan`` is
allocated for). Does not: decide (``kernels.decide``) or own the state's lifetime
(``device_residency``).

Legend: T tokens, k top_k, E experts, K slots, W waves of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# scalars[i]: the state's device scalars, one int64 tensor so a step updates them in place
CLOCK, STEPS = 0, 1


@dataclass(frozen=True)
class DecideState:
    """The residency state of one layer, device tensors updated in place by each decide.

    slot_of_expert [E] int64 (-1: not resident); expert_of_slot [K] int64 (-1: empty);
    last_use [K] int64 (clock at the slot's last touch, 0 never); count [E] int64 (LFU: steps
    whose union held the expert, halved every ``half_life`` steps; unused by LRU);
    scalars [2] int64: CLOCK (touches so far), STEPS (decides so far).
    """

    slot_of_expert: torch.Tensor
    expert_of_slot: torch.Tensor
    last_use: torch.Tensor
    count: torch.Tensor
    scalars: torch.Tensor

    @classmethod
    def empty(cls, num_experts: int, num_slots: int, device) -> "DecideState":
        """Nothing resident, every clock at zero."""
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.full((num_experts,), -1, **i64), torch.full((num_slots,), -1, **i64),
                   torch.zeros(num_slots, **i64), torch.zeros(num_experts, **i64), torch.zeros(2, **i64))


def num_waves_for(num_entries: int, num_slots: int, num_experts: int, *, in_place: bool = False) -> int:
    """W = ceil(min(T k, E) / K): the most waves a step of ``num_entries`` = T k routed
    entries needs (its union holds at most min(T k, E) experts); at least 1. ``in_place``
    (experts beyond the slots read in place): 1 at every T."""
    if in_place:
        return 1
    return max(1, -(-min(num_entries, num_experts) // num_slots))
