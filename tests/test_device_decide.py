"""The device decide makes exactly the decisions of ``residency.Residency`` + its policy.

Oracle: the host residency (``residency.py``, ``eviction.py``) on the same steps. After every
step: the loads (expert, slot) of every wave in order, the expert -> slot map, the expert of
every slot, the step's hits, misses and waves, and the policy's eviction order of the slots
(LRU: its ordered map; LFU: its rank keys). Steps: seeded random steps (single and multi-wave,
repeated ids inside a step), hand cases, and the real traces in $PAGEDEXPERTS_REAL_TRACES
(recorded steps, one request at a time, 8 requests a step: multi-wave at K < 64).
These run the torch reference; tests/test_device_kernels.py holds the Triton kernel to it.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are defined (see test_device_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedexperts.residency.eviction import LFUPolicy, LRUPolicy
from pagedexperts.paging.device_residency import DeviceResidency, device_rule
from pagedexperts.residency.planner import Residency
from trace_fixtures import real_trace_steps

POLICIES = [("lru", None), ("lfu", None), ("lfu", 3), ("lfu", 0)]


def host_residency(policy: str, half_life, num_experts: int, num_slots: int) -> Residency:
    if policy == "lru":
        return Residency(num_experts, num_slots, LRUPolicy(num_slots))
    kw = {} if half_life is None else {"half_life": half_life}
    return Residency(num_experts, num_slots, LFUPolicy(num_slots, **kw))


def device_loads(plan) -> list[tuple[int, int]]:
    """The plan's loads in wave order, as the host lists them (reads the device: a test)."""
    out = []
    for w, n in enumerate(plan.count.tolist()):
        out += list(zip(plan.src[w, :n].tolist(), plan.dst[w, :n].tolist()))
    return out


def eviction_order(host: Residency) -> list[int]:
    """The host policy's slots, next victim first (over every slot, nothing protected)."""
    pol = host.policy
    if isinstance(pol, LRUPolicy):
        return list(pol._order)
    return [key[-1] for key in sorted(pol._keys(range(host.num_slots), host.expert_of_slot))]


def device_order(dev: DeviceResidency) -> list[int]:
    """The device state's slots by (count of their expert (LFU), last use, slot)."""
    st = dev.state
    last = st.last_use.tolist()
    eos = st.expert_of_slot.tolist()
    count = st.count.tolist()
    freq = [count[e] if dev.rule.use_count and e >= 0 else 0 for e in eos]
    return sorted(range(dev.num_slots), key=lambda s: (freq[s], last[s], s))


def assert_same_decisions(policy, half_life, num_experts, num_slots, steps, *, where="", backend="torch"):
    """Drive both residencies through ``steps`` (each an int array [T, k]); compare each step."""
    host = host_residency(policy, half_life, num_experts, num_slots)
    dev = DeviceResidency(num_experts, num_slots, "cpu", rule=device_rule(policy, half_life=half_life),
                          backend=backend)
    for t, ids in enumerate(steps):
        want = host.plan(np.asarray(ids).reshape(-1).tolist())
        plan = dev.decide(torch.as_tensor(np.asarray(ids), dtype=torch.int64)).plan
        msg = f"{where} {policy}/{half_life} E={num_experts} K={num_slots} step {t}"
        assert device_loads(plan) == [tuple(x) for x in want.loads], f"{msg}: loads"
        assert plan.step.tolist() == [want.hits, want.misses, len(want.waves), 0], f"{msg}: hits/misses/waves"
        assert dev.resident() == host.resident(), f"{msg}: slot map"
        assert dev.expert_of_slot() == host.expert_of_slot, f"{msg}: expert of slot"
        if host.policy.num_slots and -1 not in host.expert_of_slot:
            assert device_order(dev) == eviction_order(host), f"{msg}: eviction order"
    return len(steps)


def random_steps(rng: random.Random, num_experts: int, top_k: int, steps: int, *, max_tokens: int):
    """Steps of 1..max_tokens tokens, k ids each drawn with Zipf-like drifting weights; some
    tokens repeat an id (a degenerate router) so repeated ids inside a step occur too."""
    out = []
    for t in range(steps):
        weights = [1.0 / (1 + (e + t // 5) % num_experts) ** 1.3 for e in range(num_experts)]
        rows = []
        for _ in range(rng.randint(1, max_tokens)):
            row = rng.choices(range(num_experts), weights, k=top_k)
            rows.append(row if rng.random() < 0.2 else rng.sample(range(num_experts), top_k))
        out.append(np.array(rows))
    return out


SHAPES = [(8, 1, 1), (8, 2, 2), (8, 5, 2), (16, 4, 3), (16, 16, 4), (64, 8, 8), (60, 17, 4)]


@pytest.mark.parametrize("policy,half_life", POLICIES)
@pytest.mark.parametrize("num_experts,num_slots,top_k", SHAPES)
def test_same_decisions_on_random_steps(policy, half_life, num_experts, num_slots, top_k):
    rng = random.Random(num_experts * 1000 + num_slots * 10 + top_k)
    steps = random_steps(rng, num_experts, top_k, 80, max_tokens=6)
    assert_same_decisions(policy, half_life, num_experts, num_slots, steps)


def test_hand_cases():
    """Empty slots fill lowest first; a miss whose only candidates are empty; every slot of a
    wave protected but one; repeated ids; an LFU tie broken by recency, then by slot."""
    cases = [
        [[3, 3]], [[5, 1], [2, 1]], [[0, 1], [2, 3], [0, 4]],  # fill, reuse, evict
        [[0, 1], [1, 2], [3, 0]], [[7, 6], [5, 4], [3, 2], [1, 0]],  # multi-wave at K = 2
    ]
    for policy, half_life in POLICIES:
        for steps in cases:
            assert_same_decisions(policy, half_life, 8, 2, [np.array([s]) for s in steps])
            assert_same_decisions(policy, half_life, 8, 3, [np.array([s]) for s in steps])


def test_lfu_evicts_by_count_not_recency():
    """A hand count: expert 0 routed in 3 steps, expert 1 in 1 (after 0's last use); a miss
    evicts 1 (fewer uses) under LFU, 0 (least recent) under LRU."""
    steps = [np.array([[0]]), np.array([[0]]), np.array([[0]]), np.array([[1]]), np.array([[2]])]
    for policy, victim_expert in [("lfu", 1), ("lru", 0)]:
        dev = DeviceResidency(8, 2, "cpu", rule=device_rule(policy))
        for ids in steps[:-1]:
            dev.decide(torch.as_tensor(ids))
        before = dev.resident()
        plan = dev.decide(torch.as_tensor(steps[-1])).plan
        assert device_loads(plan) == [(2, before[victim_expert])]
    assert_same_decisions("lfu", None, 8, 2, steps)


def trace_steps():
    """(label, E, k, steps) per real trace and replay: recorded steps, B=1 and B=8 streams."""
    # recorded: as logged (OLMoE: 4,471 one-row steps, the first 1,500 kept; Qwen1.5: 104
    # steps of 11-91 rows, all multi-wave at K = k and 2k)
    for path, tr, label, steps in real_trace_steps(recorded=1500, batch1=200, batch8=100):
        layer = tr.meta.layers[0]
        yield f"{path.name} {label}", tr.meta.num_experts, tr.meta.top_k, [s.ids[layer] for s in steps]


@pytest.mark.slow
@pytest.mark.parametrize("policy,half_life", [("lru", None), ("lfu", None), ("lfu", 16)])
def test_same_decisions_on_real_traces(policy, half_life):
    compared = 0
    for label, num_experts, top_k, steps in trace_steps():
        for num_slots in sorted({top_k, 2 * top_k, num_experts // 2}):
            compared += assert_same_decisions(policy, half_life, num_experts, num_slots, steps, where=label)
    assert compared > 1000
