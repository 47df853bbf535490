"""Eviction policies of issue 8 (LFU with aging, frequency-weighted LRU, adaptive) and
``Residency.prefetch``: hand-computed victim orders on tiny routings, deterministic.

Each routing is a list of steps; each step the list of experts it routes to (one layer).
"""

from __future__ import annotations

import pytest

from pagedexperts.residency.planner import Residency
from pagedexperts.residency.eviction import FrequencyLRUPolicy, LFUPolicy, LRUPolicy
from pagedexperts.residency.policies import DEFAULT_POLICY, POLICIES, AdaptivePolicy, make_policy


def run(policy, steps, *, num_experts=16, num_slots=2):
    """Plan every step; return (residency, list of (hits, misses) per step)."""
    res = Residency(num_experts, num_slots, policy)
    return res, [(p.hits, p.misses) for p in (res.plan(s) for s in steps)]


def resident(res: Residency) -> set[int]:
    return set(res.resident())


# ---- registry --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_is_selectable_and_plans(name):
    res = Residency(8, 3, make_policy(name, 3))
    plan = res.plan([0, 1, 2, 3, 4])  # 5 experts, 3 slots: two waves, later ones evict
    assert (plan.hits, plan.misses, len(plan.waves)) == (0, 5, 2)
    assert len(resident(res)) == 3


def test_unknown_policy_lists_choices():
    with pytest.raises(ValueError, match="adaptive.*flru.*lfu.*lru"):
        make_policy("mru", 4)


def test_default_policy_is_registered():
    assert DEFAULT_POLICY in POLICIES


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "simulate"])
def test_every_help_names_the_runtime_default_policy(command, capsys):
    """``--help`` says the runtime's default is LFU (DEFAULT_POLICY), never LRU."""
    from pagedexperts.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert DEFAULT_POLICY == "lfu"
    assert f"default {DEFAULT_POLICY}" in text or f"{DEFAULT_POLICY} (the runtime's --policy default)" in text
    assert "LRU, the runtime's default" not in text


def test_a_residency_without_a_policy_runs_the_policy_default():
    """One default: a bare ``Residency`` (so an executor built without a policy) plans as
    ``--policy``'s default does. LFU and LRU part on this routing (0 used twice, 1 once)."""
    steps = [[0], [0], [1], [2]]
    assert type(Residency(16, 2).policy) is POLICIES[DEFAULT_POLICY]
    assert resident(run(None, steps)[0]) == resident(run(make_policy(DEFAULT_POLICY, 2), steps)[0]) == {0, 2}


# ---- LFU with aging --------------------------------------------------------------------------


def test_lfu_evicts_least_frequent_where_lru_evicts_least_recent():
    # 0 routed twice, 1 once; 2 arrives: LFU evicts 1, LRU evicts 0 (used longer ago).
    steps = [[0], [0], [1], [2]]
    assert resident(run(LFUPolicy(2, half_life=0), steps)[0]) == {0, 2}
    assert resident(run(LRUPolicy(2), steps)[0]) == {1, 2}


def test_lfu_aging_halves_counts():
    # half_life 2: counts halve (floor) at steps 2 and 4; by step 4 both 0 and 1 count 0, so the
    # LRU tie-break evicts 0, as LRU does.
    steps = [[0], [0], [1], [2]]
    assert resident(run(LFUPolicy(2, half_life=2), steps)[0]) == {1, 2}


def test_lfu_count_survives_eviction():
    # 6 is evicted at step 4 with count 1, returns at step 5 (count 2) evicting 7 (count 1);
    # at step 6, 5 and 6 both count 2: the LRU tie-break evicts 5.
    res, counts = run(LFUPolicy(2, half_life=0), [[5], [5], [6], [7], [6], [8]])
    assert resident(res) == {6, 8}
    assert [m for _, m in counts] == [1, 0, 1, 1, 1, 1]


# ---- frequency-weighted LRU ------------------------------------------------------------------


def test_flru_victim_order_by_uses_over_age():
    pol = FrequencyLRUPolicy(2)
    res = Residency(16, 2, pol)
    for s in [[0], [0], [0], [1]]:
        res.plan(s)
    # step 5: expert 0 has 3 uses, idle 2 steps -> 3/3; expert 1 1 use, idle 1 -> 1/2: evict 1.
    res.plan([2])
    assert resident(res) == {0, 2}
    # step 6: 0 -> 3/4, 2 -> 1/2: evict 2. step 7: 0 -> 3/5, 3 -> 1/2: evict 3.
    res.plan([3])
    res.plan([4])
    assert resident(res) == {0, 4}
    # step 8: 0 -> 3/6 = 1/2 ties 4 -> 1/2: least recently used (0) goes.
    res.plan([5])
    assert resident(res) == {4, 5}


def test_flru_with_equal_uses_is_lru():
    # Every resident expert used once: 1/(age + 1) orders by age, so the oldest goes, as in LRU.
    steps = [[0], [1], [2], [3], [4, 5]]
    a, _ = run(FrequencyLRUPolicy(3), steps, num_slots=3)
    b, _ = run(LRUPolicy(3), steps, num_slots=3)
    assert a.resident() == b.resident() == {3: 0, 4: 1, 5: 2}


# ---- adaptive --------------------------------------------------------------------------------


def test_adaptive_starts_as_lru():
    steps = [[0], [1], [2], [3], [0], [4]]
    a, ha = run(AdaptivePolicy(2), steps)
    b, hb = run(LRUPolicy(2), steps)
    assert (a.resident(), ha) == (b.resident(), hb)


def test_adaptive_follows_frequency_when_it_wins():
    # A hot expert 0 between streams of one-off experts: LRU keeps losing 0, LFU keeps it.
    steps = []
    for i in range(40):
        steps += [[0], [1 + 2 * (i % 7)], [2 + 2 * (i % 7)]]
    pol = AdaptivePolicy(2)
    _, ad = run(pol, steps)
    _, lru = run(LRUPolicy(2), steps)
    assert AdaptivePolicy.CANDIDATES[pol.leader][0] == "lfu"
    assert sum(h for h, _ in ad) > sum(h for h, _ in lru) + 20


# ---- Residency.prefetch ----------------------------------------------------------------------


def test_prefetch_fills_empty_then_evicts_by_policy_within_budget():
    res = Residency(16, 3, LRUPolicy(3))
    res.plan([0, 1])  # slots 0, 1; slot 2 empty
    loads = res.prefetch([5, 0, 6, 7], budget=2)  # 0 resident: skipped; 5 -> empty slot 2
    assert [(ld.expert, ld.slot) for ld in loads] == [(5, 2), (6, 1)]  # 6 evicts 1 (LRU, not 0: predicted)
    assert resident(res) == {0, 5, 6}


def test_prefetch_never_evicts_a_predicted_expert():
    res = Residency(16, 2, LRUPolicy(2))
    res.plan([0, 1])
    assert res.prefetch([0, 1, 2], budget=4) == ()  # both slots hold predicted experts
    assert resident(res) == {0, 1}


def test_prefetched_expert_is_a_hit_next_step():
    res = Residency(16, 2, LRUPolicy(2))
    res.plan([0])
    res.prefetch([3], budget=1)
    plan = res.plan([3, 0])
    assert (plan.hits, plan.misses) == (2, 0)
