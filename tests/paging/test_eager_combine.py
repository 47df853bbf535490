"""The eager experts implementation's combine order, guarded at every top_k and dtype.

transformers' eager experts loop (``Qwen3MoeExperts.forward``) adds each expert's weighted
output into the token's row in ASCENDING EXPERT ID (its loop runs over the hit experts in id
order), not in the token's top-k order. Floating-point addition is not associative, so a paged
combine in top-k order gives different bits whenever a token's ids are not already ascending.
The model-level tests see this only where rounding happens to differ (issue 22: one test at
top_k = 4 caught the mutant); here the step is built so that order always matters: the ids of
every token are in DESCENDING order and the weights span 2^-10 .. 2^10, so partial sums lose
different low bits in each order. (At top_k = 2 the two orders are 0 + a + b and 0 + b + a,
equal bit for bit: addition is commutative; the case runs as a plain exactness check.)

Oracle: the module's own eager forward over all E experts (unpaged), torch.equal.
Legend: T tokens, H hidden, k top_k, E experts, K slots.
"""

from __future__ import annotations

import pytest
import torch

from support.tiny import assert_same
from support.synthetic_layer import E, H, paged, synthetic_experts, unpaged


def descending_step(top_k: int, tokens: int, dtype, *, seed: int):
    """hidden [T, H], top_k_index [T, k] (distinct ids, descending per token), top_k_weights [T, k]
    spanning 2^-10 .. 2^10 (not normalised: order-sensitive sums)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k].sort(descending=True).values for _ in range(tokens)])
    hidden = torch.randn(tokens, H, generator=gen).to(dtype)
    exponents = torch.randint(-10, 11, (tokens, top_k), generator=gen).to(torch.float32)
    weights = (torch.rand(tokens, top_k, generator=gen) + 0.5) * torch.pow(2.0, exponents)
    return hidden, ids, weights.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("top_k", [2, 3, 4, 8])
def test_eager_combine_is_ascending_expert_id(top_k, dtype, threads):
    """K = top_k (multi-wave for T > 1) and K = E (one wave): paged eager == unpaged eager."""
    module = synthetic_experts(dtype)
    for num_slots in (top_k, E):
        pager = paged(module, num_slots, "eager")
        for seed in range(4):
            hidden, ids, weights = descending_step(top_k, 5, dtype, seed=seed)
            want = unpaged(module, "eager", hidden, ids, weights)
            assert_same(pager.step(module, hidden, ids, weights), want,
                        f"eager top_k={top_k} K={num_slots} {dtype} seed {seed} at {threads} threads")


def test_the_step_is_order_sensitive():
    """The inputs above do tell the orders apart: summing the same weighted outputs in top-k
    order differs from ascending id order (else the test above could not fail)."""
    module = synthetic_experts(torch.bfloat16)
    hidden, ids, weights = descending_step(4, 5, torch.bfloat16, seed=0)
    want = unpaged(module, "eager", hidden, ids, weights)
    outs = []
    for j in range(4):  # each entry's weighted output, computed alone by the module's own loop
        one = torch.zeros_like(weights)
        one[:, j] = weights[:, j]
        outs.append(unpaged(module, "eager", hidden, ids, one))
    topk_order = torch.zeros_like(want)
    for out in outs:  # top-k order: entry 0 first (the highest id here)
        topk_order = topk_order + out
    assert not torch.equal(topk_order, want)
