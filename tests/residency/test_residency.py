"""Residency and wave planner: LRU order, wave rules, accounting. Tensor-free (no torch here).

Spec (docs/design.md "The layer-step", issue 2): resident experts first, then misses in ascending id; waves of at
most K experts covering the union once with distinct slots; a miss's victim is never a slot of
the current wave; least recently used goes first; ties deterministic; counts per distinct
expert per layer per step.
"""

from __future__ import annotations

import math
import random
import re
import subprocess
import sys

import pytest

from pagedexperts.residency.planner import Load, Residency
from pagedexperts.residency.policies import POLICIES, make_policy
from pagedexperts.residency.eviction import EMPTY, LRUPolicy

# (E, K, k) combinations: K = k, 2k, E/2, E and odd sizes.
SHAPES = [(8, 2, 2), (8, 4, 2), (8, 8, 2), (16, 4, 4), (16, 8, 2), (16, 16, 2), (6, 3, 1), (5, 5, 3)]


def random_steps(num_experts: int, top_k: int, *, steps: int, tokens: int, seed: int) -> list[list[int]]:
    """Routed expert ids of ``steps`` steps: each of ``tokens`` tokens picks ``top_k`` distinct experts."""
    rng = random.Random(seed)
    return [
        [e for _ in range(tokens) for e in rng.sample(range(num_experts), top_k)] for _ in range(steps)
    ]


def check_plan_invariants(res: Residency, routed: list[int], before: dict[int, int]) -> None:
    """Plan one step and check every wave rule against the slot map ``before`` the step."""
    plan = res.plan(routed)
    union = sorted(set(routed))
    k_slots = res.num_slots
    planned = [e for w in plan.waves for e in w.experts]
    assert sorted(planned) == union, "waves cover each routed expert exactly once"
    assert len(planned) == len(set(planned))
    assert len(plan.waves) == math.ceil(len(union) / k_slots)
    hits = [e for e in union if e in before]
    assert (plan.hits, plan.misses) == (len(hits), len(union) - len(hits))
    assert planned == hits + [e for e in union if e not in before], "hits first, then misses by id"
    for wave in plan.waves:
        assert 1 <= len(wave.experts) <= k_slots
        assert len(set(wave.slots)) == len(wave.slots), "distinct slots within a wave"
        assert all(0 <= s < k_slots for s in wave.slots)
        assert [ld.expert for ld in wave.loads] == [e for e in wave.experts if e not in before]
        assert {ld.slot for ld in wave.loads} <= set(wave.slots)
    # loads of the whole step = misses, one each, and the final map agrees with the last waves
    assert sorted(ld.expert for ld in plan.loads) == sorted(e for e in union if e not in before)
    last = plan.waves[-1] if plan.waves else None
    if last is not None:
        for e, s in zip(last.experts, last.slots):
            assert res.slot_of_expert[e] == s
    assert all(res.expert_of_slot[s] == e for e, s in res.slot_of_expert.items())


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("E,K,k", SHAPES)
def test_random_routing_keeps_every_wave_rule(E, K, k, policy):
    """The wave rules hold whatever the eviction policy."""
    res = Residency(E, K, make_policy(policy, K))
    for tokens in (1, 3, 8):
        for routed in random_steps(E, k, steps=15, tokens=tokens, seed=E * 100 + K * 10 + k + tokens):
            check_plan_invariants(res, routed, res.resident())


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("E,K,k", SHAPES)
def test_current_wave_is_never_evicted(E, K, k, policy):
    """Within a wave, a load never targets a slot another expert of that wave sits in."""
    res = Residency(E, K, make_policy(policy, K))
    for routed in random_steps(E, k, steps=30, tokens=4, seed=7 + E + K + k):
        plan = res.plan(routed)
        for wave in plan.waves:
            loaded = {ld.slot for ld in wave.loads}
            kept = [s for e, s in zip(wave.experts, wave.slots) if Load(e, s) not in wave.loads]
            assert not loaded & set(kept), "a load evicted an expert of its own wave"


@pytest.mark.parametrize("E,K,k", SHAPES)
def test_fully_resident_step_loads_nothing(E, K, k):
    res = Residency(E, K, LRUPolicy(K))
    routed = list(range(K))
    res.plan(routed)  # warm-up: K misses
    for subset in (routed, routed[:k], list(reversed(routed))):
        plan = res.plan(subset)
        assert plan.loads == ()
        assert (plan.hits, plan.misses) == (len(set(subset)), 0)
        assert len(plan.waves) == 1


@pytest.mark.parametrize("E,k", [(8, 2), (16, 4), (5, 3)])
def test_all_resident_never_misses_after_warm_up(E, k):
    res = Residency(E, E, LRUPolicy(E))
    steps = random_steps(E, k, steps=40, tokens=5, seed=E + k)
    seen: set[int] = set()
    for routed in steps:
        plan = res.plan(routed)
        assert plan.misses == len(set(routed) - seen)
        assert len(plan.waves) == 1
        seen |= set(routed)
    assert seen == set(range(E))
    for routed in steps:
        plan = res.plan(routed)
        assert plan.misses == 0 and plan.loads == ()


@pytest.mark.parametrize("E,k", [(8, 2), (16, 4), (6, 1)])
def test_k_equal_top_k_runs_one_token_in_one_wave(E, k):
    """K = k: a single token always fits one wave; a batch needs ceil(|union| / k) waves."""
    res = Residency(E, k, LRUPolicy(k))
    for routed in random_steps(E, k, steps=30, tokens=1, seed=E):
        plan = res.plan(routed)
        assert len(plan.waves) == 1 and plan.union_size == k
    for routed in random_steps(E, k, steps=10, tokens=6, seed=E + 1):
        check_plan_invariants(res, routed, res.resident())


def test_lru_evicts_in_exact_order():
    """A scripted sequence on E=6, K=3 with the victims worked out by hand."""
    res = Residency(6, 3, LRUPolicy(3))
    p = res.plan([0, 1, 2])  # empty slots fill lowest id first
    assert p.loads == (Load(0, 0), Load(1, 1), Load(2, 2))
    p = res.plan([0])  # hit: 0 becomes most recent; LRU order now 1, 2, 0
    assert (p.hits, p.misses, p.loads) == (1, 0, ())
    p = res.plan([3])  # evicts 1 (slot 1)
    assert p.loads == (Load(3, 1),)
    p = res.plan([4])  # evicts 2 (slot 2)
    assert p.loads == (Load(4, 2),)
    p = res.plan([2, 3])  # 3 hit; 2 miss evicts 0 (slot 0), the oldest not in the wave
    assert (p.hits, p.misses, p.loads) == (1, 1, (Load(2, 0),))
    assert res.resident() == {2: 0, 3: 1, 4: 2}
    p = res.plan([5, 0])  # misses in ascending id: 0 evicts 4 (slot 2), then 5 evicts 3 (slot 1)
    assert p.loads == (Load(0, 2), Load(5, 1))
    assert res.resident() == {2: 0, 0: 2, 5: 1}


def test_lru_recency_within_a_step_follows_ascending_expert_id():
    res = Residency(4, 2, LRUPolicy(2))
    res.plan([1, 0])  # loads 0 then 1: 0 is older
    p = res.plan([2])
    assert p.loads == (Load(2, 0),), "expert 0 (touched first within its step) is evicted"


def test_multi_wave_step_exact_plan():
    """E=8, K=2, union of 5 with 2 resident: waves [hits], [m, m], [m], victims outside each wave."""
    res = Residency(8, 2, LRUPolicy(2))
    res.plan([3, 6])  # 3 -> slot 0, 6 -> slot 1
    p = res.plan([6, 3, 0, 7, 1])
    assert [w.experts for w in p.waves] == [(3, 6), (0, 1), (7,)]
    assert [w.slots for w in p.waves] == [(0, 1), (0, 1), (0,)]
    assert [w.loads for w in p.waves] == [(), (Load(0, 0), Load(1, 1)), (Load(7, 0),)]
    assert (p.hits, p.misses, p.union_size) == (2, 3, 5)
    assert res.resident() == {7: 0, 1: 1}


def test_duplicates_count_once_per_step():
    """Five tokens routed to one missing expert: one miss and one page-in."""
    res = Residency(8, 4, LRUPolicy(4))
    p = res.plan([5, 5, 5, 5, 5, 2, 2])
    assert (p.hits, p.misses, len(p.loads)) == (0, 2, 2)
    p = res.plan([5] * 10)
    assert (p.hits, p.misses) == (1, 0)


def test_empty_step_plans_nothing():
    p = Residency(8, 2, LRUPolicy(2)).plan([])
    assert p.waves == () and (p.hits, p.misses) == (0, 0)


@pytest.mark.parametrize("E,K,k", SHAPES)
def test_plans_are_deterministic(E, K, k):
    steps = random_steps(E, k, steps=25, tokens=4, seed=3)
    runs = []
    for _ in range(2):
        res = Residency(E, K, LRUPolicy(K))
        runs.append([res.plan(r) for r in steps])
    assert runs[0] == runs[1]
    # the order of ids inside a step does not matter either
    res = Residency(E, K, LRUPolicy(K))
    assert [res.plan(list(reversed(r))) for r in steps] == runs[0]


def test_lru_ties_break_on_lowest_slot():
    policy = LRUPolicy(4)
    assert policy.victim([3, 1, 2], [0, 1, 2, 3]) == 1


@pytest.mark.parametrize("bad", [-1, 8, 100])
def test_out_of_range_expert_raises(bad):
    res = Residency(8, 2, LRUPolicy(2))
    with pytest.raises(ValueError, match=rf"routed expert id {bad} outside \[0, E=8\)"):
        res.plan([0, bad])
    assert res.resident() == {}, "a rejected step changes nothing"


@pytest.mark.parametrize("K", [0, -1, 9])
def test_bad_num_slots_raises_naming_the_flag(K):
    with pytest.raises(ValueError, match=rf"K={K}.*E=8.*--num-resident"):
        Residency(8, K)


def test_unknown_policy_lists_choices():
    with pytest.raises(ValueError, match=rf"'mru'; choose one of {re.escape(str(sorted(POLICIES)))} \(--policy\)"):
        make_policy("mru", 4)
    assert isinstance(make_policy("lru", 4), LRUPolicy)


def test_fresh_residency_is_empty():
    res = Residency(8, 3, LRUPolicy(3))
    assert res.expert_of_slot == [EMPTY] * 3 and res.resident() == {}


STDLIB_ONLY = ("pagedexperts.residency.planner", "pagedexperts.residency.policies", "pagedexperts.residency.belady",
               "pagedexperts.stats.accounting", "pagedexperts.models.config", "pagedexperts.storage.safetensors_files",
               "pagedexperts.analysis.sizing", "pagedexperts.generation.config")


def test_residency_imports_without_torch():
    """The tensor-free layers (docs/design.md "Contracts"): importing them loads neither torch nor numpy."""
    code = f"import sys, {', '.join(STDLIB_ONLY)}; sys.exit('torch' in sys.modules or 'numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
