"""One MoE layer's residency for the device-planned executor, in device tensors: its ``DecideState``,
eviction rule, kernel backend, per-shape buffers, decide and remap, page-in, and ``DeviceCounters``.
Its decisions equal ``residency.planner.Residency``'s with the same policy
(tests/paging/test_device_decide.py; docs/device-side-decide.md). Does not compute experts or order
anything (one stream: issue order).

Legend: T tokens, k top_k, E experts, K slots, S = T k entries, W = ceil(min(S, E) / K) waves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedexperts.formats.slots import SlotTable
from pagedexperts.paging.kernels._triton import check_backend
from pagedexperts.paging.kernels.decide import (
    DecidePlan, DecideRule, decide_torch, decide_triton, remap_torch, remap_triton,
)
from pagedexperts.paging.kernels.decide import DecideState, num_waves_for
from pagedexperts.paging.kernels.page_in import PageIn
from pagedexperts.residency.eviction import LFUPolicy
from pagedexperts.residency.planner import check_num_resident
from pagedexperts.stats.accounting import LayerStats

# --policy names the device decide implements, with the rule each means (residency.eviction defaults)
DEVICE_RULES: dict[str, DecideRule] = {
    "lru": DecideRule(use_count=False),
    "lfu": DecideRule(use_count=True, half_life=LFUPolicy.DEFAULT_HALF_LIFE),
}


BEYOND_K = ("waves", "in-place")  # --beyond-k: a union larger than K in waves, or its extra experts read in place


def device_rule(policy: str, *, half_life: int | None = None, beyond_k: str = "waves",
                admit_per_step: int | None = None) -> DecideRule:
    """The decide rule of ``--policy`` ``policy``; ``beyond_k`` "in-place" admits at most
    ``admit_per_step`` page-ins a step (None: K). ValueError (naming the flags): no device decide
    for the policy, unknown ``beyond_k``, a bad admission limit."""
    if policy not in DEVICE_RULES:
        raise ValueError(
            f"policy {policy!r} has no device-planned decide; choose one of {sorted(DEVICE_RULES)} "
            "(--policy) or decide on the host")
    if beyond_k not in BEYOND_K:
        raise ValueError(f"unknown --beyond-k {beyond_k!r}; choose one of {list(BEYOND_K)}")
    if admit_per_step is not None and (beyond_k != "in-place" or admit_per_step < 0):
        raise ValueError(f"--admit-per-step {admit_per_step} needs --beyond-k in-place and a value >= 0")
    rule = DEVICE_RULES[policy]
    if half_life is not None:
        if not rule.use_count:
            raise ValueError(f"half_life applies to policy 'lfu' only, not {policy!r}")
        rule = DecideRule(use_count=True, half_life=half_life)
    return DecideRule(rule.use_count, rule.half_life, in_place=beyond_k == "in-place", admit=admit_per_step)


@dataclass(frozen=True)
class StepShape:
    """The fixed buffers of steps of S entries: ``plan`` (its W waves), ``entry_slot`` / ``entry_wave``
    [S] int64 (the remap's output), ``num_waves`` W and ``max_loads`` = min(S, K)."""

    plan: DecidePlan
    entry_slot: torch.Tensor
    entry_wave: torch.Tensor
    num_waves: int
    max_loads: int


class DeviceResidency:
    """One layer's residency on ``device``, deciding each step without reading the device. ValueError:
    K outside [1, E] (names --num-resident) or a backend that cannot run here."""

    def __init__(self, num_experts: int, num_slots: int, device, *, rule: DecideRule, backend: str = "torch") -> None:
        check_num_resident(num_slots, num_experts=num_experts, min_slots=1)
        self.num_experts, self.num_slots = num_experts, num_slots
        self.device = torch.device(device)
        self.rule = rule
        self.backend = check_backend(backend, self.device)
        self.state = DecideState.empty(num_experts, num_slots, self.device)
        self._decide, self._remap = (decide_triton, remap_triton) if backend == "triton" else (decide_torch,
                                                                                                  remap_torch)
        self._plans: dict[int, DecidePlan] = {}  # W -> its fixed plan buffers
        self._shapes: dict[int, StepShape] = {}  # S -> its fixed buffers

    def shape(self, num_entries: int) -> StepShape:
        """The ``StepShape`` of steps of S = ``num_entries`` entries (built at its first step)."""
        shape = self._shapes.get(num_entries)
        if shape is None:
            w = self.waves_for(num_entries)
            if w not in self._plans:
                self._plans[w] = DecidePlan.empty(w, self.num_experts, self.num_slots, self.device)
            entries = torch.empty(2, num_entries, dtype=torch.int64, device=self.device)
            shape = StepShape(self._plans[w], entries[0], entries[1], w, min(num_entries, self.num_slots))
            self._shapes[num_entries] = shape
        return shape

    def waves_for(self, num_entries: int) -> int:
        """W of steps of S = ``num_entries`` entries (1 when experts beyond K are read in place)."""
        return num_waves_for(num_entries, self.num_slots, self.num_experts, in_place=self.rule.in_place)

    def decide(self, ids: torch.Tensor) -> StepShape:
        """Decide top-k ids [T, k] (int64, device) and remap the entries; returns the shape's buffers,
        valid until the next step of the same S."""
        shape = self._shapes.get(ids.numel()) or self.shape(ids.numel())
        plan = shape.plan
        self._decide(self.state, ids, plan, self.rule)
        self._remap(ids, plan.expert_slot, plan.expert_wave, shape.entry_slot, shape.entry_wave)
        return shape

    def page_in_over(self, source: dict[str, torch.Tensor], slots: SlotTable) -> PageIn:
        """The page-in ``page_in(plan.src, plan.dst, plan.count, wave, max_loads)`` from ``source`` [E,
        ...] into ``slots`` [K, ...]. ValueError: ``SlotTable.device_page_in_problem``."""
        problem = slots.device_page_in_problem()
        if problem is not None:
            raise ValueError(problem)
        return PageIn(source, slots, self.device, backend=self.backend)

    # -- reads for stats and tests (each reads the device) --

    def resident(self) -> dict[int, int]:
        """Expert id -> slot of every resident expert (reads the device)."""
        slot_of_expert = self.state.slot_of_expert.tolist()
        return {e: s for e, s in enumerate(slot_of_expert) if s >= 0}

    def expert_of_slot(self) -> list[int]:
        """Expert of each slot, -1 for an empty one (reads the device)."""
        return self.state.expert_of_slot.tolist()


# the counter vector's fields, in order (int64 each)
FIELDS = ("steps", "tokens", "padding_tokens", "hits", "misses", "page_ins", "bytes_paged", "in_place_rows",
          "in_place_bytes", "waves", "multi_wave_steps", "union_sum", "union_max", "union_last")
_INDEX = {name: i for i, name in enumerate(FIELDS)}


class DeviceCounters:
    """One layer's paging counters, ``values`` [len(FIELDS)] int64 on the device, added to each step
    without a sync and read as ``stats.accounting.LayerStats`` in one copy. No times."""

    def __init__(self, device, *, expert_bytes: int) -> None:
        self.values = torch.zeros(len(FIELDS), dtype=torch.int64, device=device)
        self.expert_bytes = expert_bytes

    def add_step(self, step: torch.Tensor, *, rows: int, padding: torch.Tensor | None = None) -> None:
        """Add one step: ``step`` [4] int64 (``DecidePlan.step``), ``rows`` its T, ``padding`` 0-dim or
        None. Tokens = rows - padding; page-ins = misses - in-place reads. No sync."""
        hits, misses, waves, in_place = step[0], step[1], step[2], step[3]
        union, page_ins = hits + misses, misses - in_place
        pad = torch.zeros_like(hits) if padding is None else padding.to(hits.device, torch.int64).reshape(())
        v = self.values
        zero = torch.zeros_like(hits)
        delta = torch.stack([torch.ones_like(hits), rows - pad, pad, hits, misses, page_ins,
                             page_ins * self.expert_bytes, in_place, in_place * self.expert_bytes, waves,
                             (waves > 1).long(), union, zero, zero])
        v.add_(delta)
        v[_INDEX["union_max"]] = torch.maximum(v[_INDEX["union_max"]], union)
        v[_INDEX["union_last"]] = union

    def reset(self) -> None:
        """Every counter back to zero (in place: the tensor keeps its address)."""
        self.values.zero_()

    def to_layer_stats(self) -> LayerStats:
        """The counters as a ``LayerStats`` (no times). Reads the device."""
        return LayerStats(**dict(zip(FIELDS, self.values.tolist())))
