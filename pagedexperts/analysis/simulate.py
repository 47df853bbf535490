"""Trace simulator: replay recorded routing through the runtime's own residency and accounting.

Steps from a ``Trace`` (as recorded, B request streams interleaved, or uniform routing of the
same shape), replayed over (routing, policy, K) through ``residency.planner`` and
``stats.accounting`` (the runtime's code: hit rates cannot drift). Does not: read files or print.

Legend: T tokens of a step, k = top_k, E routed experts, K resident slots, B batch size, L MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pagedexperts.residency import planner, policies
from pagedexperts.residency.belady import BeladyPolicy
from pagedexperts.residency.eviction import EvictionPolicy
from pagedexperts.stats.accounting import LayerStats, ModelStats, PrefetchStats
from pagedexperts.stats.tiers import TierStats
from pagedexperts.analysis.trace import PREFETCH_EXTRA, Trace

ROUTINGS = ("trace", "uniform")


@dataclass(frozen=True)
class SimStep:
    """One step to replay: ``ids[layer]`` [T, k] routed ids; ``tokens`` + ``padding`` = T;
    ``extras[(layer, name)]``: the trace's per-layer extras (recorded prefetch predictions)."""

    phase: str
    tokens: int
    ids: dict[int, np.ndarray]
    padding: int = 0
    extras: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SimResult:
    """One replay: ``stats`` over all steps, ``decode`` over decode steps; ``batch_size`` None: as recorded."""

    routing: str
    policy: str
    num_resident: int
    batch_size: int | None
    stats: ModelStats
    decode: ModelStats


def policy_names() -> list[str]:
    """Policies the simulator knows: the runtime's (``policies.POLICIES``) plus "belady"."""
    return sorted({*policies.POLICIES, BeladyPolicy.name})


def default_num_resident(*, num_experts: int, top_k: int) -> list[int]:
    """K = 2k, 4k and E/2, each clipped to [top_k, E], sorted and deduplicated."""
    return sorted({max(top_k, min(num_experts, x)) for x in (2 * top_k, 4 * top_k, num_experts // 2)})


def routed_per_token(steps: list[SimStep]) -> int:
    """top_k of ``steps``: the widest row of routed ids (1 for no steps)."""
    return max((ids.shape[-1] for s in steps for ids in s.ids.values()), default=1)


def check_num_resident(num_resident: int, *, num_experts: int, top_k: int) -> None:
    """The runtime's K check with min_slots = top_k.
    Raises ValueError: K outside [top_k, E], naming --num-resident."""
    planner.check_num_resident(num_resident, num_experts=num_experts, min_slots=top_k)


# ---------------------------------------------------------------------------------------------
# Steps to replay
# ---------------------------------------------------------------------------------------------


def recorded_steps(trace: Trace) -> list[SimStep]:
    """The trace's steps as recorded (prefill and decode, all requests of a step together)."""
    return [SimStep(phase=s.phase, tokens=s.num_tokens, padding=s.num_padding, ids=dict(s.topk_ids),
                    extras=dict(s.extras)) for s in trace]


def request_streams(trace: Trace, *, min_streams: int = 1) -> list[dict[int, np.ndarray]]:
    """Decode streams (layer -> [n, k]) in request-id order, cut into contiguous pseudo-requests
    when fewer than ``min_streams``.
    Raises ValueError: the trace has no decode rows with a known request id."""
    streams = [v for _, v in sorted(trace.streams().items())]
    if not streams:
        raise ValueError("trace has no per-request decode streams (no decode rows with a request id)")
    if len(streams) < min_streams:
        parts = -(-min_streams // len(streams))
        cut = []
        for s in streams:
            n = len(next(iter(s.values())))
            bounds = np.linspace(0, n, parts + 1).astype(int)
            cut += [{ly: ids[a:b] for ly, ids in s.items()} for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        streams = cut
    return streams


def batched_steps(streams: list[dict[int, np.ndarray]], *, batch_size: int) -> list[SimStep]:
    """Interleave groups of ``batch_size`` consecutive streams: step t holds token t of each running
    stream of the group; a last group short of B is left out when a full one exists."""
    if batch_size < 1:
        raise ValueError(f"batch size {batch_size} must be >= 1 (--batch-sizes)")
    groups = [streams[i:i + batch_size] for i in range(0, len(streams), batch_size)]
    if len(groups) > 1 and len(groups[-1]) < batch_size:
        groups.pop()
    steps = []
    for group in groups:
        layers = list(group[0])
        for t in range(max(len(s[layers[0]]) for s in group)):
            live = [s for s in group if t < len(s[layers[0]])]
            steps.append(SimStep(phase="decode", tokens=len(live),
                                 ids={ly: np.stack([s[ly][t] for s in live]) for ly in layers}))
    return steps


def uniform_steps(steps: list[SimStep], *, num_experts: int, top_k: int, seed: int = 0) -> list[SimStep]:
    """Same steps, phases and T, each token routed to k distinct experts uniformly at random."""
    rng = np.random.default_rng(seed)
    out = []
    for s in steps:
        rows = s.tokens + s.padding
        ids = {ly: np.argsort(rng.random((rows, num_experts)), axis=1)[:, :top_k] for ly in s.ids}
        out.append(SimStep(phase=s.phase, tokens=s.tokens, padding=s.padding, ids=ids))
    return out


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------


def make_policy(name: str, *, num_slots: int, unions: Sequence[Sequence[int]]) -> EvictionPolicy:
    """The runtime's policy ``name``, or Belady's with the layer's future ``unions``.
    Raises ValueError: unknown name (lists the choices; ``--policy``)."""
    if name == BeladyPolicy.name:
        return BeladyPolicy(num_slots, unions)
    if name not in policies.POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {policy_names()} (--policy)")
    return policies.make_policy(name, num_slots)


def replay(
    steps: list[SimStep], *, num_experts: int, num_resident: int, policy: str, expert_bytes: int = 0,
    host_rows: int | None = None,
) -> tuple[ModelStats, ModelStats]:
    """Replay ``steps`` through one ``Residency`` per layer: (all steps, decode steps), counted by
    ``LayerStats.record_step``. With ``host_rows`` R < E, each layer's page-ins also go through a
    host ``Residency`` of R rows as ``storage.host_tier`` does (Belady's device policy: LRU host
    rows); host misses (disk reads) land in ``ModelStats.tiers``.
    Raises ValueError: K outside [top_k, E]; R outside [1, E) (``--host-rows``); an id outside [0, E)."""
    check_num_resident(num_resident, num_experts=num_experts, top_k=routed_per_token(steps))
    if host_rows is not None and not 1 <= host_rows < num_experts:
        raise ValueError(f"--host-rows {host_rows} must be in [1, E={num_experts}) (--host-rows)")
    layers = sorted({ly for s in steps for ly in s.ids})
    unions = {ly: [np.unique(s.ids[ly]).tolist() for s in steps] for ly in layers}
    everything, decode = ModelStats(), ModelStats()
    host_policy = policy if policy in policies.POLICIES else "lru"
    for ly in layers:
        res = planner.Residency(num_experts, num_resident,
                                  make_policy(policy, num_slots=num_resident, unions=unions[ly]))
        host = None if host_rows is None else planner.Residency(
            num_experts, host_rows, policies.make_policy(host_policy, host_rows))
        all_stats, dec_stats = LayerStats(), LayerStats()
        all_tier, dec_tier = TierStats(), TierStats()
        for step, union in zip(steps, unions[ly]):
            plan = res.plan(union)
            kw = dict(hits=plan.hits, misses=plan.misses, waves=len(plan.waves), tokens=step.tokens,
                      padding_tokens=step.padding, expert_bytes=expert_bytes)
            all_stats.record_step(**kw)
            if step.phase == "decode":
                dec_stats.record_step(**kw)
            if host is not None:
                _replay_host(host, plan, expert_bytes, [all_tier] + ([dec_tier] if step.phase == "decode" else []))
        everything.layers[ly], decode.layers[ly] = all_stats, dec_stats
        if host is not None:
            everything.tiers[ly], decode.tiers[ly] = all_tier, dec_tier
    return everything, decode


def _replay_host(host: planner.Residency, plan, expert_bytes: int, tiers: list[TierStats]) -> None:
    """The host rows see the step's page-ins in order; a host miss is one disk read."""
    for load in plan.loads:
        hit, _ = host.access(load.expert)
        for t in tiers:
            t.record_host_access(hit)
            if not hit:
                t.record_read(nbytes=expert_bytes, preads=0, seconds=0.0)


def modelled_decode_tok_s(
    decode: ModelStats, *, link_gbps: float, compute_ms_per_layer: float, model_layers: int | None = None
) -> float:
    """Modelled decode tokens/s: ``tokens / (steps x L x compute + bytes paged / link)``, page-ins not
    overlapped; ``model_layers`` scales L. Units: GB/s, milliseconds."""
    if not decode.layers or not decode.tokens:
        return 0.0
    steps = max(s.steps for s in decode.layers.values())
    recorded = len(decode.layers)
    seconds = steps * recorded * compute_ms_per_layer / 1e3 + decode.total().bytes_paged / (link_gbps * 1e9)
    seconds *= (model_layers or recorded) / recorded
    return decode.tokens / seconds if seconds > 0 else float("inf")


def run_grid(
    steps: list[SimStep], *, num_experts: int, top_k: int, num_resident: Sequence[int], policies: Sequence[str],
    batch_size: int | None = None, uniform: bool = True, seed: int = 0, expert_bytes: int = 0,
    host_rows: int | None = None,
) -> list[SimResult]:
    """``replay`` of ``steps`` (and uniform routing, with ``uniform``) for every policy and K;
    ``batch_size`` only labels the results.
    Raises ValueError: unknown policy, K out of [top_k, E] (checked before any replay), or no steps."""
    if not steps:
        raise ValueError("nothing to replay: the trace gives no steps")
    for k in num_resident:
        check_num_resident(k, num_experts=num_experts, top_k=top_k)
    for name in policies:
        make_policy(name, num_slots=1, unions=[])
    routings = {"trace": steps}
    if uniform:
        routings["uniform"] = uniform_steps(steps, num_experts=num_experts, top_k=top_k, seed=seed)
    out = []
    for routing, rsteps in routings.items():
        for name in policies:
            for k in num_resident:
                everything, decode = replay(rsteps, num_experts=num_experts, num_resident=k, policy=name,
                                            expert_bytes=expert_bytes, host_rows=host_rows)
                out.append(SimResult(routing=routing, policy=name, num_resident=k, batch_size=batch_size,
                                     stats=everything, decode=decode))
    return out


# ---------------------------------------------------------------------------------------------
# Policies against the bound, and prefetch (issue 8)
# ---------------------------------------------------------------------------------------------


def gap_closed(*, policy_hit_rate: float, lru_hit_rate: float, belady_hit_rate: float) -> float:
    """(policy - LRU) / (Belady - LRU) hit rate: 1.0 optimal, 0.0 LRU, negative worse; NaN without a gap."""
    gap = belady_hit_rate - lru_hit_rate
    return (policy_hit_rate - lru_hit_rate) / gap if gap > 0 else float("nan")


@dataclass(frozen=True)
class PrefetchReplay:
    """A replay with the recorded prefetch predictions applied (``budget`` 0: none): ``stats``,
    per-layer ``prefetch`` (into that layer), ``exposed`` misses, modelled ``stall_s``, and the
    same over decode steps."""

    stats: ModelStats
    prefetch: dict
    exposed: dict[int, int]
    stall_s: float
    decode: ModelStats
    exposed_decode: dict[int, int]
    stall_decode_s: float

    @property
    def exposed_per_token(self) -> float:
        tokens = self.stats.tokens
        return sum(self.exposed.values()) / tokens if tokens else 0.0

    @property
    def exposed_per_decode_token(self) -> float:
        tokens = self.decode.tokens
        return sum(self.exposed_decode.values()) / tokens if tokens else 0.0


def replay_prefetch(
    steps: list[SimStep], *, num_experts: int, num_resident: int, policy: str, budget: int,
    expert_bytes: int, link_gbps: float, compute_ms_per_layer: float,
) -> PrefetchReplay:
    """Replay ``steps`` as ``--prefetch`` runs them: before layer l plans a step, its recorded
    predictions (made while layer l-1 computed) are paged in with ``Residency.prefetch(..., budget)``.
    Timing (one copy engine, in order): a demand miss is exposed; the j-th prefetch copy into
    layer l ends (j + 1) x expert_bytes / link after layer l-1's compute starts and is exposed if
    used and ending after that compute. Stall = demand page-in time + prefetch overrun.
    Units: bytes, GB/s, milliseconds."""
    check_num_resident(num_resident, num_experts=num_experts, top_k=routed_per_token(steps))
    t_load = expert_bytes / (link_gbps * 1e9)
    compute_s = compute_ms_per_layer / 1e3
    layers = sorted({ly for s in steps for ly in s.ids})
    unions = {ly: [np.unique(s.ids[ly]).tolist() for s in steps] for ly in layers}
    out, dec, pstats, exposed, exposed_dec, stall, stall_dec = ModelStats(), ModelStats(), {}, {}, {}, 0.0, 0.0
    for ly in layers:
        res = planner.Residency(num_experts, num_resident,
                                  make_policy(policy, num_slots=num_resident, unions=unions[ly]))
        st, dst, ps, exp, dexp = LayerStats(), LayerStats(), PrefetchStats(), 0, 0
        for step, union in zip(steps, unions[ly]):
            pred = step.extras.get((ly, PREFETCH_EXTRA))
            loads = ()
            if budget and pred is not None:
                loads = res.prefetch([int(x) for x in pred], budget=budget)
                ps.issued += len(loads)
                ps.bytes += len(loads) * expert_bytes
                ps.pending.update(ld.expert for ld in loads)
            plan = res.plan(union)
            if ps.pending:
                ps.observe(union)
            kw = dict(hits=plan.hits, misses=plan.misses, waves=len(plan.waves), tokens=step.tokens,
                      padding_tokens=step.padding, expert_bytes=expert_bytes)
            st.record_step(**kw)
            used = set(union)
            late = sum(1 for j, ld in enumerate(loads) if (j + 1) * t_load > compute_s and ld.expert in used)
            wait = plan.misses * t_load + max(0.0, len(loads) * t_load - compute_s)
            exp, stall = exp + plan.misses + late, stall + wait
            if step.phase == "decode":
                dst.record_step(**kw)
                dexp, stall_dec = dexp + plan.misses + late, stall_dec + wait
        out.layers[ly], dec.layers[ly], pstats[ly], exposed[ly], exposed_dec[ly] = st, dst, ps, exp, dexp
    return PrefetchReplay(stats=out, prefetch=pstats, exposed=exposed, stall_s=stall, decode=dec,
                          exposed_decode=exposed_dec, stall_decode_s=stall_dec)
