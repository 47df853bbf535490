"""Paging accounting, defined once: the runtime, the simulator and the server all count here.

Owns: per-layer counters (hits, misses, bytes paged, page-in seconds, waves, union size) and
their totals and rates. Definition (DESIGN.md): a hit or a miss is counted per distinct
routed expert per MoE layer per step; misses per token = misses / tokens of the step (summed
over steps). Padding tokens a caller could not exclude are counted in ``padding_tokens`` and
are NOT part of ``tokens``. Standard library only. Does not: decide residency or move bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable


@dataclass
class LayerStats:
    """Counters of one MoE layer; all counts are sums over recorded steps.

    Units: bytes (``bytes_paged``), seconds (``page_in_s``, ``plan_s``, ``sync_s``).
    ``plan_s`` is the host bookkeeping time (union, wave plan, slot map), ``sync_s`` the read of
    the top-k ids (the one sync per layer per step of host-side planning).
    """

    steps: int = 0
    tokens: int = 0
    padding_tokens: int = 0
    hits: int = 0
    misses: int = 0
    page_ins: int = 0
    bytes_paged: int = 0
    page_in_s: float = 0.0
    plan_s: float = 0.0
    sync_s: float = 0.0
    waves: int = 0
    multi_wave_steps: int = 0
    union_last: int = 0
    union_sum: int = 0
    union_max: int = 0

    def record_step(
        self,
        *,
        hits: int,
        misses: int,
        waves: int,
        tokens: int,
        expert_bytes: int,
        page_in_s: float = 0.0,
        plan_s: float = 0.0,
        sync_s: float = 0.0,
        padding_tokens: int = 0,
        bytes_paged: int | None = None,
    ) -> None:
        """Add one step of one layer. ``expert_bytes``: bytes of one expert's tensors;
        ``bytes_paged`` overrides misses x expert_bytes (the offload baseline copies all E)."""
        union = hits + misses
        self.steps += 1
        self.tokens += tokens
        self.padding_tokens += padding_tokens
        self.hits += hits
        self.misses += misses
        self.page_ins += misses
        self.bytes_paged += misses * expert_bytes if bytes_paged is None else bytes_paged
        self.page_in_s += page_in_s
        self.plan_s += plan_s
        self.sync_s += sync_s
        self.waves += waves
        self.multi_wave_steps += int(waves > 1)
        self.union_last = union
        self.union_sum += union
        self.union_max = max(self.union_max, union)

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before any access."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else 0.0

    @property
    def union_mean(self) -> float:
        return self.union_sum / self.steps if self.steps else 0.0

    @property
    def waves_per_step(self) -> float:
        return self.waves / self.steps if self.steps else 0.0

    def merge(self, other: "LayerStats") -> None:
        """Add ``other``'s counters to these (``union_last`` and ``union_max`` take the max)."""
        for name, value in asdict(other).items():
            if name == "union_max" or name == "union_last":
                setattr(self, name, max(getattr(self, name), value))
            else:
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            hit_rate=self.hit_rate,
            misses_per_token=self.misses_per_token,
            union_mean=self.union_mean,
            waves_per_step=self.waves_per_step,
        )
        return d


@dataclass
class ModelStats:
    """Per-layer stats of a whole model plus totals; ``tokens`` counts model steps' tokens once.

    ``layers`` maps a MoE layer index to its ``LayerStats``. Rates that are "per token" divide
    sums over layers by the tokens the model processed (each token passes every MoE layer), so
    ``misses_per_token`` is misses across all layers per token, and ``bytes_per_token`` is the
    bytes paged per token.
    """

    layers: dict[int, LayerStats] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    # disk tier on: MoE layer -> its host/disk counters (``storage.host_tier.TierStats``)
    tiers: dict = field(default_factory=dict)

    @classmethod
    def collect(cls, per_layer: Iterable[tuple[int, LayerStats]], fallbacks=(), tiers=None) -> "ModelStats":
        return cls(layers=dict(per_layer), fallbacks=list(fallbacks), tiers=dict(tiers or {}))

    def tier_totals(self) -> dict:
        """Host and disk tier counters summed over layers (``TierStats.as_dict`` keys, all
        zero without a disk tier), plus ``disk_bytes_per_token``."""
        totals = None
        for t in self.tiers.values():
            if totals is None:
                totals = type(t)()
            totals.merge(t)
        keys = ("host_hits", "host_misses", "host_hit_rate", "disk_reads", "disk_preads", "disk_bytes_read",
                "disk_read_s", "disk_read_p50_s", "disk_read_p99_s", "read_ahead_issued", "read_ahead_used")
        d = totals.as_dict() if totals is not None else dict.fromkeys(keys, 0)
        d["disk_tier"] = totals is not None
        d["disk_bytes_per_token"] = d["disk_bytes_read"] / self.tokens if self.tokens else 0.0
        return d

    def total(self) -> LayerStats:
        out = LayerStats()
        for s in self.layers.values():
            out.merge(s)
        return out

    @property
    def tokens(self) -> int:
        return max((s.tokens for s in self.layers.values()), default=0)

    def as_dict(self) -> dict:
        tot = self.total()
        tokens = self.tokens
        return {
            "tokens": tokens,
            "layer_steps": tot.steps,
            "hits": tot.hits,
            "misses": tot.misses,
            "hit_rate": tot.hit_rate,
            "misses_per_token": tot.misses / tokens if tokens else 0.0,
            "bytes_paged": tot.bytes_paged,
            "bytes_per_token": tot.bytes_paged / tokens if tokens else 0.0,
            "page_in_s": tot.page_in_s,
            "plan_s": tot.plan_s,
            "sync_s": tot.sync_s,
            "waves": tot.waves,
            "multi_wave_steps": tot.multi_wave_steps,
            "union_mean": tot.union_sum / tot.steps if tot.steps else 0.0,
            "union_max": tot.union_max,
            "fallbacks": list(self.fallbacks),
            **self.tier_totals(),
            "layers": {str(i): s.as_dict() for i, s in sorted(self.layers.items())},
        }
