"""Shared by several test modules (moved from paging/test_device_decide.py)."""

from __future__ import annotations
import numpy as np
import torch
from pagedexperts.residency.eviction import LFUPolicy, LRUPolicy
from pagedexperts.paging.device_residency import DeviceResidency, device_rule
from pagedexperts.residency.planner import Residency
from support.trace_fixtures import real_trace_steps


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


def trace_steps():
    """(label, E, k, steps) per real trace and replay: recorded steps, B=1 and B=8 streams."""
    # recorded: as logged (OLMoE: 4,471 one-row steps, the first 1,500 kept; Qwen1.5: 104
    # steps of 11-91 rows, all multi-wave at K = k and 2k)
    for path, tr, label, steps in real_trace_steps(recorded=1500, batch1=200, batch8=100):
        layer = tr.meta.layers[0]
        yield f"{path.name} {label}", tr.meta.num_experts, tr.meta.top_k, [s.ids[layer] for s in steps]
