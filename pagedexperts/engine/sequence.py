"""One sequence inside the scheduler: its state (``Request``), what it reports (``Event``),
its end-of-sequence ids, its own random generator, and copying its row of a padded prefill's cache into its buffers.

Also the per-request rules of ending: which token is a stop token (``ends_sequence``) and what
min_tokens holds back (``held_back``). Owns per-request data, not the batching of requests
(``scheduler``, ``batching``, ``chunked_prefill``). Legend: P prompt tokens, D head dim.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pagedexperts.engine.sampling import SamplingParams, TokenLogprob
from pagedexperts.generation.stop_text import IncrementalText


@dataclass(frozen=True)
class Event:
    """What a request reports after a step: new text, and on the last one its finish reason.

    ``finish_reason``: None while running, then "stop" (end of sequence or a stop string; ``stop_reason``
    then says which, as vLLM's: the stop string, a stop token's id, or None for the end-of-sequence token),
    "length" (max_tokens reached), "cancelled", "error" (``error`` holds the message) or
    "abort" (the server is shutting down; ``error`` says so). ``time_s`` is
    ``time.perf_counter()`` when the event was made. ``logprobs``: reports of the tokens
    generated since the previous event (when asked for); ``prompt_logprobs``: on the first
    event, the prompt's (the first token's logprob is None: nothing predicts it). The last event
    also carries the request's timing: ``ttft_s`` (arrival to first token), ``queue_s``
    (arrival to admission into the running set: the part of TTFT spent waiting for a place;
    None if never admitted) and ``tpot_s`` (mean seconds per token after the first; None with
    fewer than two tokens).
    """

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    time_s: float = 0.0
    ttft_s: float | None = None
    queue_s: float | None = None
    tpot_s: float | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class Request:
    """One sequence and its state inside the scheduler.

    ``prompt_ids``: token ids (checked at admission, ``isolation.check_inputs``). ``on_event``
    is called from the scheduler thread; it must not block. Cache buffers are [kv_heads,
    capacity, D] per layer, capacity = P + max_new_tokens; ``length`` tokens are filled (a
    request is prefilling while ``length`` < P and nothing is generated).
    """

    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    on_event: Callable[[Event], None]
    submitted_s: float = field(default_factory=time.perf_counter)
    admitted_s: float | None = None  # taken from the waiting queue into the running set
    first_token_s: float | None = None
    finished_s: float | None = None
    cancelled: bool = False
    output_ids: list[int] = field(default_factory=list)
    text: IncrementalText | None = None
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_prompt_logprobs: tuple | None = None
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0
    generator: torch.Generator | None = None

    def timing(self, now: float) -> tuple[float | None, float | None]:
        """(TTFT s from arrival, TPOT s: mean seconds per token after the first) at ``now``."""
        n, first = len(self.output_ids), self.first_token_s
        ttft = None if first is None else first - self.submitted_s
        return ttft, ((now - first) / (n - 1) if first is not None and n > 1 else None)

    @property
    def queue_s(self) -> float | None:
        """Seconds from arrival to admission (None while waiting or if never admitted)."""
        return None if self.admitted_s is None else self.admitted_s - self.submitted_s

    def prompt_targets(self, end: int, rows: int) -> tuple[int, list[int]]:
        """(first position, prompt tokens predicted) of a chunk of ``rows`` positions ending
        ``-end`` tokens before the prompt's end: position j predicts prompt token j + 1, and
        the last position predicts no prompt token."""
        p = len(self.prompt_ids)
        start = p + end - rows
        return start, self.prompt_ids[start + 1: min(p + end, p - 1) + 1]


def eos_ids(model, tokenizer) -> set[int]:
    """The end-of-sequence ids: the model's generation config's, else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def held_back(params: SamplingParams, eos: set[int]) -> SamplingParams:
    """``params`` with ``eos_ids``, what min_tokens holds back, set: the model's end-of-sequence
    ids ``eos`` and the request's stop_token_ids (vLLM's min_tokens masks both)."""
    if not params.min_tokens:
        return params
    return dataclasses.replace(params, eos_ids=tuple(sorted(eos | set(params.stop_token_ids))))


def ends_sequence(params: SamplingParams, token: int, generated: int, eos: set[int]) -> bool:
    """Whether ``token``, the ``generated``-th of its sequence, is a stop token that ends it (vLLM's
    ``check_stop``): once ``min_tokens`` exist, one of ``stop_token_ids``, or an end-of-sequence
    id of ``eos`` unless ``ignore_eos``."""
    return generated >= params.min_tokens and (token in params.stop_token_ids or
                                               (not params.ignore_eos and token in eos))


def stop_reason_of(params: SamplingParams, token: int, primary_eos: int | None) -> int | None:
    """vLLM's ``stop_reason`` of a sequence the stop token ``token`` ended: None for the tokenizer's
    end-of-sequence id ``primary_eos`` (unless ``ignore_eos``), else the token id: one of
    ``stop_token_ids``, or another end-of-sequence id of the generation config (which vLLM adds to
    the stop_token_ids)."""
    return None if not params.ignore_eos and token == primary_eos else token


def seeded_generator(params: SamplingParams) -> torch.Generator | None:
    """The CPU generator of a sampled sequence (None when greedy): seeded with ``params.seed``
    (mod 2**64), or non-deterministically, leaving torch's global RNG alone."""
    if params.greedy:
        return None
    gen = torch.Generator(device="cpu")
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed % 2**64)
    return gen


def keep_kv(req: Request, cache, row: int, start: int) -> None:
    """Copy row ``row`` of a padded batch cache (columns ``start``:) into the request's buffers
    [kv_heads, P + max_new_tokens, D] per layer; ``length`` becomes P."""
    capacity = len(req.prompt_ids) + req.sampling.max_new_tokens
    for layer in cache.layers:
        for src, dst in ((layer.keys, req.keys), (layer.values, req.values)):
            kv = src[row, :, start:]  # [kv_heads, P, D]
            buf = kv.new_empty((kv.shape[0], capacity, kv.shape[2]))
            buf[:, : kv.shape[1]] = kv
            dst.append(buf)
    req.length = len(req.prompt_ids)
