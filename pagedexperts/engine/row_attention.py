"""Attention over KV rows: under a plan (``RowAttention.running``) each attention layer's new keys /
values are written into ``kv_rows.KVRows`` (column = position) and the model's OWN attention (sdpa
or eager) runs over views of the rows with a mask built here: ``BatchPlan`` (a fixed-shape decode
step, no host read) or ``PackedPlan`` (prefill and chunked prefill, eager). Padding reads ``pad_id``
at position 0 and attends only its scratch column. docs/server.md "Serving on the fast path".

Legend: B rows of a step, W query positions per row, T tokens of a packed step, L columns, H heads.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch

from pagedexperts.engine.kv_rows import KVRows
from pagedexperts.loading.runtime import runtime_of

ROWS_IMPLEMENTATION = "pagedexperts_rows"
ROWS_ATTR = "_pagedexperts_rows"  # on the model and on each attention module: its RowAttention
MASK_FORMS = ("sdpa", "eager")  # the model's own implementations attention over rows calls


def as_form(allowed: torch.Tensor, form: str, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as ``form``: bool (sdpa) or additive ``dtype`` (eager)."""
    if form == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def grid_mask(visible: torch.Tensor, pad_col: torch.Tensor, width: int, *, form: str, dtype) -> torch.Tensor:
    """[B, 1, W, L]: query (i, j) sees columns < visible[i, j] and pad_col[i, j] (-1: none); [B, W]
    int64."""
    cols = torch.arange(width, device=visible.device)
    allowed = (cols < visible[..., None]) | (cols == pad_col[..., None])
    return as_form(allowed[:, None], form, dtype)


def chunk_mask(start: int, count: int, *, form: str, dtype, device) -> torch.Tensor:
    """[1, 1, n, start + n] causal mask of a chunk of n = ``count`` tokens starting at position
    ``start``."""
    allowed = torch.ones((count, start + count), dtype=torch.bool, device=device).tril(diagonal=start)
    return as_form(allowed[None, None], form, dtype)


@dataclass
class BatchPlan:
    """A batch-layout step: ``write_cols`` [B, W] int64, ``mask`` [B, 1, W, L], ``row_ids`` [B, 1]."""

    kv: KVRows
    write_cols: torch.Tensor
    row_ids: torch.Tensor
    mask: torch.Tensor

    def attend(self, module, query, key, value, original, kwargs):
        keys, values = self.kv.layer(module.layer_idx, key, value)
        keys[self.row_ids, :, self.write_cols] = key.transpose(1, 2)  # [B, W, H_kv, D]
        values[self.row_ids, :, self.write_cols] = value.transpose(1, 2)
        b = query.shape[0]
        return original(module, query, keys[:b], values[:b], self.mask, **kwargs)


@dataclass
class DecodeGroup:
    """A packed step's decodes over rows [0, B): ``slots`` [n] int64 grid cells, ``mask`` [B, 1, W, L]."""

    batch: int
    width: int
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass
class ChunkPart:
    """A prompt chunk: step tokens offset.. at positions start.. of KV row ``row``; ``mask`` [1, 1,
    count, start + count]."""

    offset: int
    count: int
    row: int
    start: int
    mask: torch.Tensor


@dataclass
class PackedPlan:
    """A packed step: ``rows`` / ``cols`` [T] int64 (each token's key), ``group`` (or None),
    ``chunks``."""

    kv: KVRows
    rows: torch.Tensor
    cols: torch.Tensor
    group: DecodeGroup | None = None
    chunks: list[ChunkPart] = field(default_factory=list)

    def attend(self, module, query, key, value, original, kwargs):
        keys, values = self.kv.layer(module.layer_idx, key, value)
        keys[self.rows, :, self.cols] = key[0].transpose(0, 1)  # [T, H_kv, D]
        values[self.rows, :, self.cols] = value[0].transpose(0, 1)
        heads, dim = query.shape[1], query.shape[3]
        out = query.new_empty((1, query.shape[2], heads, values.shape[-1]))
        g = self.group
        if g is not None:
            n = g.slots.numel()
            grid = query.new_zeros((g.batch * g.width, heads, dim)).index_copy_(0, g.slots, query[0, :, :n].transpose(0, 1))
            q = grid.view(g.batch, g.width, heads, dim).transpose(1, 2)
            o, _ = original(module, q, keys[: g.batch], values[: g.batch], g.mask, **kwargs)  # [B, W, H, D]
            out[0, :n] = o.reshape(g.batch * g.width, heads, -1).index_select(0, g.slots)
        for c in self.chunks:
            end = c.start + c.count
            o, _ = original(module, query[:, :, c.offset: c.offset + c.count], keys[c.row: c.row + 1, :, :end],
                            values[c.row: c.row + 1, :, :end], c.mask, **kwargs)
            out[0, c.offset: c.offset + c.count] = o[0]
        return out, None


def row_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """query [B, H, q, D], key / value [B, H_kv, q, D] -> ([B, q, H, D], None); RuntimeError if no plan
    runs."""
    rows: RowAttention | None = getattr(module, ROWS_ATTR, None)
    if rows is None or rows.plan is None:
        raise RuntimeError(f"{ROWS_IMPLEMENTATION} attention runs only inside the server's steps (RowAttention.running)")
    return rows.plan.attend(module, query, key, value, rows.original(module), kwargs)


class RowAttention:
    """The switch of one model to attention over KV rows; ``of(model)``."""

    def __init__(self, model) -> None:
        self.model = model
        self.form = model.config._attn_implementation  # the model's own: "sdpa" or "eager"
        self.plan: BatchPlan | PackedPlan | None = None
        self.padding: torch.Tensor | None = None  # 0-dim padding rows of the running plan

    @classmethod
    def of(cls, model) -> RowAttention:
        """The model's ``RowAttention``, made and attached on first use. ValueError: ``rows_problem``."""
        found = getattr(model, ROWS_ATTR, None)
        if found is not None:
            return found
        problem = rows_problem(model)
        if problem is not None:
            raise ValueError(problem)
        from transformers import AttentionInterface

        AttentionInterface.register(ROWS_IMPLEMENTATION, row_attention_forward)
        rows = cls(model)
        for module in _attention_modules(model):
            setattr(module, ROWS_ATTR, rows)
        model.register_forward_pre_hook(rows._give_padding, with_kwargs=True)
        setattr(model, ROWS_ATTR, rows)
        return rows

    def original(self, module):
        """The model's own attention function for ``module`` (sdpa, or its modeling file's eager)."""
        if self.form == "sdpa":
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            return ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sys.modules[type(module).__module__].eager_attention_forward

    @contextlib.contextmanager
    def running(self, plan, *, padding: torch.Tensor | None = None):
        """Run the body's forwards under ``plan``; ``padding``: 0-dim padding rows for the paged
        runners."""
        config = self.model.config
        before = config._attn_implementation
        self.plan, self.padding = plan, padding
        config._attn_implementation = ROWS_IMPLEMENTATION
        try:
            yield
        finally:
            config._attn_implementation = before
            self.plan, self.padding = None, None

    def _give_padding(self, module, args, kwargs) -> None:
        """Pre-hook after ``integration.install_padding_hook``'s: the runners count the plan's padding
        rows."""
        runtime = runtime_of(self.model)
        if self.plan is None or runtime is None:
            return
        for runner in runtime.runners.values():
            runner.padding_count = self.padding


def _attention_modules(model) -> list:
    """The modules that call the attention implementation: those with a ``layer_idx`` and q/k/v projections."""
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
            and any(hasattr(m, name) for name in ("q_proj", "qkv_proj", "q_a_proj", "c_attn"))]


def rows_problem(model) -> str | None:
    """Why the model cannot attend over KV rows (not sdpa / eager, a sliding window, no attention
    module), or None."""
    cfg = model.config
    if cfg._attn_implementation not in MASK_FORMS:
        return f"attention implementation {cfg._attn_implementation!r} (KV rows call {list(MASK_FORMS)})"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return "a sliding-window model (KV rows attend the full causal past)"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return f"layer types {sorted(set(cfg.layer_types))} (KV rows attend the full causal past)"
    if not _attention_modules(model):
        return f"no attention module with a layer_idx found in {type(model).__name__}"
    if cfg._attn_implementation == "eager":
        missing = [type(m).__name__ for m in _attention_modules(model)
                   if not hasattr(sys.modules[type(m).__module__], "eager_attention_forward")]
        if missing:
            return f"{missing[0]}'s modeling file has no eager_attention_forward"
    return None
