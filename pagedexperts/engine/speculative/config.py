"""Speculative decoding's options (``SpeculativeConfig``, ``speculative_config``), limits and counters."""

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
    """What proposes and how many: ``method`` "ngram" or "draft" (``draft_model_path``),
    ``num_speculative_tokens`` n per request per step, ``ngram_max`` / ``ngram_min``."""

    method: str
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    draft_model_path: str | None = None
    ngram_max: int = NGRAM_MAX
    ngram_min: int = NGRAM_MIN


def speculative_config(method: str | None, *, num_speculative_tokens: int | None = None,
                       draft_model_path: str | None = None) -> SpeculativeConfig | None:
    """The config from the flags (None without ``--speculative``), before any model loads; ValueError
    names the flag."""
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
    """Counters: ``proposed``, ``accepted``, ``emitted`` (accepted + 1 per verification step),
    ``padded`` positions."""

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
