"""Per-step hooks on a paged model: padding rows for the stats, and routing-trace recording.

Owns: a forward pre-hook that tells every pager, before each model step, how many of the
step's rows are padding (from the attention mask) and, when a trace is being recorded, opens
the step in the ``TraceWriter`` (phase and per-row request ids). Does not: define the trace
format (``trace``) or count anything itself (``stats``).
"""

from __future__ import annotations

import torch


def _batch_seq(kwargs: dict, args: tuple) -> tuple[int, int]:
    """(B, T) of a model call, from its input_ids (keyword or first positional) or inputs_embeds."""
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    if ids is None:
        ids = kwargs["inputs_embeds"]
    return ids.shape[0], ids.shape[1]


def step_rows(kwargs: dict, args: tuple) -> tuple[int, int, torch.Tensor | None]:
    """(B, T, row_is_real [B*T] bool or None) of a model call's input_ids / attention_mask."""
    batch, seq = _batch_seq(kwargs, args)
    mask = kwargs.get("attention_mask")
    real = None
    if mask is not None and mask.dim() == 2:
        real = mask[:, -seq:].reshape(-1).to("cpu").bool()
    return batch, seq, real


def is_prefill(kwargs: dict) -> bool:
    """True when the call starts from an empty KV cache. transformers 5.24's ``generate``
    passes the cache as ``cache``; older 5.x releases as ``past_key_values``."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache is None or cache.get_seq_length() == 0


def padding_count(kwargs: dict, args: tuple) -> torch.Tensor | None:
    """Padding rows of a model call as a 0-dim int64 tensor on the mask's device (no sync), or
    None without a 2-D attention mask."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return None
    seq = _batch_seq(kwargs, args)[1]
    return (mask[:, -seq:] == 0).sum()


def install_padding_hook(model) -> None:
    """Before each forward, give every runner the step's padding count (``padding_count``, read
    back with its top-k ids). The runners are looked up per call, so the hook follows
    ``loader.repage`` and holds no reference to dropped pagers or their slots."""
    runtime = model.pagedexperts

    def hook(module, args, kwargs):
        count = padding_count(kwargs, args)
        for p in runtime.pagers.values():
            p.padding_count = count

    model.register_forward_pre_hook(hook, with_kwargs=True)


class TraceRecorder:
    """Records a paged model's routing into a ``trace.TraceWriter`` as it runs.

    ``request_ids``: one id per batch row of the next calls (default 0..B-1), or one per token
    (B x T ids: a packed step); padding rows are recorded with request id -1.
    """

    def __init__(self, model, writer) -> None:
        self.model = model
        self.writer = writer
        self.request_ids: list[int] | None = None

    @classmethod
    def attach(cls, model, *, model_id: str = "") -> "TraceRecorder":
        from pagedexperts.trace import TraceWriter

        rt = model.pagedexperts
        writer = TraceWriter(
            num_experts=rt.num_experts, top_k=rt.top_k, layers=sorted(rt.pagers), model_id=model_id
        )
        rec = cls(model, writer)
        model.register_forward_pre_hook(rec._begin_step, with_kwargs=True)
        for pager in rt.pagers.values():
            pager.trace_hook = rec._add
        return rec

    def _begin_step(self, module, args, kwargs) -> None:
        batch, seq, real = step_rows(kwargs, args)
        ids = self.request_ids or list(range(batch))
        rows = torch.tensor(ids, dtype=torch.long)
        if rows.numel() != batch * seq:  # one id per batch row (a packed step gives one per token)
            rows = rows.repeat_interleave(seq)
        if real is not None:
            rows[~real] = -1
        self.writer.begin_step(phase="prefill" if is_prefill(kwargs) else "decode", request_ids=rows.tolist())

    def _add(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self.writer.add(layer=layer, topk_ids=topk_ids.numpy(), topk_weights=topk_weights.float().numpy())

    def save(self, path) -> None:
        self.writer.save(path)
