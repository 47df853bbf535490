"""``engine.sampling`` as a transformers logits processor, so that ``generate`` samples by serve's rule.

Owns: ``SamplingProcessor``, which maps each row of logits to the scores transformers'
``generate`` (and the static decode loop, ``generation.static_decode``) choose from:
``sampling.adjusted_logits`` (logit_bias, repetition_penalty over the prompt and the tokens
generated so far, presence / frequency penalties, min_tokens), then, when sampling, the log of
``sampling.sampling_probs`` (temperature, top_k, top_p, min_p; -inf where a token is ruled out).
The softmax of those scores is the distribution ``sampling.sample`` draws from for the same
``SamplingParams``; greedy takes the argmax of the adjusted logits, as ``sample`` does. So
``generate --top-k 40 --min-p 0.05 --repetition-penalty 1.1`` means what the same fields mean
to ``serve``. Does not: draw the token (transformers' ``torch.multinomial`` or argmax), validate
the options (the command), or stop at a stop string (``generation.stop_text``).

Legend: B rows (prompts), t tokens so far (prompt + generated), V vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import LogitsProcessor

from pagedexperts.engine.sampling import SamplingParams, adjusted_logits, sampling_probs


class SamplingProcessor(LogitsProcessor):
    """``params`` applied to every row; the first call's length is the prompt's (transformers
    and the static loop call it first with the prompt alone), so a row's tokens after it are
    its output ids and the tokens before it what ``repetition_penalty`` counts besides them.
    Rows are of one prompt each (no padding: a pad token would count as seen)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._prompt_len: int | None = None
        self._row_params: list[SamplingParams] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``input_ids`` [B, t] int64, ``scores`` [B, V] float -> float32 [B, V]: adjusted logits
        (greedy) or log-probabilities (sampling). Raises ``sampling.NonFiniteLogits`` for NaN or
        +inf logits."""
        if self._prompt_len is None:
            self._prompt_len = input_ids.shape[1]
            self._row_params = [dataclasses.replace(self.params, prompt_ids=tuple(row[: self._prompt_len]))
                                if self.params.repetition_penalty != 1.0 else self.params for row in input_ids.tolist()]
        out = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
        # the generated ids only where a penalty or min_tokens reads them (a copy per step otherwise)
        generated = input_ids[:, self._prompt_len:].tolist() if self.params.adjusts_logits else [[]] * len(scores)
        for b, params in enumerate(self._row_params):
            adjusted = adjusted_logits(scores[b], params, generated[b])
            out[b] = adjusted if params.greedy else torch.log(sampling_probs(adjusted, params))
        return out
