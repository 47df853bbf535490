"""Policy evaluation for issue 8: tune on one half of the routing, report on the other.

Traces: the bundled model's held-out traces (``bench/record_traces.py``: ``<set>_tune.npz`` and
``<set>_report.npz``, split by prompt) and the two real JSON-lines traces of ../shared/data
(layer 0 only; split by steps: first half tune, second half report). For each trace and K in
(2k, 4k, E/2): hit rate of LRU, each policy and Belady, the fraction of the LRU-to-Belady gap
closed ((policy - LRU) / (Belady - LRU)), and MB paged per token. ``--tune`` sweeps the policies'
parameters on the tune halves first.

Usage: python bench/policy_eval.py --bundled DIR [--tune] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

from pagedexperts.residency import planner, policies
from pagedexperts.analysis import simulate as sim
from pagedexperts.analysis.trace import load_trace

HERE = os.path.dirname(os.path.abspath(__file__))
REAL = {"qwen15moe_l0": "qwen15moe_a27b_layer0_gsm8k.jsonl", "olmoe_l0": "olmoe_1b7b_layer0_gsm8k.jsonl"}
SETS = ("gsm8k", "mtbench", "wikitext")
POLICIES = ("lru", "lfu", "flru", "adaptive")


def load_halves(bundled: str | None, data_dir: str) -> dict[str, dict]:
    """name -> {tune: steps, report: steps, E, k}."""
    out = {}
    if bundled:
        for name in SETS:
            tr = load_trace(os.path.join(bundled, f"{name}_tune.npz"))
            rp = load_trace(os.path.join(bundled, f"{name}_report.npz"))
            out[f"bundled_{name}"] = dict(tune=sim.recorded_steps(tr), report=sim.recorded_steps(rp),
                                          E=tr.meta.num_experts, k=tr.meta.top_k)
    for name, fn in REAL.items():
        path = os.path.join(data_dir, "traces", fn)
        if not os.path.exists(path):
            continue
        t = load_trace(path)
        steps = sim.recorded_steps(t)
        half = len(steps) // 2
        out[name] = dict(tune=steps[:half], report=steps[half:], E=t.meta.num_experts, k=t.meta.top_k)
    return out


def hits(steps, *, E: int, K: int, factory) -> tuple[int, int]:
    """(hits, misses) summed over layers, replaying ``steps`` with policies from ``factory(K)``."""
    h = m = 0
    layers = sorted({ly for s in steps for ly in s.ids})
    for ly in layers:
        res = planner.Residency(E, K, factory(K))
        for s in steps:
            p = res.plan(sim.np.unique(s.ids[ly]).tolist())
            h, m = h + p.hits, m + p.misses
    return h, m


def tune(traces: dict) -> dict:
    """Sweep LFU half-life and the adaptive window on the tune halves: mean hit rate over traces x K."""
    grids = {
        "lfu": [dict(half_life=h) for h in (4, 8, 16, 32, 64, 128, 0)],
        "adaptive": [dict(window=w) for w in (8, 16, 32, 64, 128)],
    }
    result = {}
    for name, grid in grids.items():
        rows = []
        for params in grid:
            rates = []
            for t in traces.values():
                for K in sim.default_num_resident(num_experts=t["E"], top_k=t["k"]):
                    h, m = hits(t["tune"], E=t["E"], K=K,
                                factory=lambda k, p=params: policies.POLICIES[name](k, **p))
                    rates.append(h / (h + m))
            rows.append(dict(params=params, mean_hit_rate=sum(rates) / len(rates)))
            print(f"tune {name} {params}: mean hit rate {100 * rows[-1]['mean_hit_rate']:.2f}%", flush=True)
        result[name] = rows
    return result


def report(traces: dict, *, expert_mb: float) -> list[dict]:
    """One row per (trace, K, policy) on the report halves, with gap closed vs LRU -> Belady."""
    rows = []
    for tname, t in traces.items():
        for K in sim.default_num_resident(num_experts=t["E"], top_k=t["k"]):
            res = {}
            for pol in POLICIES + ("belady",):
                stats, _ = sim.replay(t["report"], num_experts=t["E"], num_resident=K, policy=pol,
                                      expert_bytes=round(expert_mb * 1e6) if tname.startswith("bundled") else 0)
                d = stats.as_dict()
                res[pol] = d
            lru, opt = res["lru"]["hit_rate"], res["belady"]["hit_rate"]
            for pol, d in res.items():
                gap = (d["hit_rate"] - lru) / (opt - lru) if opt > lru else float("nan")
                rows.append(dict(trace=tname, K=K, policy=pol, hit_rate=d["hit_rate"], gap_closed=gap,
                                 mb_per_token=d["bytes_per_token"] / 1e6, misses_per_token=d["misses_per_token"]))
    return rows


def format_tables(rows: list[dict]) -> str:
    out = []
    for (tname, K), grp in itertools.groupby(rows, key=lambda r: (r["trace"], r["K"])):
        grp = list(grp)
        out.append(f"\n{tname}  K={K}")
        out.append("| policy | hit % | gap closed | misses/tok | MB paged/tok |")
        out.append("|---|---:|---:|---:|---:|")
        for r in grp:
            gap = "" if r["policy"] in ("lru", "belady") else f"{100 * r['gap_closed']:.0f}%"
            out.append(f"| {r['policy']} | {100 * r['hit_rate']:.1f} | {gap} | {r['misses_per_token']:.2f} | "
                       f"{r['mb_per_token']:.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundled", help="directory of <set>_tune.npz / <set>_report.npz of the bundled model")
    ap.add_argument("--data-dir", default=os.path.join(HERE, "..", "..", "shared", "data"))
    ap.add_argument("--expert-mb", type=float, default=0.0, help="MB per expert (bundled traces' bytes column)")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    traces = load_halves(args.bundled, args.data_dir)
    tuned = tune(traces) if args.tune else None
    rows = report(traces, expert_mb=args.expert_mb)
    print(format_tables(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tune=tuned, report=rows), f, indent=2)


if __name__ == "__main__":
    main()
