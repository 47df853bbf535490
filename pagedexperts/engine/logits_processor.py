"""``engine.sampling`` as a transformers logits processor (``SamplingProcessor``), so ``generate``
samples by serve's rule.

Legend: B rows (prompts), t tokens so far, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import LogitsProcessor

from pagedexperts.engine.sampling import SamplingParams, adjusted_logits, sampling_probs


class SamplingProcessor(LogitsProcessor):
    """``params`` applied to every row; the first call's length is the prompt's, so later tokens are
    the output ids. One prompt per row (no padding: a pad token would count as seen)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._prompt_len: int | None = None
        self._row_params: list[SamplingParams] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``input_ids`` [B, t] int64, ``scores`` [B, V] -> float32 [B, V];
        ``sampling.NonFiniteLogits`` for NaN or +inf."""
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
