"""Per-request sampling for the server: logit processing, the next token, logprobs, stop strings.

Owns: ``SamplingParams`` (the generation options of ONE sequence: temperature, top_p, seed,
stop strings, OpenAI's presence / frequency penalties and logit_bias, how many logprobs to
report), the rule for tiny temperatures, ``sample`` (one token from one row of logits) and
``token_logprob`` (the chosen token's logprob and the top alternatives). The text a client may
see after each token is ``generation.stop_text``'s (one rule for generate and the server).
Tensor-light, model-free, thread-free: the scheduler calls it.

Conventions (as OpenAI and vLLM's defaults):

- logit processing order: logit_bias is added, then the penalties are subtracted, then
  temperature and top_p shape the distribution. Penalties count the tokens GENERATED so far
  (not the prompt): ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``
  (OpenAI's "Frequency and presence penalties" formula).
- temperature below ``GREEDY_BELOW`` (1e-5, vLLM's ``_SAMPLING_EPS``) samples greedily:
  dividing by it would overflow float32 (1e-40 gave inf / nan probabilities), and the
  distribution is already a point mass at the argmax to float32 precision.
- logprobs are the model's own: ``log_softmax`` of the raw logits in float32, before
  logit_bias, penalties, temperature and top_p (vLLM's default ``raw_logprobs``).

Does not: run the model, batch, or speak HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pagedexperts.generation.config import SamplingConfig

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (see the module docstring)


def warped_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / temperature) over the smallest top_p nucleus, float32 [V] (logits [V],
    any float dtype; temperature > 0). ``sample`` draws from exactly this, and
    speculative decoding's acceptance rule compares against it."""
    scaled = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = torch.cumsum(probs, dim=-1) - probs > top_p  # always keeps the first
        scaled = scaled.clone()
        scaled[order[drop]] = float("-inf")
    return torch.softmax(scaled, dim=-1)


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
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: bool = False

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
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


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
    """logits [V] after logit_bias and the presence / frequency penalties (a new tensor if changed)."""
    if not params.adjusts_logits:
        return logits
    out = logits.float().clone()
    for token_id, bias in params.logit_bias:
        out[token_id] += bias
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids), minlength=out.shape[0])[: out.shape[0]].float()
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return out


def sample(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
           generator: torch.Generator | None) -> int:
    """The next token from one row of logits [V] (any float dtype).

    Greedy (argmax) when ``params.greedy``; else softmax(logits / temperature) restricted to
    the smallest top_p nucleus, drawn with ``generator`` (torch.multinomial).
    """
    logits = adjusted_logits(logits, params, output_ids)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = warped_probs(logits, params.temperature, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int,
                   token_text: Callable[[int], str]) -> list[TokenLogprob]:
    """Logprob reports of ``token_ids`` [T] under logits [T, V] (row t predicts token t).

    ``token_text`` maps an id to its text. log_softmax in float32 of the raw logits.
    """
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
