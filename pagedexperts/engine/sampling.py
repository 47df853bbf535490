"""Per-request sampling for the server: logit processing, the next token, logprobs, stop strings.

Owns: ``SamplingParams`` (the generation options of ONE sequence: temperature, top_p, top_k,
min_p, seed, stop strings, OpenAI's presence / frequency penalties and logit_bias,
repetition_penalty, min_tokens, vLLM's stop_token_ids / ignore_eos /
include_stop_str_in_output / skip_special_tokens, how many logprobs to report), the rule for tiny temperatures,
``sample`` (one token from one row of logits) and ``token_logprob`` (the chosen token's logprob
and the top alternatives). The text a client may see after each token is
``generation.stop_text``'s (one rule for generate and the server).
Tensor-light, model-free, thread-free: the scheduler calls it.

Conventions (as OpenAI and vLLM's defaults):

- logit processing order: logit_bias is added; repetition_penalty divides the positive and
  multiplies the negative logits of every token in the prompt or generated so far
  (transformers' ``RepetitionPenaltyLogitsProcessor``, CTRL, Keskar et al. 2019; vLLM's rule);
  the presence / frequency penalties count the tokens GENERATED so far (not the prompt):
  ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)`` (OpenAI's
  "Frequency and presence penalties" formula); while fewer than min_tokens tokens are
  generated the end-of-sequence ids and stop_token_ids get -inf (transformers'
  ``MinNewTokensLengthLogitsProcessor``; vLLM's min_tokens processor masks both).
  Then temperature, top_k (keep the logits >= the k-th largest: ``TopKLogitsWarper``), top_p
  (the smallest nucleus) and min_p (keep probabilities >= min_p x the largest:
  ``MinPLogitsWarper``) shape the distribution, in transformers' warper order.
- temperature below ``GREEDY_BELOW`` (1e-5, vLLM's ``_SAMPLING_EPS``) samples greedily:
  dividing by it would overflow float32 (1e-40 gave inf / nan probabilities), and the
  distribution is already a point mass at the argmax to float32 precision.
- logprobs are the model's own: ``log_softmax`` of the raw logits in float32, before
  logit_bias, penalties, temperature and top_p (vLLM's default ``raw_logprobs``).
- logits holding NaN or +inf (a corrupt checkpoint, an overflow) choose no token: ``sample``,
  the speculative acceptance rule (via ``adjusted_logits``) and ``token_logprobs`` raise
  ``NonFiniteLogits``, which fails that request alone (``engine.isolation``); -inf is a token
  the model rules out, and passes.

Does not: run the model, batch, or speak HTTP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from pagedexperts.generation.config import SamplingConfig

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (see the module docstring)


def warped_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
                 min_p: float = 0.0) -> torch.Tensor:
    """softmax(logits / temperature) over the top_k largest logits (0 = all; ties with the k-th
    kept), then the smallest top_p nucleus, then the tokens with probability >= min_p x the
    largest: float32 [V] (logits [V], any float dtype; temperature > 0). transformers'
    ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper`` in that order. ``sample``
    draws from exactly this, and speculative decoding's acceptance rule compares against it."""
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
    """Raises NonFiniteLogits when ``logits`` (any shape, float) hold a NaN or +inf, with how many."""
    bad = torch.isnan(logits) | torch.isposinf(logits)
    if bool(bad.any()):
        raise NonFiniteLogits(f"the model's logits for this sequence hold {int(bad.sum())} NaN or +inf values of "
                              f"{logits.numel()} (a corrupt checkpoint or a numerical overflow); no token can be chosen")


@dataclass(frozen=True)
class SamplingParams(SamplingConfig):
    """The options of one sequence, beyond ``SamplingConfig``'s (max_new_tokens, temperature,
    top_p, seed, stop).

    ``presence_penalty`` / ``frequency_penalty``: in [-2, 2] (OpenAI's range).
    ``logit_bias``: (token id, bias) pairs, bias in [-100, 100], added to the logits.
    ``logprobs``: None = report none; n >= 0 = report each generated token's logprob and
    its n most likely alternatives. ``prompt_logprobs``: also report the prompt tokens'
    logprobs (completions ``echo`` with ``logprobs``). ``max_new_tokens`` may be 0 only with
    ``prompt_logprobs`` (score the prompt, generate nothing).
    ``top_k``: keep the k most likely tokens (0 = all). ``min_p``: in [0, 1], keep tokens at
    least min_p x the most likely one's probability (0 = all). ``repetition_penalty`` > 0
    (1 = none) over ``prompt_ids`` and the generated tokens. ``min_tokens``: ``eos_ids`` are
    held back until that many tokens are generated, and stop strings count only where they end
    after those tokens' text (vLLM's rule; the scheduler applies it).

    vLLM's options (its ``SamplingParams`` meaning, V1 engine): ``stop_token_ids`` end the
    sequence when generated (finish "stop"); ``ignore_eos``: the model's end-of-sequence ids do
    not; ``include_stop_str_in_output``: the stop string, or the text of the stop token (EOS or
    one of ``stop_token_ids``) that ended the sequence, is kept in the text (by default it is
    not); ``skip_special_tokens``: special tokens are left out of the text (default True).
    ``eos_ids``: the ids min_tokens holds back, the model's end-of-sequence ids and
    ``stop_token_ids`` (``BatchScheduler.submit`` fills them).
    """

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
    """One position's logprob report: the token, its logprob, and the top alternatives.

    ``token``: the token's text (``tokenizer.decode([token_id])``; a piece of a multi-byte
    character shows as U+FFFD). ``top``: (text, token id, logprob) of the most likely tokens,
    most likely first. Logprobs are natural-log probabilities (float, <= 0).
    """

    token_id: int
    token: str
    logprob: float | None  # None: a prompt's first token (nothing predicts it)
    top: tuple[tuple[str, int, float], ...] = ()


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, output_ids: list[int]) -> torch.Tensor:
    """logits [V] after logit_bias, repetition_penalty, the presence / frequency penalties and
    min_tokens (module docstring; a new float32 tensor if changed). ``output_ids``: the tokens
    generated so far. Raises NonFiniteLogits for NaN or +inf logits."""
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
    """The next token from one row of logits [V] (any float dtype).

    Greedy (argmax) when ``params.greedy``; else ``sampling_probs`` (temperature, top_k,
    top_p, min_p), drawn with ``generator`` (torch.multinomial).
    """
    logits = adjusted_logits(logits, params, output_ids)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = sampling_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int,
                   token_text: Callable[[int], str]) -> list[TokenLogprob]:
    """Logprob reports of ``token_ids`` [T] under logits [T, V] (row t predicts token t).

    ``token_text`` maps an id to its text. log_softmax in float32 of the raw logits. Raises
    NonFiniteLogits for NaN or +inf logits (a report would carry NaN).
    """
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
