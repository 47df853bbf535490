"""Chunked prefill: prompt chunks and running decodes packed into ONE forward without padding
(docs/server.md): the step's plan under ``--max-prefill-tokens``, its inputs (``PackedBatch``; a 4D
mask lets each token see only its own request) and writing new keys / values back. The mask is bool
for sdpa, additive for eager.

Legend: T tokens in the step, S cached tokens (S_i of request i), V vocabulary, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK_FORMS = ("sdpa", "eager")  # attention implementations a custom 4D mask is built for


@dataclass(frozen=True)
class Segment:
    """One request's new ``token_ids`` at positions ``length``.. in a packed step; ``keep``: "last",
    "all" or "none" logits rows."""

    request: object
    token_ids: tuple[int, ...]
    keep: str = "last"

    @property
    def start(self) -> int:
        return self.request.length


@dataclass
class PackedBatch:
    """A packed step's inputs; ``offsets``, ``keep`` int64 [R] (kept logits columns), ``rows[i]``
    segment i's kept rows."""

    segments: list[Segment]
    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    attention_mask: torch.Tensor  # [1, 1, T, S + T], bool or float
    cache: object  # transformers DynamicCache holding the S cached tokens
    cached: int  # S
    offsets: list[int]
    keep: torch.Tensor
    rows: list[slice]


def plan_chunks(remaining: list[int], budget: int) -> list[int]:
    """Prompt tokens each prefilling request gets, first come first served within ``budget`` (0:
    waits)."""
    out = []
    for n in remaining:
        take = max(0, min(n, budget))
        out.append(take)
        budget -= take
    return out


def step_segments(running: list, budget: int) -> tuple[list[Segment], int]:
    """(segments, D): the D decodes first, then the prompt chunks of the prefilling requests."""
    decoding = [r for r in running if r.output_ids]
    prefilling = [r for r in running if not r.output_ids]
    takes = plan_chunks([len(r.prompt_ids) - r.length for r in prefilling], budget)
    segments = [Segment(r, (r.output_ids[-1],)) for r in decoding]
    for r, n in zip(prefilling, takes):
        if n:
            last = r.length + n == len(r.prompt_ids)
            keep = "all" if r.sampling.prompt_logprobs else ("last" if last else "none")
            segments.append(Segment(r, tuple(r.prompt_ids[r.length: r.length + n]), keep))
    return segments, len(decoding)


def packed_mask(cached: list[int], new: list[int], *, form: str, dtype: torch.dtype) -> torch.Tensor:
    """The 4D mask [1, 1, T, S + T] (keys: all cached, then all new): row t of segment i sees its own
    cached keys and its new keys up to t. ``form`` "sdpa" or "eager"; ValueError otherwise."""
    if form not in MASK_FORMS:
        raise ValueError(f"chunked prefill builds attention masks for {list(MASK_FORMS)}, not {form!r}; "
                         "load the model with one of them or serve with --no-chunked-prefill")
    s, t = sum(cached), sum(new)
    allowed = torch.zeros((t, s + t), dtype=torch.bool)
    s_off = t_off = 0
    for c, n in zip(cached, new):
        allowed[t_off:t_off + n, s_off:s_off + c] = True
        allowed[t_off:t_off + n, s + t_off:s + t_off + n] = torch.ones((n, n), dtype=torch.bool).tril()
        s_off, t_off = s_off + c, t_off + n
    if form == "sdpa":
        return allowed[None, None]
    return torch.zeros((t, s + t), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def pack(segments: list[Segment], *, form: str, dtype: torch.dtype, device) -> PackedBatch:
    """The ``PackedBatch`` of ``segments`` (each request at most once), inputs on ``device``."""
    from transformers import DynamicCache

    new = [len(s.token_ids) for s in segments]
    cached = [s.start for s in segments]
    offsets = [sum(new[:i]) for i in range(len(segments))]
    ids = torch.tensor([[t for s in segments for t in s.token_ids]], dtype=torch.long)
    positions = torch.tensor([[p for s in segments for p in range(s.start, s.start + len(s.token_ids))]])
    keep, rows = [], []
    for seg, off, n in zip(segments, offsets, new):
        cols = {"all": range(off, off + n), "last": range(off + n - 1, off + n), "none": range(0)}[seg.keep]
        rows.append(slice(len(keep), len(keep) + len(cols)))
        keep += cols
    cache = DynamicCache()
    with_kv = [s.request for s in segments if s.start > 0]
    for layer in range(len(with_kv[0].keys) if with_kv else 0):
        k = torch.cat([r.keys[layer][:, : r.length] for r in with_kv], dim=1)[None]
        v = torch.cat([r.values[layer][:, : r.length] for r in with_kv], dim=1)[None]
        cache.update(k, v, layer)
    mask = packed_mask(cached, new, form=form, dtype=dtype)
    return PackedBatch(segments, ids.to(device), positions.to(device), mask.to(device), cache, sum(cached), offsets,
                       torch.tensor(keep or [sum(new) - 1], dtype=torch.long, device=device), rows)


def keep_new_kv(batch: PackedBatch) -> None:
    """Copy each segment's new keys / values into its request's buffers and advance ``length`` by T_i."""
    for seg, off in zip(batch.segments, batch.offsets):
        req, n = seg.request, len(seg.token_ids)
        cols = slice(batch.cached + off, batch.cached + off + n)
        for layer, cl in enumerate(batch.cache.layers):
            for src, dst in ((cl.keys, req.keys), (cl.values, req.values)):
                kv = src[0, :, cols]  # [kv_heads, T_i, D]
                if len(dst) <= layer:
                    capacity = len(req.prompt_ids) + req.sampling.max_new_tokens
                    dst.append(kv.new_zeros((kv.shape[0], capacity, kv.shape[2])))
                dst[layer][:, req.length: req.length + n] = kv
        req.length += n
