"""How sequences are packed into one forward: left-padded prefill inputs, prefill groups under
a padded-token budget, and the 2D attention mask of a batched decode step.

Pure tensor construction on the CPU (int64), no model: the scheduler moves the results to the
model's device. Legend: B sequences, P_max the longest prompt of a batch, S cached tokens.
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
