"""Padding sequences into one forward: left-padded prefill inputs and groups, and a batched decode
step's cache and 2D mask (``forward_rows``). Inputs are built on the CPU (int64) and moved to the
model's device.

Legend: B sequences, P_max the longest prompt, S cached tokens (S_max the longest), W new tokens of
the longest row, V vocabulary.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CachedRow(Protocol):
    """A sequence with per-layer KV buffers [kv_heads, capacity, D], ``length`` of them filled."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int


def decode_mask(lengths: list[int], s_max: int, widths: list[int] | None = None) -> torch.Tensor:
    """The 2D mask [B, s_max + W] int64 of a batched decode step, W = max(widths): row i is ``s_max -
    lengths[i]`` zeros, ``lengths[i]`` ones, ``widths[i]`` ones (default 1), zeros to W."""
    widths = widths or [1] * len(lengths)
    mask = torch.zeros((len(lengths), s_max + max(widths)), dtype=torch.long)
    for i, (n, w) in enumerate(zip(lengths, widths)):
        mask[i, s_max - n: s_max + w] = 1
    return mask


def prefill_inputs(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) [B, P_max] int64, left-padded with ``pad_id``;
    positions count real tokens only, as ``generate`` does."""
    p_max = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), p_max), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), p_max), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, p_max - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, p_max - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def prefill_batches(lengths: list[int], max_prefill_tokens: int) -> list[list[int]]:
    """Admitted prompts' indices grouped in order, each group's B x P_max within the budget (or one
    prompt)."""
    groups: list[list[int]] = []
    for i, n in enumerate(lengths):
        if groups:
            group = groups[-1]
            if (len(group) + 1) * max(n, max(lengths[j] for j in group)) <= max_prefill_tokens:
                group.append(i)
                continue
        groups.append([i])
    return groups


def left_pad(rows: list[torch.Tensor], s_max: int) -> torch.Tensor:
    """[kv_heads, S_i, D] each -> [B, kv_heads, s_max, D], zeros on the left."""
    first = rows[0]
    out = first.new_zeros((len(rows), first.shape[0], s_max, first.shape[2]))
    for i, row in enumerate(rows):
        out[i, :, s_max - row.shape[1]:] = row
    return out


def decode_cache(reqs: list[CachedRow]):
    """The DynamicCache ([B, kv_heads, S_max, D] per layer) of a decode step over the requests' own
    buffers, left-padded; a lone request unpadded, as ``generate``."""
    from transformers import DynamicCache

    s_max = max(r.length for r in reqs)
    cache = DynamicCache()
    for layer in range(len(reqs[0].keys)):
        if len(reqs) == 1:
            k, v = reqs[0].keys[layer][None, :, :s_max], reqs[0].values[layer][None, :, :s_max]
        else:
            k = left_pad([r.keys[layer][:, : r.length] for r in reqs], s_max)
            v = left_pad([r.values[layer][:, : r.length] for r in reqs], s_max)
        cache.update(k, v, layer)
    return cache


def keep_decoded_kv(reqs: list[CachedRow], cache, widths: list[int] | None = None) -> None:
    """Write each request's new keys / values into its buffers at ``length`` and advance ``length``."""
    widths = widths or [1] * len(reqs)
    for layer, cl in enumerate(cache.layers):
        s_max = cl.keys.shape[2] - max(widths)
        for i, (r, w) in enumerate(zip(reqs, widths)):
            r.keys[layer][:, r.length: r.length + w] = cl.keys[i, :, s_max: s_max + w]
            r.values[layer][:, r.length: r.length + w] = cl.values[i, :, s_max: s_max + w]
    for r, w in zip(reqs, widths):
        r.length += w


def forward_rows(forward, rows: list[CachedRow], tokens: list[list[int]], *, pad_id: int, device) -> torch.Tensor:
    """One forward of ``tokens[i]`` after row i's ``length`` cached tokens -> logits [B, W, V] on the
    CPU. Caches left-padded, new tokens right-padded with ``pad_id``, both hidden by the mask (a
    single row: no padding, no mask, as ``model.generate``); new keys / values kept and ``length``
    advanced. ``forward(input_ids=, position_ids=, cache=, logits_to_keep=, [attention_mask=])``
    runs the model."""
    widths = [len(t) for t in tokens]
    b, w = len(rows), max(widths)
    lengths = [r.length for r in rows]
    cache = decode_cache(rows)
    ids = torch.full((b, w), pad_id, dtype=torch.long)
    positions = torch.zeros((b, w), dtype=torch.long)
    for i, (n, t) in enumerate(zip(lengths, tokens)):
        ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        positions[i] = torch.arange(n, n + w)
    kwargs = dict(input_ids=ids.to(device), position_ids=positions.to(device), cache=cache, logits_to_keep=w)
    if b > 1:
        kwargs["attention_mask"] = decode_mask(lengths, max(lengths), widths).to(device)
    out = forward(**kwargs)
    keep_decoded_kv(rows, cache, widths)
    return out.logits.to("cpu")
