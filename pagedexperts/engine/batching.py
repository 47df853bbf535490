"""How sequences are padded into one forward: left-padded prefill inputs, prefill groups under
a padded-token budget, and the batch cache and 2D attention mask of a batched decode step,
``forward_rows`` running one (one new token per request when decoding, 1 + its proposals
when verifying speculation); packing without padding is ``chunked_prefill``.

Tensor construction, no model of its own (``forward_rows`` calls the forward it is given):
inputs are built on the CPU (int64) and moved to the model's device; caches stay where the
requests' buffers are. Legend: B
sequences, P_max the longest prompt of a batch, S cached tokens (S_max the longest), W new
tokens of the longest row, V vocabulary.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CachedRow(Protocol):
    """A sequence with per-layer KV buffers [kv_heads, capacity, D] of which ``length`` are
    filled (the scheduler's ``sequence.Request``, a draft model's ``speculative.draft.DraftState``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int


def decode_mask(lengths: list[int], s_max: int, widths: list[int] | None = None) -> torch.Tensor:
    """The 2D attention mask [B, s_max + W] (int64) of one batched decode step, W = max(widths).

    Row i: ``s_max - lengths[i]`` zeros (left padding), then ``lengths[i]`` ones (the
    request's cached tokens), then ``widths[i]`` ones for its new tokens (default one each:
    plain decoding; a verification step has 1 + its proposals) and zeros right-padding to W.
    """
    widths = widths or [1] * len(lengths)
    mask = torch.zeros((len(lengths), s_max + max(widths)), dtype=torch.long)
    for i, (n, w) in enumerate(zip(lengths, widths)):
        mask[i, s_max - n: s_max + w] = 1
    return mask


def prefill_inputs(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [B, P_max] int64, prompts left-padded.

    Positions count real tokens only (0 at each prompt's first token), as ``generate`` does
    for left-padded batches; padded columns hold ``pad_id``, mask 0, position 0.
    """
    p_max = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), p_max), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), p_max), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, p_max - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, p_max - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def prefill_batches(lengths: list[int], max_prefill_tokens: int) -> list[list[int]]:
    """Indices of admitted prompts grouped in order, each group's B x P_max <= the budget
    (a group holds at least one prompt)."""
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
    """The batch cache (a transformers DynamicCache, [B, kv_heads, S_max, D] per layer) of one
    decode step over requests' own buffers (``keys`` / ``values`` [kv_heads, capacity, D] per
    layer, ``length`` filled): left-padded; a request alone unpadded, as ``generate`` decodes."""
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
    """Write each request's new keys / values (the batch cache's columns S_max ..
    S_max + widths[i], default one each) into its own buffers at ``length``, then advance
    ``length`` by its width."""
    widths = widths or [1] * len(reqs)
    for layer, cl in enumerate(cache.layers):
        s_max = cl.keys.shape[2] - max(widths)
        for i, (r, w) in enumerate(zip(reqs, widths)):
            r.keys[layer][:, r.length: r.length + w] = cl.keys[i, :, s_max: s_max + w]
            r.values[layer][:, r.length: r.length + w] = cl.values[i, :, s_max: s_max + w]
    for r, w in zip(reqs, widths):
        r.length += w


def forward_rows(forward, rows: list[CachedRow], tokens: list[list[int]], *, pad_id: int, device) -> torch.Tensor:
    """One forward of ``tokens[i]`` after row i's ``length`` cached tokens; logits [B, W, V] (CPU).

    ``rows``: the requests (or a draft's states) with per-layer ``keys`` / ``values`` buffers
    [kv_heads, capacity, D] and ``length``. The caches are left-padded (``decode_cache``),
    the new tokens right-padded to W = max len(tokens[i]) with ``pad_id``, the 2D mask
    (``decode_mask``) hides both paddings, positions continue each row's own. A single row is
    not padded and gets no mask (as ``model.generate``). The new keys and values are written
    into each row's buffers at ``length`` and ``length`` advances by len(tokens[i])
    (``keep_decoded_kv``). ``forward(input_ids=, position_ids=, cache=, logits_to_keep=,
    [attention_mask=])`` runs the model.
    """
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
