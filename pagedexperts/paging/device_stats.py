"""Paging counters of one MoE layer held on the device: accumulated without a sync.

Owns the device tensor of counters a device-planned layer-step adds to (steps, tokens, hits,
misses, bytes paged, waves, multi-wave steps, union sum, union max, last union) and their
conversion to ``stats.LayerStats``, the one definition of the counts (DESIGN.md: one hit or
miss per distinct routed expert per layer per step). The tensor is read only when stats are
asked for (``to_layer_stats``: one device-to-host copy). Does not: time anything (a
device-planned step has no host timing to give) or decide residency (``device_residency``).
"""

from __future__ import annotations

import torch

from pagedexperts.stats import LayerStats

# the counter vector's fields, in order (int64 each)
FIELDS = ("steps", "tokens", "hits", "misses", "bytes_paged", "waves", "multi_wave_steps",
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

    def add_step(self, step: torch.Tensor, *, tokens: int) -> None:
        """Add one layer-step: ``step`` [3] int64 (hits, misses, waves: ``DecidePlan.step``) on
        the device; ``tokens`` the step's T (known on the host). In place, no sync."""
        hits, misses, waves = step[0], step[1], step[2]
        union = hits + misses
        v = self.values
        delta = torch.stack([torch.ones_like(hits), torch.full_like(hits, tokens), hits, misses,
                             misses * self.expert_bytes, waves, (waves > 1).long(), union,
                             torch.zeros_like(hits), torch.zeros_like(hits)])
        v.add_(delta)
        v[_INDEX["union_max"]] = torch.maximum(v[_INDEX["union_max"]], union)
        v[_INDEX["union_last"]] = union

    def to_layer_stats(self) -> LayerStats:
        """The counters as a ``LayerStats`` (page-ins = misses; no times). Reads the device."""
        got = dict(zip(FIELDS, self.values.tolist()))
        stats = LayerStats(**got)
        stats.page_ins = stats.misses
        return stats
