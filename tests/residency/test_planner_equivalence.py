"""The O(log K) planner makes exactly the decisions of the O(misses x K) one it replaced.

Oracle: ``tests/support/planner_oracle.py``, a verbatim copy of the old residency module and Belady
policy. For every policy (the runtime's and Belady's), the same routing goes through both and
every ``StepPlan`` (waves, their experts, slots and loads, hits, misses), every prefetch's
loads and the final slot maps must be equal: on skewed random routing (hits and misses, single
and multi-wave steps, prefetches between steps, LFU aging) and on the real traces in
$PAGEDEXPERTS_REAL_TRACES (``trace_fixtures``).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from support import planner_oracle as old
from pagedexperts.residency import planner, policies
from pagedexperts.residency.belady import BeladyPolicy
from support.trace_fixtures import real_trace_steps

RUNTIME_POLICIES = [("lru", {}), ("lfu", {}), ("lfu", {"half_life": 3}), ("lfu", {"half_life": 0}),
                    ("flru", {}), ("adaptive", {}), ("adaptive", {"window": 4})]


def pair(name: str, kw: dict, num_experts: int, num_slots: int, unions: list[list[int]]):
    """(new Residency, oracle Residency) with policy ``name``."""
    if name == "belady":
        return (planner.Residency(num_experts, num_slots, BeladyPolicy(num_slots, unions)),
                old.Residency(num_experts, num_slots, old.BeladyPolicy(num_slots, unions)))
    return (planner.Residency(num_experts, num_slots, policies.POLICIES[name](num_slots, **kw)),
            old.Residency(num_experts, num_slots, old.POLICIES[name](num_slots, **kw)))


def skewed_steps(rng: random.Random, num_experts: int, top_k: int, steps: int) -> list[list[int]]:
    """Steps of 1-40 tokens, each routing to ``top_k`` distinct experts drawn with Zipf-like
    weights that drift, so hits, misses, big unions and reuse all occur."""
    out = []
    for t in range(steps):
        weights = [1.0 / (1 + (e + t // 7) % num_experts) ** 1.2 for e in range(num_experts)]
        tokens = rng.choice([1, 1, 2, 4, 8, 40])
        ids = []
        for _ in range(tokens):
            chosen: set[int] = set()
            while len(chosen) < top_k:
                chosen.add(rng.choices(range(num_experts), weights)[0])
            ids += sorted(chosen)
        out.append(ids)
    return out


def assert_same(new, ref, steps, *, rng: random.Random | None = None):
    for t, routed in enumerate(steps):
        if rng is not None and rng.random() < 0.3:  # a prefetch between steps (repeats, ids out of range)
            predicted = rng.choices(range(-1, new.num_experts + 1), k=rng.randint(0, new.num_experts // 2))
            budget = rng.randint(0, new.num_slots)
            got = new.prefetch(predicted, budget=budget)
            want = ref.prefetch(predicted, budget=budget)
            assert got == want, f"step {t}: prefetch {predicted} budget {budget}: {got} != {want}"
        got, want = new.plan(routed), ref.plan(routed)
        assert got == want, f"step {t}: routed {sorted(set(routed))}:\n new {got}\n old {want}"
    assert new.resident() == ref.resident()
    assert new.expert_of_slot == ref.expert_of_slot


SHAPES = [(8, 1, 1), (8, 2, 2), (8, 8, 2), (16, 4, 2), (16, 15, 3), (64, 8, 8), (64, 32, 8), (128, 64, 8)]


@pytest.mark.parametrize("name,kw", RUNTIME_POLICIES + [("belady", {})], ids=lambda x: str(x) if x else "")
@pytest.mark.parametrize("num_experts,num_slots,top_k", SHAPES)
def test_same_plans_on_random_routing(name, kw, num_experts, num_slots, top_k):
    rng = random.Random(hash((name, str(kw), num_experts, num_slots)) % 1000)
    steps = skewed_steps(rng, num_experts, top_k, 60)
    unions = [sorted(set(s)) for s in steps]
    new, ref = pair(name, kw, num_experts, num_slots, unions)
    assert_same(new, ref, steps, rng=None if name == "belady" else rng)


def trace_cases():
    for path, tr, label, steps in real_trace_steps(batch1=600):
        yield path.name, label, tr.meta, steps


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", RUNTIME_POLICIES[:-1] + [("belady", {})], ids=lambda x: str(x) if x else "")
def test_same_plans_on_real_traces(name, kw):
    for trace_name, label, meta, steps in trace_cases():
        for layer in meta.layers:
            unions = [np.unique(s.ids[layer]).tolist() for s in steps]
            for num_slots in sorted({meta.top_k, 2 * meta.top_k, meta.num_experts // 2}):
                new, ref = pair(name, kw, meta.num_experts, num_slots, unions)
                try:
                    assert_same(new, ref, unions)
                except AssertionError as err:
                    raise AssertionError(f"{trace_name} {label} layer {layer} K={num_slots}: {err}") from None
