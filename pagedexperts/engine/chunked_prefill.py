"""Chunked prefill: prompt chunks and running decodes packed into ONE forward, no padding.

Owns: the plan of a packed step (which prefilling requests contribute how many prompt tokens
under the ``--max-prefill-tokens`` budget), the packed inputs of the step (``PackedBatch``:
token ids [1, T], positions [1, T], the 4D attention mask [1, 1, T, S + T] under which each
token sees its own request's S_i cached tokens and its own request's earlier tokens of the
step and nothing else, the batch cache of every request's cached keys / values concatenated
along the sequence, the logits rows to keep), and writing each request's new keys / values
back into its own buffers. A step of T tokens computes exactly T rows: no padding row, so the
experts see only real tokens (the union of the step is the union of its requests).

Legend: T tokens in the step (decodes + prompt chunks), S cached tokens of all its requests
together (S_i of request i), V vocabulary, D head dim.

Does not: sample, emit events, admit requests or isolate their faults (``scheduler``,
``isolation``). The mask is the one the model's attention implementation takes: boolean for
``sdpa`` (True = attend), additive float for ``eager``; other implementations are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK_FORMS = ("sdpa", "eager")  # attention implementations a custom 4D mask is built for


@dataclass(frozen=True)
class Segment:
    """One request's tokens in a packed step.

    ``request``: the scheduler's Request (its ``keys`` / ``values`` buffers [kv_heads,
    capacity, D] per layer hold ``length`` cached tokens). ``token_ids``: the new tokens, at
    positions ``length`` .. ``length + n - 1``. ``keep``: the logits rows wanted, "last" (the
    next token is sampled from it), "all" (prompt logprobs as well) or "none" (a prompt chunk
    that is not the last).
    """

    request: object
    token_ids: tuple[int, ...]
    keep: str = "last"

    @property
    def start(self) -> int:
        return self.request.length


@dataclass
class PackedBatch:
    """The model inputs of one packed step and where each segment's rows are.

    ``offsets[i]``: the first of segment i's T_i columns in ``input_ids``; ``keep``: int64 [R]
    the columns whose logits are kept (``logits_to_keep``); ``rows[i]``: segment i's rows of
    the kept logits [R, V] (a slice).
    """

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
    """Prompt tokens each prefilling request gets this step, in order: first come first
    served until ``budget`` tokens are spent (a request may get a part; 0 = waits)."""
    out = []
    for n in remaining:
        take = max(0, min(n, budget))
        out.append(take)
        budget -= take
    return out


def step_segments(running: list, budget: int) -> tuple[list[Segment], int]:
    """(segments, D) of one step over the running requests: the D decodes first (requests
    with generated tokens), then the prompt chunks ``plan_chunks`` gives the prefilling ones
    (keeping all rows of a prompt to score, the last row of a prompt's last chunk)."""
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
    """The 4D mask [1, 1, T, S + T] of segments with ``cached[i]`` cached and ``new[i]`` new
    tokens: keys are all cached tokens (segment order), then all new tokens (segment order).

    Row t of segment i attends segment i's cached keys and its new keys up to t (causal).
    ``form`` "sdpa": bool, True = attend; "eager": ``dtype`` additive, 0 or dtype's minimum.
    Raises ValueError for another ``form``.
    """
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
    """Copy each segment's new keys / values from the batch cache into its request's buffers
    (allocated at the first chunk: [kv_heads, P + max_new_tokens, D] per layer), and advance
    each request's ``length`` by its T_i tokens."""
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
