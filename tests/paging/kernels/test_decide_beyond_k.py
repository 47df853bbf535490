"""The device decide with experts beyond K read in place (``--beyond-k in-place``): one wave a step.

Oracle: the host residency (``residency.planner.Residency`` + ``LRUPolicy``) planning, each step,
the routed experts that the rule gives a slot (the step's hits, then its first
A = min(misses, K - hits, admit) misses in ascending id): its loads, slot map and slot order are
what the device decide must write; every other routed expert must get host row K + e and wave 0;
the step counts (hits, misses, 1 wave, misses read in place). LFU: for unions <= K the in-place
decide equals the waves decide (state and plan); the Triton kernel (interpreter) writes exactly
what the torch reference writes, every rule and admission limit.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are defined (see test_device_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedexperts.paging.kernels import HAVE_TRITON  # noqa: E402
from pagedexperts.paging.kernels.decide import (  # noqa: E402
    DecidePlan, DecideRule, decide_torch,
)
from pagedexperts.paging.kernels.decide import DecideState, num_waves_for  # noqa: E402
from pagedexperts.residency.eviction import LRUPolicy  # noqa: E402
from pagedexperts.residency.planner import Residency  # noqa: E402

PLAN_FIELDS = ("src", "dst", "count", "expert_slot", "expert_wave", "step")
STATE_FIELDS = ("slot_of_expert", "expert_of_slot", "last_use", "count", "scalars")


def random_steps(seed: int, num_experts: int, top_k: int, steps: int, max_tokens: int):
    rng = random.Random(seed)
    return [torch.tensor([rng.sample(range(num_experts), top_k) for _ in range(rng.randint(1, max_tokens))])
            for _ in range(steps)]


def loads_of(plan) -> list[tuple[int, int]]:
    n = int(plan.count[0])
    return list(zip(plan.src[0, :n].tolist(), plan.dst[0, :n].tolist()))


@pytest.mark.parametrize("admit", [None, 1, 3, 0])
@pytest.mark.parametrize("num_experts,num_slots,top_k", [(8, 2, 2), (16, 4, 3), (32, 8, 4), (12, 5, 1)])
def test_lru_in_place_equals_the_host_residency_of_the_slotted_experts(admit, num_experts, num_slots, top_k):
    host = Residency(num_experts, num_slots, LRUPolicy(num_slots))
    state = DecideState.empty(num_experts, num_slots, "cpu")
    rule = DecideRule(use_count=False, in_place=True, admit=admit)
    limit = num_slots if admit is None else admit
    beyond = 0
    for t, ids in enumerate(random_steps(num_experts * 7 + num_slots, num_experts, top_k, 60, max_tokens=6)):
        union = sorted(set(ids.flatten().tolist()))
        resident = host.resident()
        hits = [e for e in union if e in resident]
        misses = [e for e in union if e not in resident]
        admitted = misses[:min(len(misses), num_slots - len(hits), limit)]
        want = host.plan(hits + admitted)
        plan = DecidePlan.empty(num_waves_for(ids.numel(), num_slots, num_experts, in_place=True), num_experts,
                                num_slots, "cpu")
        assert plan.num_waves == 1
        decide_torch(state, ids, plan, rule)
        msg = f"step {t} union {union} admit {admit}"
        assert loads_of(plan) == [tuple(x) for x in want.loads], msg
        slot_map = {e: s for e, s in enumerate(state.slot_of_expert.tolist()) if s >= 0}
        assert slot_map == host.resident(), msg
        in_place = [e for e in union if e not in hits + admitted]
        expected_slot = [host.resident()[e] if e in hits + admitted else num_slots + e if e in union else -1
                         for e in range(num_experts)]
        assert plan.expert_slot.tolist() == expected_slot, msg
        assert plan.expert_wave.tolist() == [0 if e in union else -1 for e in range(num_experts)], msg
        assert plan.step.tolist() == [len(hits), len(misses), 1, len(in_place)], msg
        beyond += len(in_place) > 0
    assert beyond > 0  # the steps do read beyond K


@pytest.mark.parametrize("rule", [DecideRule(False), DecideRule(True, 3), DecideRule(True, 0)], ids=["lru", "lfu3", "lfu"])
def test_unions_within_k_decide_as_the_waves_rule(rule):
    """Admission K (the default): steps whose union fits K are decided exactly as in waves."""
    num_experts, num_slots, top_k = 16, 6, 2
    in_place = DecideRule(rule.use_count, rule.half_life, in_place=True)
    states = [DecideState.empty(num_experts, num_slots, "cpu") for _ in range(2)]
    for t, ids in enumerate(random_steps(5, num_experts, top_k, 50, max_tokens=3)):  # 3 x 2 <= K
        plans = [DecidePlan.empty(1, num_experts, num_slots, "cpu") for _ in range(2)]
        decide_torch(states[0], ids, plans[0], rule)
        decide_torch(states[1], ids, plans[1], in_place)
        for f in PLAN_FIELDS:
            assert torch.equal(getattr(plans[0], f), getattr(plans[1], f)), f"step {t} plan.{f}"
        for f in STATE_FIELDS:
            assert torch.equal(getattr(states[0], f), getattr(states[1], f)), f"step {t} state.{f}"


def test_hand_case():
    """K = 2, E = 8, from empty: [0, 1, 2, 3] admits 0 and 1 (slots 0, 1), reads 2 and 3 in
    place (rows 2 + 2, 2 + 3); then [2, 5] with admit 1: 2 evicts the least recent (0's slot)."""
    state = DecideState.empty(8, 2, "cpu")
    plan = DecidePlan.empty(1, 8, 2, "cpu")
    decide_torch(state, torch.tensor([[0, 1], [2, 3]]), plan, DecideRule(False, in_place=True))
    assert plan.expert_slot.tolist() == [0, 1, 4, 5, -1, -1, -1, -1]
    assert loads_of(plan) == [(0, 0), (1, 1)] and plan.step.tolist() == [0, 4, 1, 2]
    decide_torch(state, torch.tensor([[2, 5]]), plan, DecideRule(False, in_place=True, admit=1))
    assert loads_of(plan) == [(2, 0)] and plan.expert_slot.tolist()[2] == 0 and plan.expert_slot.tolist()[5] == 7
    assert plan.step.tolist() == [0, 2, 1, 1] and state.expert_of_slot.tolist() == [2, 1]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (pip install 'pagedexperts[gpu]')")
@pytest.mark.parametrize("rule", [DecideRule(False, in_place=True), DecideRule(True, 3, in_place=True, admit=2),
                                  DecideRule(True, 0, in_place=True, admit=0), DecideRule(False, in_place=True, admit=1)],
                         ids=["lru", "lfu3-admit2", "lfu-admit0", "lru-admit1"])
def test_decide_kernel_in_place_equals_reference(rule):
    from pagedexperts.paging.kernels.decide import decide_triton

    num_experts, num_slots, top_k = 12, 4, 3
    ref, tri = (DecideState.empty(num_experts, num_slots, "cpu") for _ in range(2))
    for t, ids in enumerate(random_steps(3, num_experts, top_k, 10, max_tokens=4)):
        want, got = (DecidePlan.empty(1, num_experts, num_slots, "cpu") for _ in range(2))
        decide_torch(ref, ids, want, rule)
        decide_triton(tri, ids, got, rule)
        for f in PLAN_FIELDS:
            assert torch.equal(getattr(got, f), getattr(want, f)), f"step {t} plan.{f}"
        for f in STATE_FIELDS:
            assert torch.equal(getattr(tri, f), getattr(ref, f)), f"step {t} state.{f}"
