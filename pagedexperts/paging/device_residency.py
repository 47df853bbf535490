"""Device residency: the slot map and policy state of one MoE layer, held in device tensors.

Owns: one layer's ``DecideState`` (slot of expert [E], expert of slot [K], per-slot last use,
per-expert LFU counts, clock and step counter), the eviction rule it decides by (the
``--policy`` names ``lru`` and ``lfu``, with ``residency.eviction``'s defaults), the fixed plan buffers
of each step shape (one ``DecidePlan`` per W), and the choice of kernel backend (torch
reference or Triton). Its decisions equal ``residency.planner.Residency`` with the same policy on the
same steps (tests/test_device_decide.py, on the real traces). Does not: copy bytes
(``kernels.page_in``), compute experts (``device_executor``) or count (``device_stats``).

Legend: T tokens, k top_k, E experts, K slots, W = ceil(min(T k, E) / K) waves.
"""

from __future__ import annotations

import torch

from pagedexperts.residency.eviction import LFUPolicy
from pagedexperts.residency.planner import check_num_resident
from pagedexperts.paging.kernels._triton import check_backend
from pagedexperts.paging.kernels.decide import (
    DecidePlan, DecideRule, DecideState, decide_reference, decide_triton, num_waves_for,
)

# --policy names the device decide implements, with the rule each means (residency.eviction defaults)
DEVICE_RULES: dict[str, DecideRule] = {
    "lru": DecideRule(use_count=False),
    "lfu": DecideRule(use_count=True, half_life=LFUPolicy.DEFAULT_HALF_LIFE),
}


def device_rule(policy: str, *, half_life: int | None = None) -> DecideRule:
    """The decide rule of ``--policy`` name ``policy``; ``half_life`` overrides LFU's.

    Raises:
        ValueError: a policy the device decide does not implement (lists those it does and
            says to use the host decide for the others).
    """
    if policy not in DEVICE_RULES:
        raise ValueError(
            f"policy {policy!r} has no device-planned decide; choose one of {sorted(DEVICE_RULES)} "
            "(--policy) or decide on the host")
    rule = DEVICE_RULES[policy]
    if half_life is not None:
        if not rule.use_count:
            raise ValueError(f"half_life applies to policy 'lfu' only, not {policy!r}")
        rule = DecideRule(use_count=True, half_life=half_life)
    return rule


class DeviceResidency:
    """The residency of one layer on ``device``: decides each step without reading the device.

    Args:
        num_experts: E. num_slots: K, 1 <= K <= E.
        device: where the state lives (the slots' device).
        rule: the eviction rule (``device_rule``).
        backend: "torch" (reference ops) or "triton" (the decide kernel).

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
        self._plans: dict[int, DecidePlan] = {}  # W -> its fixed plan buffers

    def plan_buffers(self, num_entries: int) -> DecidePlan:
        """The plan buffers of a step of ``num_entries`` = T k entries (W from the shape)."""
        w = num_waves_for(num_entries, self.num_slots, self.num_experts)
        if w not in self._plans:
            self._plans[w] = DecidePlan.empty(w, self.num_experts, self.num_slots, self.device)
        return self._plans[w]

    def decide(self, ids: torch.Tensor) -> DecidePlan:
        """Decide the step of top-k ids [T, k] (int64, on the device); return its plan (valid
        until the next step of the same W). Fixed shapes, no device-to-host transfer."""
        plan = self.plan_buffers(ids.numel())
        fn = decide_triton if self.backend == "triton" else decide_reference
        fn(self.state, ids, plan, self.rule)
        return plan

    # -- reads for stats and tests (each reads the device) --

    def resident(self) -> dict[int, int]:
        """Expert id -> slot of every resident expert (reads the device)."""
        slot_of_expert = self.state.slot_of_expert.tolist()
        return {e: s for e, s in enumerate(slot_of_expert) if s >= 0}

    def expert_of_slot(self) -> list[int]:
        """Expert of each slot, -1 for an empty one (reads the device)."""
        return self.state.expert_of_slot.tolist()
