"""Per-request sampling: ``SamplingParams``, the logit processing (``adjusted_logits``), the warpers
(``warped_probs``), ``sample`` and ``token_logprobs``; the conventions (OpenAI's and vLLM's):
docs/server.md "Sampling". NaN or +inf logits raise ``NonFiniteLogits`` (the request fails alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from pagedexperts.generation.config import SamplingConfig

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (docs/server.md "Sampling")


def warped_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
                 min_p: float = 0.0) -> torch.Tensor:
    """float32 [V]: softmax(logits / temperature) over the top_k largest (0 = all; ties kept), then the
    top_p nucleus, then probabilities >= min_p x the largest (transformers' warpers' order)."""
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = torch.cumsum(probs, dim=-1) - probs > top_p  # always keeps the first
        scaled = scaled.clone()
        scaled[order[drop]] = float("-inf")
    if min_p > 0.0:  # p[t] < min_p * max p  <=>  scaled[t] < max scaled + log(min_p)
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(min_p), float("-inf"))
    return torch.softmax(scaled, dim=-1)


def sampling_probs(logits: torch.Tensor, params: "SamplingParams") -> torch.Tensor:
    """``warped_probs`` with ``params``' temperature, top_p, top_k and min_p: float32 [V]."""
    return warped_probs(logits, params.temperature, params.top_p, params.top_k, params.min_p)


class NonFiniteLogits(ValueError):
    """A sequence's logits hold NaN or +inf: no token (and no logprob) can be computed from them."""


def check_finite_logits(logits: torch.Tensor) -> None:
    """NonFiniteLogits when ``logits`` hold a NaN or +inf (says how many)."""
    bad = torch.isnan(logits) | torch.isposinf(logits)
    if bool(bad.any()):
        raise NonFiniteLogits(f"the model's logits for this sequence hold {int(bad.sum())} NaN or +inf values of "
                              f"{logits.numel()} (a corrupt checkpoint or a numerical overflow); no token can be chosen")


@dataclass(frozen=True)
class SamplingParams(SamplingConfig):
    """One sequence's options beyond ``SamplingConfig``'s, with OpenAI's and vLLM's (V1) meaning
    (docs/server.md): ``presence_penalty`` / ``frequency_penalty`` in [-2, 2]; ``logit_bias`` (id,
    bias in [-100, 100]); ``logprobs`` None or n >= 0 alternatives; ``prompt_logprobs`` (then
    ``max_new_tokens`` may be 0); ``top_k`` (0 = all); ``min_p`` in [0, 1]; ``repetition_penalty`` >
    0 over ``prompt_ids`` and outputs; ``min_tokens``; ``stop_token_ids``, ``ignore_eos``,
    ``include_stop_str_in_output``, ``skip_special_tokens``; ``eos_ids``: what min_tokens holds back
    (filled by ``BatchScheduler.submit``)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    prompt_ids: tuple[int, ...] = ()  # what repetition_penalty counts besides the generated tokens
    min_tokens: int = 0
    eos_ids: tuple[int, ...] = ()  # what min_tokens holds back
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @classmethod
    def of(cls, sampling: SamplingConfig) -> "SamplingParams":
        """``sampling`` itself if it is SamplingParams, else the same options with no extras."""
        if isinstance(sampling, SamplingParams):
            return sampling
        return cls(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                   top_p=sampling.top_p, seed=sampling.seed, stop=tuple(sampling.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.min_tokens
                    or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprob report: ``token`` text (a partial multi-byte character shows U+FFFD), its
    natural-log ``logprob``, ``top`` (text, id, logprob), most likely first."""

    token_id: int
    token: str
    logprob: float | None  # None: a prompt's first token (nothing predicts it)
    top: tuple[tuple[str, int, float], ...] = ()


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, output_ids: list[int]) -> torch.Tensor:
    """logits [V] after logit_bias, repetition_penalty, presence / frequency penalties and min_tokens
    (a new float32 tensor if changed); ``output_ids``: tokens so far. NonFiniteLogits for NaN or
    +inf."""
    check_finite_logits(logits)
    if not params.adjusts_logits:
        return logits
    out = logits.float().clone()
    for token_id, bias in params.logit_bias:
        out[token_id] += bias
    if params.repetition_penalty != 1.0 and (params.prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(params.prompt_ids) | set(output_ids)), dtype=torch.long)
        score = out[seen]
        out[seen] = torch.where(score < 0, score * params.repetition_penalty, score / params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids), minlength=out.shape[0])[: out.shape[0]].float()
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if len(output_ids) < params.min_tokens and params.eos_ids:
        out[list(params.eos_ids)] = float("-inf")
    return out


def sample(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
           generator: torch.Generator | None) -> int:
    """The next token from logits [V]: argmax when ``params.greedy``, else a draw from
    ``sampling_probs``."""
    logits = adjusted_logits(logits, params, output_ids)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = sampling_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int,
                   token_text: Callable[[int], str]) -> list[TokenLogprob]:
    """Reports of ``token_ids`` [T] under logits [T, V] (row t predicts token t): float32 log_softmax
    of the raw logits. NonFiniteLogits for NaN or +inf."""
    check_finite_logits(logits)
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(token_ids, dtype=torch.long)[:, None])[:, 0].tolist()
    tops = lp.topk(top_n, dim=-1) if top_n > 0 else None
    out = []
    for t, token_id in enumerate(token_ids):
        top = ()
        if tops is not None:
            top = tuple((token_text(int(i)), int(i), float(v))
                        for v, i in zip(tops.values[t].tolist(), tops.indices[t].tolist()))
        out.append(TokenLogprob(token_id, token_text(token_id), chosen[t], top))
    return out
