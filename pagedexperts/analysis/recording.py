"""Routing-trace recording on a paged model, as it runs.

Owns ``TraceRecorder`` (a forward pre-hook opening each step in the ``TraceWriter``, padding
rows as -1, and each runner's trace hook) and ``record_predictions`` (prefetch predictions as
the trace extra PREFETCH_EXTRA). Does not: define the trace format or count anything.
"""

from __future__ import annotations

import torch

from pagedexperts.analysis.trace import PREFETCH_EXTRA, TraceWriter
from pagedexperts.integration import batch_seq
from pagedexperts.paging.runner_contract import PagedExecutor


def step_rows(kwargs: dict, args: tuple) -> tuple[int, int, torch.Tensor | None]:
    """(B, T, row_is_real [B*T] bool or None) of a model call's input_ids / attention_mask."""
    batch, seq = batch_seq(kwargs, args)
    mask = kwargs.get("attention_mask")
    real = None
    if mask is not None and mask.dim() == 2:
        real = mask[:, -seq:].reshape(-1).to("cpu").bool()
    return batch, seq, real


def is_prefill(kwargs: dict) -> bool:
    """True when the call starts from an empty KV cache (``cache`` in transformers 5.24,
    ``past_key_values`` in older 5.x)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache is None or cache.get_seq_length() == 0


class TraceRecorder:
    """Records a paged model's routing into a ``trace.TraceWriter``. ``request_ids``: one per batch
    row of the next calls (default 0..B-1) or one per token; ``phase``: the next calls' phase when
    the caller knows it, else "prefill" from an empty cache, "decode" otherwise."""

    def __init__(self, model, writer) -> None:
        self.model = model
        self.writer = writer
        self.request_ids: list[int] | None = None
        self.phase: str | None = None

    @classmethod
    def attach(cls, model, *, model_id: str = "") -> "TraceRecorder":
        rt = model.pagedexperts
        writer = TraceWriter(
            num_experts=rt.num_experts, top_k=rt.top_k, layers=sorted(rt.runners), model_id=model_id
        )
        rec = cls(model, writer)
        model.register_forward_pre_hook(rec._begin_step, with_kwargs=True)
        for runner in rt.runners.values():
            runner.trace_hook = rec._add
        return rec

    def _begin_step(self, module, args, kwargs) -> None:
        batch, seq, real = step_rows(kwargs, args)
        ids = self.request_ids or list(range(batch))
        rows = torch.tensor(ids, dtype=torch.long)
        if rows.numel() != batch * seq:  # one id per batch row (a packed step gives one per token)
            rows = rows.repeat_interleave(seq)
        if real is not None:
            rows[~real] = -1
        phase = self.phase or ("prefill" if is_prefill(kwargs) else "decode")
        self.writer.begin_step(phase=phase, request_ids=rows.tolist())

    def _add(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self.writer.add(layer=layer, topk_ids=topk_ids.numpy(), topk_weights=topk_weights.float().numpy())

    def save(self, path) -> None:
        self.writer.save(path)


def record_predictions(model, recorder: TraceRecorder) -> None:
    """Write each prefetch prediction into ``recorder.writer`` as the PREFETCH_EXTRA of its layer."""
    for runner in model.pagedexperts.runners.values():
        if isinstance(runner, PagedExecutor) and runner.prefetcher is not None:
            runner.prefetcher.on_predict = lambda layer, experts, rec=recorder: rec.writer.add_extra(
                layer=layer, name=PREFETCH_EXTRA, values=experts)
