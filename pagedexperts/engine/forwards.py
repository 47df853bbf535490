"""The scheduler's forwards: the ``StepForwards`` contract, ``DecodeCounts``, and ``DynamicForwards``,
the fallback layout (a batch cache rebuilt every forward) for a model that cannot attend over KV
rows. Methods return logits on the CPU and advance each request's ``length``.

Legend: B requests, W tokens per request, P prompt tokens, V vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field

import torch

from pagedexperts.engine.batching import forward_rows, prefill_inputs
from pagedexperts.engine.chunked_prefill import Segment, keep_new_kv, pack
from pagedexperts.engine.sequence import keep_kv

HOWS = ("replay", "capture", "static_eager", "packed", "dynamic")


@dataclass
class DecodeCounts:
    """Decode forwards by how they ran (``pagedexperts_decode_steps_total{how}``, docs/server.md);
    ``recaptures``: reason -> rebuilt steps."""

    replay: int = 0
    capture: int = 0
    static_eager: int = 0
    packed: int = 0
    dynamic: int = 0
    recaptures: dict[str, int] = field(default_factory=dict)

    def recaptured(self, reason: str, n: int = 1) -> None:
        if n:
            self.recaptures[reason] = self.recaptures.get(reason, 0) + n

    def as_dict(self) -> dict:
        return asdict(self)


class StepForwards(ABC):
    """The scheduler's forwards over one KV layout."""

    name = ""
    mixes_decodes = True  # a step's decodes share its prompt chunks' packed forward (else: split)

    def __init__(self) -> None:
        self.counts = DecodeCounts()

    @abstractmethod
    def place(self, req) -> None:
        """Make room for ``req``'s KV at admission (raises: the request fails alone)."""

    @abstractmethod
    def release(self, req) -> None:
        """Free ``req``'s KV (it finished, failed or was cancelled)."""

    @abstractmethod
    def prefill(self, reqs: list) -> dict[int, torch.Tensor]:
        """One forward of ``reqs``' whole prompts -> request id -> logits [P, V] (prompt logprobs) or
        [1, V]."""

    @abstractmethod
    def packed(self, segments: list[Segment], decodes: int) -> dict[int, torch.Tensor]:
        """One forward of ``segments`` (``decodes`` first) -> request id -> its kept logits [r, V]."""

    @abstractmethod
    def decodes(self, reqs: list, tokens: list[list[int]]) -> torch.Tensor:
        """One forward of ``tokens[i]`` after request i's cached ones -> logits [B, W, V]."""

    def summary(self) -> dict:
        """What /server_info shows: the layout, and the decode counts."""
        return dict(kv_layout=self.name, decode_steps=self.counts.as_dict())


class DynamicForwards(StepForwards):
    """Per-request KV buffers, a batch cache rebuilt every forward; ``reason``: why it runs."""

    name = "dynamic"

    def __init__(self, model, *, pad_id: int, mask_form: str, recorder=None, reason: str | None = None) -> None:
        super().__init__()
        self.model, self.pad_id, self.mask_form, self.recorder, self.reason = model, pad_id, mask_form, recorder, reason
        import inspect

        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def place(self, req) -> None:
        pass

    def release(self, req) -> None:
        req.keys, req.values = [], []

    def _forward(self, request_ids: list[int], *, logits_to_keep=1, **kwargs):
        if self.recorder is not None:
            self.recorder.request_ids, self.recorder.phase = request_ids, None
        cache = kwargs.pop("cache")
        return self.model(**kwargs, **{self._cache_kwarg: cache}, use_cache=True, logits_to_keep=logits_to_keep)

    def prefill(self, reqs: list) -> dict[int, torch.Tensor]:
        from transformers import DynamicCache

        device = self.model.device
        ids, mask, positions = prefill_inputs([r.prompt_ids for r in reqs], self.pad_id)
        scores = any(r.sampling.prompt_logprobs for r in reqs)
        cache = DynamicCache()
        out = self._forward([r.request_id for r in reqs], input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=positions.to(device), cache=cache, logits_to_keep=0 if scores else 1)
        p_max = ids.shape[1]
        logits = out.logits.to("cpu")  # [B, P_max or 1, V]
        rows = {}
        for i, req in enumerate(reqs):
            n = len(req.prompt_ids)
            keep_kv(req, cache, i, p_max - n)
            rows[req.request_id] = logits[i, p_max - n:] if req.sampling.prompt_logprobs else logits[i, -1:]
        return rows

    def packed(self, segments: list[Segment], decodes: int) -> dict[int, torch.Tensor]:
        batch = pack(segments, form=self.mask_form, dtype=self.model.dtype, device=self.model.device)
        owners = [s.request.request_id for s in segments for _ in s.token_ids]
        out = self._forward(owners, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids, cache=batch.cache, logits_to_keep=batch.keep)
        keep_new_kv(batch)
        self.counts.dynamic += decodes > 0
        logits = out.logits[0].to("cpu")  # [R, V]
        return {s.request.request_id: logits[r] for s, r in zip(segments, batch.rows)}

    def decodes(self, reqs: list, tokens: list[list[int]]) -> torch.Tensor:
        ids = [r.request_id for r in reqs]
        logits = forward_rows(lambda **kw: self._forward(ids, **kw), reqs, tokens, pad_id=self.pad_id,
                              device=self.model.device)
        self.counts.dynamic += 1
        return logits

    def summary(self) -> dict:
        return dict(super().summary(), fallback_reason=self.reason, steps=dict(backend="none", reason=self.reason))
