"""Speculative decoding's acceptance rule: which proposals a verification keeps.

Owns: ``Verdict`` (the proposals kept and the tokens emitted), ``accept_greedy`` and
``accept_sampled``.

The acceptance rule (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling", Algorithm 2): proposals d_1..d_n drawn from the draft's
q_1..q_n, the target's p_1..p_{n+1} from one verification forward. For j = 1..n: accept d_j
with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a token drawn from
norm(max(0, p_j - q_j)) and stop; if all n are accepted, emit a bonus token drawn from
p_{n+1}. Each emitted token is then distributed exactly as the target's p. A proposer without
a distribution (n-gram) is a point mass: q_j(d_j) = 1, so d_j is accepted with probability
p_j(d_j) and the residual is p_j with d_j removed. Greedy (temperature 0): accept while d_j
is the target's argmax; the emitted tokens are plain greedy decoding's.

Does not: propose (``engine.speculative.proposers``), compute the target's probabilities
(``engine.sampling.warped_probs``, called by ``engine.speculative.decoder``), or run a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Verdict:
    """One verification: ``accepted`` proposals kept, then ``tokens`` = those proposals and
    the correction (first rejection) or bonus (all accepted) token: accepted + 1 ids."""

    accepted: int
    tokens: list[int]


def accept_greedy(target_tokens: Sequence[int], proposals: Sequence[int]) -> Verdict:
    """Greedy verification: ``target_tokens`` [n + 1] are the target's argmax at each position
    (position j given the context and proposals[:j]); accept while they agree."""
    m = 0
    while m < len(proposals) and proposals[m] == target_tokens[m]:
        m += 1
    return Verdict(m, list(proposals[:m]) + [int(target_tokens[m])])


def accept_sampled(p: torch.Tensor, proposals: Sequence[int], q: torch.Tensor | None,
                   generator: torch.Generator | None) -> Verdict:
    """The acceptance rule (module docstring) for one request.

    Args:
        p: [n + 1, V] float target probabilities (row j given the context and proposals[:j]).
        proposals: n token ids.
        q: [n, V] the draft's probabilities the proposals were drawn from; None = point
            masses at the proposals (n-gram).
        generator: the request's CPU generator (None = torch's global one).
    """
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
