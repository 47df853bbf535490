"""Fault isolation: ``check_inputs`` (ids in the vocabulary, prompt + max_new_tokens in the context;
guards the scheduler behind ``serving.validation``) and ``each_isolated`` (a per-request piece of a
step run for each request on its own). An error in the forward itself fails every request of that
forward.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, TypeVar

logger = logging.getLogger(__name__)

R = TypeVar("R")


class RequestFault(ValueError):
    """A request that cannot join a forward (its message names the value and the limit)."""


def check_inputs(prompt_ids: list[int], sampling, *, vocab_size: int, context_length: int) -> None:
    """RequestFault unless every prompt and logit_bias id is in [0, vocab_size) and P + max_new_tokens
    <= context_length."""
    if not prompt_ids:
        raise RequestFault("the prompt is empty")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestFault(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t, _ in sampling.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestFault(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")
    total = len(prompt_ids) + sampling.max_new_tokens
    if total > context_length:
        raise RequestFault(f"prompt {len(prompt_ids)} + max_new_tokens {sampling.max_new_tokens} tokens exceed "
                           f"the context length {context_length} (--context-length)")


def each_isolated(reqs: Iterable[R], fn: Callable[[R], None], fail: Callable[[R, Exception], None],
                  *, what: str) -> list[R]:
    """``fn(req)`` for each request; one that raises goes to ``fail(req, exc)`` (logged with ``what``)
    and the others go on. Returns those whose ``fn`` returned."""
    ok = []
    for req in reqs:
        try:
            fn(req)
        except Exception as exc:  # one request's fault must not reach its batch-mates
            logger.exception("%s failed for request %s; it alone is failed", what, getattr(req, "request_id", "?"))
            fail(req, exc)
            continue
        ok.append(req)
    return ok
