"""Device residency: one MoE layer's slot map, policy state and counters, held in device tensors.

Owns, for the device-planned executor (``paging.device_executor``): one layer's ``DecideState`` (``kernels.decide``)
(slot of expert [E], expert of slot [K], per-slot last use, per-expert LFU counts, clock and
step counter), the eviction rule it decides by (the ``--policy`` names ``lru`` and ``lfu``, with
``residency.eviction``'s defaults), the choice of kernel backend (torch backends or Triton),
the fixed buffers of each step shape (``StepShape``: the plan of its W waves and each entry's
slot and wave), ``decide`` (the decide and remap kernels of ``kernels.decide``), the layer's
page-in (``page_in_over``: a ``kernels.page_in.PageIn``), and ``DeviceCounters``, the layer's
paging counters accumulated on the device without a sync. Its decisions equal
``residency.planner.Residency`` with the same policy on the same steps
(tests/paging/test_device_decide.py, on the real traces). Does not: compute experts
(``paging.steps``) or order anything (one stream: issue order).

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
    """The decide rule of ``--policy`` name ``policy``; ``half_life`` overrides LFU's;
    ``beyond_k`` "in-place" reads the routed experts that get no slot in place (one wave a
    step), admitting at most ``admit_per_step`` page-ins a step (None: K).

    Raises:
        ValueError: a policy the device decide does not implement (lists those it does and
            says to use the host decide for the others); an unknown ``beyond_k``; an admission
            limit below 0 or without in-place reads (names the flags).
    """
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
    """The fixed buffers of steps of S entries: ``plan`` (its W waves, shared by the shapes of
    one W), ``entry_slot`` / ``entry_wave`` [S] int64 (each entry's slot and wave, the remap's
    output), ``num_waves`` W and ``max_loads`` = min(S, K) (the most loads a wave can have)."""

    plan: DecidePlan
    entry_slot: torch.Tensor
    entry_wave: torch.Tensor
    num_waves: int
    max_loads: int


class DeviceResidency:
    """The residency of one layer on ``device``: decides each step without reading the device.

    Args:
        num_experts: E. num_slots: K, 1 <= K <= E.
        device: where the state lives (the slots' device).
        rule: the eviction rule (``device_rule``).
        backend: "torch" (plain tensor ops) or "triton" (the decide and remap kernels).

    Raises:
        ValueError: K out of [1, E] (``residency.planner.check_num_resident``, the one K check:
            names --num-resident); a backend that cannot run here.
    """

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
        """W of steps of S = ``num_entries`` entries: ``kernels.decide.num_waves_for`` (1 at
        every S when experts beyond K are read in place)."""
        return num_waves_for(num_entries, self.num_slots, self.num_experts, in_place=self.rule.in_place)

    def decide(self, ids: torch.Tensor) -> StepShape:
        """Decide the step of top-k ids [T, k] (int64, on the device) and remap its entries;
        return its shape's buffers, filled (valid until the next step of the same S). Fixed
        shapes, no device-to-host transfer."""
        shape = self._shapes.get(ids.numel()) or self.shape(ids.numel())
        plan = shape.plan
        self._decide(self.state, ids, plan, self.rule)
        self._remap(ids, plan.expert_slot, plan.expert_wave, shape.entry_slot, shape.entry_wave)
        return shape

    def page_in_over(self, source: dict[str, torch.Tensor], slots: SlotTable) -> PageIn:
        """The layer's page-in from the store's [E, ...] ``source`` into ``slots`` [K, ...] by
        this residency's backend: ``page_in(plan.src, plan.dst, plan.count, wave, max_loads)``.

        Raises:
            ValueError: a table a gather of raw rows cannot write (``SlotTable
                .device_page_in_problem``: e.g. dense slots, naming --slot-format)."""
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
    """The paging counters of one layer: ``values`` [len(FIELDS)] int64 on the device, added to
    by each step without a sync and read only when stats are asked for (``to_layer_stats``: one
    device-to-host copy), as ``stats.accounting.LayerStats`` (the one definition of the counts,
    docs/design.md "Terms": one hit or miss per distinct routed expert per layer per step). No times: a
    device-planned step has no host timing to give.

    Args:
        device: where the counters live (the slots' device).
        expert_bytes: bytes of one expert (all its tensors): bytes paged = misses x this.
    """

    def __init__(self, device, *, expert_bytes: int) -> None:
        self.values = torch.zeros(len(FIELDS), dtype=torch.int64, device=device)
        self.expert_bytes = expert_bytes

    def add_step(self, step: torch.Tensor, *, rows: int, padding: torch.Tensor | None = None) -> None:
        """Add one layer-step: ``step`` [4] int64 (hits, misses, waves, misses read in place:
        ``DecidePlan.step``) on the device; ``rows`` the step's T (known on the host); ``padding``
        the 0-dim device count of padding rows among them (``runner_contract.ExpertsRunner.padding_count``),
        None: none. Tokens = rows - padding, as the host executor counts them. Page-ins = misses
        - in-place rows; bytes = each times the expert's bytes (an in-place row is read over the
        link once per block of entries that routes to it: at decode, once). In place, no sync."""
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
