"""Prefetch (--prefetch): outputs stay exact, and the counters add up.

Reference: the same checkpoint loaded with plain transformers (all experts resident). The paged
model with and without prefetch must give torch.equal logits at every greedy step. Legend as in
conftest: E = 16, k = 2, 2 MoE layers; K resident slots.
"""

from __future__ import annotations

import pytest
import torch

from support.tiny import E, PAD_ID, TOP_K, assert_same, greedy_logits, prompt
from pagedexperts.loading.loader import load_model
from pagedexperts.paging.prefetch import NextLayerPrefetcher, prediction_order

NEW_TOKENS = 16


def single():
    ids = prompt(9, 1).unsqueeze(0)
    return ids, torch.ones_like(ids)


def batch_logits(model) -> torch.Tensor:
    """One forward of a batch of 3 left-padded prompts (a multi-token step with padding rows)."""
    rows = [prompt(n, 10 + n) for n in (9, 5, 7)]
    ids = torch.stack([torch.cat([torch.full((9 - len(r),), PAD_ID), r]) for r in rows])
    mask = (torch.arange(9) >= torch.tensor([[9 - len(r)] for r in rows])).long()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def outputs(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(every greedy step's logits of one prompt, logits of a padded batch), in that order."""
    return greedy_logits(model, *single(), steps=NEW_TOKENS), batch_logits(model)


@pytest.fixture(scope="module")
def reference(reference_model):
    return outputs(reference_model())


@pytest.mark.default_threads
@pytest.mark.parametrize("budget", [1, TOP_K, 2 * TOP_K])
@pytest.mark.parametrize("num_resident", [TOP_K, 2 * TOP_K, E // 2])
def test_prefetch_is_exact(tiny_moe_dir, reference, num_resident, budget):
    paged, _ = load_model(tiny_moe_dir, num_resident=num_resident)
    fetched, _ = load_model(tiny_moe_dir, num_resident=num_resident, prefetch=True, prefetch_budget=budget)
    for got, want, what in zip(outputs(paged), reference, ("greedy", "batch")):
        assert_same(got, want, f"paged {what} logits")
    for got, want, what in zip(outputs(fetched), reference, ("greedy", "batch")):
        assert_same(got, want, f"paged + prefetch {what} logits")
    total = fetched.pagedexperts.prefetch_stats()["total"]
    assert total["issued"] > 0
    assert total["issued"] == total["used"] + total["wasted"]
    assert total["bytes"] == total["issued"] * fetched.pagedexperts.expert_bytes


def test_prefetch_targets_the_next_layer_and_skips_the_last(tiny_moe_dir):
    model, _ = load_model(tiny_moe_dir, num_resident=2 * TOP_K, prefetch=True)
    pagers = model.pagedexperts.runners
    first, last = min(pagers), max(pagers)
    assert isinstance(pagers[first].prefetcher, NextLayerPrefetcher)
    assert pagers[first].prefetcher.target is pagers[last]
    assert pagers[first].prefetcher.budget == TOP_K
    assert pagers[last].prefetcher is None
    assert pagers[first].prefetch_stats.issued == 0  # nothing prefetches into the first layer


def test_prefetch_counts_used_and_wasted(tiny_moe_dir):
    """Layer 1's stats: every prefetch into it is settled by its next step as used or wasted,
    and used prefetches are hits (so prefetch raises layer 1's hits when it predicts right)."""
    model, _ = load_model(tiny_moe_dir, num_resident=2 * TOP_K, prefetch=True)
    outputs(model)
    ps = model.pagedexperts.runners[1].prefetch_stats
    assert ps.issued > 0 and not ps.pending
    assert ps.used + ps.wasted == ps.issued
    assert ps.used <= model.pagedexperts.runners[1].stats.hits


def test_bad_budget_names_the_flag(tiny_moe_dir):
    with pytest.raises(ValueError, match="--prefetch-budget"):
        load_model(tiny_moe_dir, num_resident=2 * TOP_K, prefetch=True, prefetch_budget=0)


def test_prediction_order_most_tokens_first_then_lower_id():
    assert prediction_order([[3, 1], [1, 7], [7, 2]]) == [1, 7, 2, 3]
    assert prediction_order([]) == []
