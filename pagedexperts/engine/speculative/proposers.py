"""Speculative decoding's proposers: the contract and prompt lookup (n-gram).

Owns: ``Proposal`` (one request's proposed tokens and, from a sampling draft, the
probabilities they were drawn from), the ``Proposer`` contract, ``context_of`` and
``NgramProposer`` / ``ngram_propose`` (prompt lookup: the tokens that followed the latest
earlier occurrence of the context's last n tokens, n from ``ngram_max`` down to ``ngram_min``;
transformers' ``PromptLookupCandidateGenerator`` and vLLM's ``[ngram]`` proposer do the same).

Does not: run a model (the draft model's proposer is ``engine.speculative.draft``), or decide
acceptance (``engine.speculative.acceptance``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from pagedexperts.engine.speculative.config import NGRAM_MAX, NGRAM_MIN, SpeculativeConfig


@dataclass
class Proposal:
    """One request's proposals: ``tokens`` [n] and, from a draft that sampled them, ``q`` [n, V]
    (float32 probabilities they were drawn from; None = point masses, or greedy)."""

    tokens: list[int]
    q: torch.Tensor | None = None


class Proposer(Protocol):
    """Proposes tokens for the running requests and hears what was kept."""

    def propose(self, reqs: list, budgets: list[int]) -> list[Proposal]:
        """At most ``budgets[i]`` tokens for request i (a scheduler ``Request``)."""

    def settle(self, req, kept: int) -> None:
        """The first ``kept`` tokens of the request's context (prompt + outputs + accepted
        proposals) are final; anything proposed past them is dropped."""


def context_of(req) -> list[int]:
    """A request's context: prompt ids + output ids."""
    return req.prompt_ids + req.output_ids


class NgramProposer:
    """Prompt lookup over each request's own prompt + output (no model, no state)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, reqs: list, budgets: list[int]) -> list[Proposal]:
        c = self.config
        return [Proposal(ngram_propose(context_of(r), n, ngram_max=c.ngram_max, ngram_min=c.ngram_min) if n > 0 else [])
                for r, n in zip(reqs, budgets)]

    def settle(self, req, kept: int) -> None:
        pass


def ngram_propose(context: Sequence[int], n: int, *, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> list[int]:
    """Up to ``n`` proposed token ids: for m = ngram_max..ngram_min, find the latest earlier
    occurrence of the context's last m tokens and propose the tokens that followed it; [] when
    no suffix recurs. Pure Python, O(len(context) x ngram_max)."""
    size = len(context)
    for m in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = list(context[size - m:])
        for start in range(size - m - 1, -1, -1):
            if list(context[start: start + m]) == suffix:
                return list(context[start + m: start + m + n])
    return []
