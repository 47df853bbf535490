"""Decoding options: the one ``SamplingConfig`` that generation, the server and the tools share,
validated with the flag each value comes from, and ``GREEDY`` (``generate``'s greedy keywords).
Standard library only. Does not: sample or generate text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


# Greedy decoding for ``generate``: also clears the sampling knobs a checkpoint's
# generation_config may set, so transformers neither samples nor warns about them.
GREEDY = dict(do_sample=False, temperature=None, top_p=None, top_k=None)


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding options. temperature 0 = greedy; top_p in (0, 1]; stop strings end the text and
    are not part of it (OpenAI's rule, ``stop_text``)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raises ValueError naming the flag for out-of-range values."""
        if self.max_new_tokens <= 0:
            raise ValueError(f"--max-new-tokens must be > 0, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:  # nan sampled from nan probabilities: one token, exit 0
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


def check_context(prompt_tokens: int, max_new_tokens: int, max_positions: int) -> None:
    """Refuse a generation longer than the model's positions (``max_positions``; 0: no limit known),
    as the server does (transformers only warns).

    Raises:
        ValueError: prompt + --max-new-tokens over ``max_positions`` (names the numbers and the
            flag; a prompt that leaves no position says by how many tokens it is too long).
    """
    if not max_positions or prompt_tokens + max_new_tokens <= max_positions:
        return
    if prompt_tokens >= max_positions:
        over = prompt_tokens - max_positions + 1
        raise ValueError(f"the prompt is too long: {prompt_tokens} tokens, {over} more than the "
                         f"{max_positions - 1} the model's max_position_embeddings {max_positions} leaves with room for "
                         f"one new token; shorten the prompt by at least {over} tokens")
    shorten = prompt_tokens + max_new_tokens - max_positions
    raise ValueError(f"prompt {prompt_tokens} tokens + --max-new-tokens {max_new_tokens} exceeds the model's "
                     f"max_position_embeddings {max_positions}; lower --max-new-tokens (at most "
                     f"{max_positions - prompt_tokens} here)"
                     + (f", or shorten the prompt by {shorten} tokens" if shorten < prompt_tokens else ""))
