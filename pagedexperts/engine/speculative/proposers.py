"""Speculative decoding's proposers: ``Proposal``, the ``Proposer`` contract and prompt lookup
(``NgramProposer``, as transformers' ``PromptLookupCandidateGenerator`` and vLLM's ngram proposer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from pagedexperts.engine.speculative.config import NGRAM_MAX, NGRAM_MIN, SpeculativeConfig


@dataclass
class Proposal:
    """One request's ``tokens`` [n] and ``q`` [n, V] float32 (a sampling draft's; None: point masses)."""

    tokens: list[int]
    q: torch.Tensor | None = None


class Proposer(Protocol):
    """Proposes tokens for the running requests and hears what was kept."""

    def propose(self, reqs: list, budgets: list[int]) -> list[Proposal]:
        """At most ``budgets[i]`` tokens for request i (a scheduler ``Request``)."""

    def settle(self, req, kept: int) -> None:
        """The first ``kept`` tokens of the request's context are final; later proposals are dropped."""


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
    """Up to ``n`` ids: what followed the latest earlier occurrence of the last m tokens, m =
    ngram_max..ngram_min."""
    size = len(context)
    for m in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = list(context[size - m:])
        for start in range(size - m - 1, -1, -1):
            if list(context[start: start + m]) == suffix:
                return list(context[start + m: start + m + n])
    return []
