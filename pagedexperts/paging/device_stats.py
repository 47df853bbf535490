"""Paging counters of one MoE layer held on the device: accumulated without a sync.

Owns the device tensor of counters a device-planned layer-step adds to (steps, tokens, hits,
misses, bytes paged, waves, multi-wave steps, union sum, union max, last union) and their
conversion to ``stats.accounting.LayerStats``, the one definition of the counts (docs/design.md "Terms": one hit or
miss per distinct routed expert per layer per step). The tensor is read only when stats are
asked for (``to_layer_stats``: one device-to-host copy). Does not: time anything (a
device-planned step has no host timing to give) or decide residency (``device_residency``).
"""

from __future__ import annotations

import torch

from pagedexperts.stats.accounting import LayerStats

# the counter vector's fields, in order (int64 each)
FIELDS = ("steps", "tokens", "padding_tokens", "hits", "misses", "bytes_paged", "waves", "multi_wave_steps",
          "union_sum", "union_max", "union_last")
_INDEX = {name: i for i, name in enumerate(FIELDS)}


class DeviceCounters:
    """The counters of one layer: ``values`` [len(FIELDS)] int64 on the device.

    Args:
        device: where the counters live (the slots' device).
        expert_bytes: bytes of one expert (all its tensors): bytes paged = misses x this.
    """

    def __init__(self, device, *, expert_bytes: int) -> None:
        self.values = torch.zeros(len(FIELDS), dtype=torch.int64, device=device)
        self.expert_bytes = expert_bytes

    def add_step(self, step: torch.Tensor, *, rows: int, padding: torch.Tensor | None = None) -> None:
        """Add one layer-step: ``step`` [3] int64 (hits, misses, waves: ``DecidePlan.step``) on
        the device; ``rows`` the step's T (known on the host); ``padding`` the 0-dim device
        count of padding rows among them (``runner.ExpertsRunner.padding_count``), None: none. Tokens
        = rows - padding, as the host executor counts them. In place, no sync."""
        hits, misses, waves = step[0], step[1], step[2]
        union = hits + misses
        pad = torch.zeros_like(hits) if padding is None else padding.to(hits.device, torch.int64).reshape(())
        v = self.values
        delta = torch.stack([torch.ones_like(hits), rows - pad, pad, hits, misses,
                             misses * self.expert_bytes, waves, (waves > 1).long(), union,
                             torch.zeros_like(hits), torch.zeros_like(hits)])
        v.add_(delta)
        v[_INDEX["union_max"]] = torch.maximum(v[_INDEX["union_max"]], union)
        v[_INDEX["union_last"]] = union

    def reset(self) -> None:
        """Every counter back to zero (in place: the tensor keeps its address)."""
        self.values.zero_()

    def to_layer_stats(self) -> LayerStats:
        """The counters as a ``LayerStats`` (page-ins = misses; no times). Reads the device."""
        got = dict(zip(FIELDS, self.values.tolist()))
        stats = LayerStats(**got)
        stats.page_ins = stats.misses
        return stats
