"""Speculative decoding's acceptance rule (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023,
Algorithm 2): accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a
draw from norm(max(0, p_j - q_j)); all accepted: a bonus draw from p_{n+1}. Every emitted token is
distributed as the target's p. A proposer without a distribution (n-gram) is a point mass, q_j(d_j)
= 1. Greedy: accept while d_j is the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Verdict:
    """``accepted`` proposals kept; ``tokens``: those and the correction or bonus token."""

    accepted: int
    tokens: list[int]


def accept_greedy(target_tokens: Sequence[int], proposals: Sequence[int]) -> Verdict:
    """Accept while the target's argmax ``target_tokens`` [n + 1] agree with ``proposals``."""
    m = 0
    while m < len(proposals) and proposals[m] == target_tokens[m]:
        m += 1
    return Verdict(m, list(proposals[:m]) + [int(target_tokens[m])])


def accept_sampled(p: torch.Tensor, proposals: Sequence[int], q: torch.Tensor | None,
                   generator: torch.Generator | None) -> Verdict:
    """The rule for one request: ``p`` [n + 1, V] target probabilities (row j given proposals[:j]), n
    ``proposals``, ``q`` [n, V] (None: point masses), ``generator`` (None: torch's global)."""
    for j, d in enumerate(proposals):
        q_d = 1.0 if q is None else float(q[j, d])
        u = float(torch.rand((), generator=generator))
        if u * q_d < float(p[j, d]):  # u < p/q: accepted with probability min(1, p/q)
            continue
        if q is None:
            residual = p[j].clone()
            residual[d] = 0.0
        else:
            residual = torch.clamp(p[j] - q[j], min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q to rounding: nothing to correct towards
            residual = p[j]
        token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        return Verdict(j, list(proposals[:j]) + [token])
    token = int(torch.multinomial(p[len(proposals)], 1, generator=generator))
    return Verdict(len(proposals), list(proposals) + [token])
