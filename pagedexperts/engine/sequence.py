"""One sequence inside the scheduler: ``Request`` (its state), ``Event`` (what it reports), its
end-of-sequence ids, generator and stop rules (``ends_sequence``, ``held_back``). Legend: P prompt
tokens, D head dim.
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
    """A request's report after a step: text, logprobs; on the last, ``finish_reason`` ("stop",
    "length", "cancelled", "error", "abort"), ``stop_reason``, ``error`` and ``ttft_s`` /
    ``queue_s`` / ``tpot_s``."""

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
    """One sequence's state; ``on_event`` runs on the scheduler thread and must not block."""

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
        """(first position, prompt tokens predicted) of a chunk of ``rows`` positions ending ``-end``
        before the end."""
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
    """``params`` with ``eos_ids`` = ``eos`` + stop_token_ids (vLLM's min_tokens masks both)."""
    if not params.min_tokens:
        return params
    return dataclasses.replace(params, eos_ids=tuple(sorted(eos | set(params.stop_token_ids))))


def ends_sequence(params: SamplingParams, token: int, generated: int, eos: set[int]) -> bool:
    """Whether ``token``, the ``generated``-th, ends the sequence (vLLM's ``check_stop``)."""
    return generated >= params.min_tokens and (token in params.stop_token_ids or
                                               (not params.ignore_eos and token in eos))


def stop_reason_of(params: SamplingParams, token: int, primary_eos: int | None) -> int | None:
    """vLLM's ``stop_reason``: None for ``primary_eos`` (unless ``ignore_eos``), else ``token``."""
    return None if not params.ignore_eos and token == primary_eos else token


def seeded_generator(params: SamplingParams) -> torch.Generator | None:
    """A sampled sequence's CPU generator (None when greedy), seeded with ``params.seed`` mod 2**64 or
    at random."""
    if params.greedy:
        return None
    gen = torch.Generator(device="cpu")
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed % 2**64)
    return gen


def keep_kv(req: Request, cache, row: int, start: int) -> None:
    """Copy row ``row`` (columns ``start``:) of a padded batch cache into the request's buffers;
    ``length`` = P."""
    capacity = len(req.prompt_ids) + req.sampling.max_new_tokens
    for layer in cache.layers:
        for src, dst in ((layer.keys, req.keys), (layer.values, req.values)):
            kv = src[row, :, start:]  # [kv_heads, P, D]
            buf = kv.new_empty((kv.shape[0], capacity, kv.shape[2]))
            buf[:, : kv.shape[1]] = kv
            dst.append(buf)
    req.length = len(req.prompt_ids)
