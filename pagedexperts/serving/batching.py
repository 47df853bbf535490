"""How sequences are padded into one forward: left-padded prefill inputs, prefill groups under
a padded-token budget, and the batch cache and 2D attention mask of a batched decode step
(packing without padding is ``chunked_prefill``).

Tensor construction, no model: inputs are built on the CPU (int64) and the scheduler moves
them to the model's device; caches stay where the requests' buffers are. Legend: B
sequences, P_max the longest prompt of a batch, S cached tokens.
"""

from __future__ import annotations

import torch


def decode_mask(lengths: list[int], s_max: int) -> torch.Tensor:
    """The 2D attention mask [B, s_max + 1] (int64) of one batched decode step.

    Row i: ``s_max - lengths[i]`` zeros (left padding), then ``lengths[i]`` ones (the
    request's cached tokens), then a one for the token being decoded.
    """
    mask = torch.zeros((len(lengths), s_max + 1), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, s_max - n:] = 1
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


def decode_cache(reqs):
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


def keep_decoded_kv(reqs, cache) -> None:
    """Write each request's new key / value (the batch cache's last column) into its own buffers
    at ``length``, then advance ``length`` by one."""
    for layer, cl in enumerate(cache.layers):
        for i, r in enumerate(reqs):
            r.keys[layer][:, r.length] = cl.keys[i, :, -1]
            r.values[layer][:, r.length] = cl.values[i, :, -1]
    for r in reqs:
        r.length += 1
