"""Speculative decoding's options and counters.

Owns: ``SpeculativeConfig`` and its flag checks (``speculative_config``: ``--speculative``,
``--num-speculative-tokens``, ``--draft-model-path``), the limits (``MAX_NUM_SPECULATIVE_TOKENS``,
the n-gram lengths) and ``SpeculativeStats`` (proposed / accepted tokens per verification step).

Does not: propose (``engine.speculative.proposers``, ``engine.speculative.draft``), decide
acceptance (``engine.speculative.acceptance``), or run a model (``engine.speculative.decoder``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
