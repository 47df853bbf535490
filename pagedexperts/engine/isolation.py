"""Fault isolation: one bad request fails itself, never the other requests of its forward.

Owns: ``check_inputs`` (what a request must satisfy before it may join a forward: prompt token
ids and logit_bias ids inside the model's vocabulary, prompt + max_new_tokens inside the
context), and ``each_isolated`` (run a per-request piece of a step, preparing, sampling,
detokenizing, stopping or reporting, for each request on its own, so an exception in one
fails that one and the loop goes on with the next).

The HTTP layer validates the same bounds first (``serving.validation``: a 400 before any work); the
checks here guard the scheduler's own callers and any bound the validation gets wrong: an id
equal to the vocabulary size once passed validation and then, raised on the scheduler thread,
failed every request of its forward.

Does not: validate requests for clients (``serving.validation``), or retry a failed forward (an error in
the model's forward itself fails every request of that forward; nothing per-request can be
blamed for it).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, TypeVar

logger = logging.getLogger(__name__)

R = TypeVar("R")


class RequestFault(ValueError):
    """A request that cannot join a forward (its message names the value and the limit)."""


def check_inputs(prompt_ids: list[int], sampling, *, vocab_size: int, context_length: int) -> None:
    """Raises RequestFault unless every prompt id and logit_bias id is in [0, vocab_size) and
    P + max_new_tokens <= context_length (``sampling``: a SamplingParams)."""
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
    """Call ``fn(req)`` for each request; one that raises is handed to ``fail(req, exc)``
    (logged with ``what``, the step's part) and the others go on. Returns the requests whose
    ``fn`` returned."""
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
