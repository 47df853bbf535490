"""Speculative decoding, the model-free parts: the options, the n-gram (prompt lookup) proposer,
the counters, and the acceptance rule that keeps the target's distribution.

Owns: ``SpeculativeConfig`` and its flag checks (``speculative_config``), ``SpeculativeStats``
(proposed / accepted tokens per verification step), the proposer contract (``Proposer``,
``Proposal``) and ``NgramProposer``, ``ngram_propose`` (prompt lookup: the
tokens that followed the latest earlier occurrence of the context's last n tokens, n from
``ngram_max`` down to ``ngram_min``; transformers' ``PromptLookupCandidateGenerator`` and
vLLM's ``[ngram]`` proposer do the same), ``warped_probs`` (temperature and top_p over one
row of logits: the one distribution ``sampling.sample`` draws from) and the acceptance rule.

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

Does not: run a model, hold KV caches, or batch requests (``serving.speculative``; the draft
model's proposer is ``serving.draft``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch

METHODS = ("ngram", "draft")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
MAX_NUM_SPECULATIVE_TOKENS = 32  # proposals per verification step; each adds a routed token per request
NGRAM_MAX = 3  # prompt lookup: longest context suffix matched, then shorter ones down to NGRAM_MIN
NGRAM_MIN = 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """What proposes and how many.

    ``method``: "ngram" (prompt lookup, no extra model) or "draft" (a smaller checkpoint with
    the target's tokenizer at ``draft_model_path``). ``num_speculative_tokens``: proposals per
    request per verification step (n; the step routes n + 1 tokens per request).
    ``ngram_max`` / ``ngram_min``: suffix lengths prompt lookup tries, longest first.
    """

    method: str
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    draft_model_path: str | None = None
    ngram_max: int = NGRAM_MAX
    ngram_min: int = NGRAM_MIN


def speculative_config(method: str | None, *, num_speculative_tokens: int | None = None,
                       draft_model_path: str | None = None) -> SpeculativeConfig | None:
    """The config from the flags, or None without ``--speculative``; checked before any model loads.

    Raises:
        ValueError: naming the flag: an unknown method, --draft-model-path without
            --speculative draft (or missing with it, or not a model directory),
            --num-speculative-tokens without --speculative or outside [1, 32].
    """
    if method is None:
        for flag, value in (("--draft-model-path", draft_model_path), ("--num-speculative-tokens", num_speculative_tokens)):
            if value is not None:
                raise ValueError(f"{flag} needs --speculative ({' or '.join(METHODS)})")
        return None
    if method not in METHODS:
        raise ValueError(f"--speculative {method!r}: choose one of {', '.join(METHODS)}")
    n = DEFAULT_NUM_SPECULATIVE_TOKENS if num_speculative_tokens is None else num_speculative_tokens
    if not 1 <= n <= MAX_NUM_SPECULATIVE_TOKENS:
        raise ValueError(f"--num-speculative-tokens must be in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {n}")
    if method == "ngram" and draft_model_path is not None:
        raise ValueError("--draft-model-path is for --speculative draft; --speculative ngram proposes from the "
                         "context and takes no model (drop --draft-model-path)")
    if method == "draft":
        if draft_model_path is None:
            raise ValueError("--speculative draft needs --draft-model-path DIR (a smaller checkpoint with the same tokenizer)")
        if not (Path(draft_model_path) / "config.json").is_file():
            raise ValueError(f"--draft-model-path {draft_model_path}: no config.json there (not a model directory)")
    return SpeculativeConfig(method, n, draft_model_path)


@dataclass
class SpeculativeStats:
    """Counters of speculation. A verification step = one request's n proposals checked in a
    forward (a batched forward of B requests counts B steps; ``forwards`` counts forwards).

    ``proposed``: proposals checked; ``accepted``: proposals accepted; ``emitted``: tokens
    the verification steps produced (accepted + one correction or bonus per step, before a
    finish cut them); ``padded``: query positions computed only to square the batch.
    """

    forwards: int = 0
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    padded: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (0 before any proposal)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """accepted proposals per verification step (the speed-up is this + 1 tokens per step)."""
        return self.accepted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return dict(forwards=self.forwards, steps=self.steps, proposed=self.proposed, accepted=self.accepted,
                    emitted=self.emitted, padded=self.padded, acceptance_rate=self.acceptance_rate,
                    mean_accepted_per_step=self.mean_accepted_per_step)


@dataclass(frozen=True)
class Verdict:
    """One verification: ``accepted`` proposals kept, then ``tokens`` = those proposals and
    the correction (first rejection) or bonus (all accepted) token: accepted + 1 ids."""

    accepted: int
    tokens: list[int]


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


def warped_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / temperature) over the smallest top_p nucleus, float32 [V] (logits [V],
    any float dtype; temperature > 0). ``sampling.sample`` draws from exactly this."""
    scaled = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = torch.cumsum(probs, dim=-1) - probs > top_p  # always keeps the first
        scaled = scaled.clone()
        scaled[order[drop]] = float("-inf")
    return torch.softmax(scaled, dim=-1)


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
