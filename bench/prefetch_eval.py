"""Prefetch evaluation for issue 8: exposed misses per token in the timing model, and the
measured CPU overhead of prefetch per decode step.

1. Offline: replay held-out traces recorded with ``--prefetch`` (``bench/record_traces.py``,
   predictions stored as the trace extra ``prefetch``) through ``simulate.replay_prefetch`` at
   K = 4k with and without the prefetches: exposed misses per token (misses whose page-in was not
   hidden behind the previous layer's compute), hit rate, prefetches issued / used / wasted.
2. Measured (``--measure``): greedy decode on the model with and without ``prefetch=True``; the
   median decode step time of each, and the prefetch's own host time per step (prediction:
   next router matmul + top-k + read-back; issue: plan + copies).

Usage: python bench/prefetch_eval.py --traces DIR [--measure] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import os
import statistics
import time

from pagedexperts.analysis import simulate as sim
from pagedexperts.analysis.trace import load_trace

# Timing scenarios: (name, expert MB, link GB/s, compute ms per MoE layer). The bundled model's
# experts are tiny, so its traces are replayed as if its experts had a real model's size.
SCENARIOS = (
    ("int4 2.43MB @25GB/s, 0.3ms/layer", 2.43, 25.0, 0.3),
    ("fp8 4.72MB @50GB/s, 0.3ms/layer", 4.72, 50.0, 0.3),
)


def offline(trace_dir: str, *, policies, budgets) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "*_report.npz"))):
        trace = load_trace(path)
        if "prefetch" not in trace.meta.extras:
            continue
        e, k = trace.meta.num_experts, trace.meta.top_k
        steps = sim.recorded_steps(trace)
        for policy in policies:
            for sname, mb, gbps, ms in SCENARIOS:
                for budget in (0, *budgets):
                    r = sim.replay_prefetch(steps, num_experts=e, num_resident=4 * k, policy=policy, budget=budget,
                                            expert_bytes=round(mb * 1e6), link_gbps=gbps, compute_ms_per_layer=ms)
                    tot = r.stats.total()
                    pf = [p.as_dict() for p in r.prefetch.values()]
                    rows.append(dict(trace=os.path.basename(path), policy=policy, scenario=sname, budget=budget,
                                     K=4 * k, hit_rate=tot.hit_rate, misses_per_token=tot.misses / r.stats.tokens,
                                     exposed_per_token=r.exposed_per_token,
                                     stall_ms_per_token=1e3 * r.stall_s / r.stats.tokens,
                                     decode_hit_rate=r.decode.total().hit_rate,
                                     decode_misses_per_token=r.decode.total().misses / max(1, r.decode.tokens),
                                     decode_exposed_per_token=r.exposed_per_decode_token,
                                     decode_stall_ms_per_token=1e3 * r.stall_decode_s / max(1, r.decode.tokens),
                                     issued=sum(p["issued"] for p in pf), used=sum(p["used"] for p in pf),
                                     wasted=sum(p["wasted"] for p in pf)))
    return rows


def measure(model_path: str | None, *, policy: str, new_tokens: int, repeats: int) -> dict:
    import torch

    from pagedexperts.loading.loader import load_model

    # Both models decode the same prompt step by step, alternating, so CPU contention hits both alike.
    models = {name: load_model(model_path, policy=policy, prefetch=pf) for name, pf in (("plain", False), ("prefetch", True))}
    tok = models["plain"][1]
    ids = tok("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
              return_tensors="pt")["input_ids"]
    step_s = {name: [] for name in models}
    # transformers >= 5.24 takes the KV cache as ``cache``; 5.17 as ``past_key_values``
    cache_kwarg = "cache" if "cache" in inspect.signature(models["plain"][0].forward).parameters else "past_key_values"
    for _ in range(repeats):
        state = {name: (None, ids) for name in models}
        with torch.no_grad():
            for i in range(new_tokens):
                for name, (model, _) in models.items():
                    past, cur = state[name]
                    t0 = time.perf_counter()
                    o = model(input_ids=cur, use_cache=True, **{cache_kwarg: past})
                    if i:  # decode steps only
                        step_s[name].append(time.perf_counter() - t0)
                    state[name] = (o.past_key_values, o.logits[:, -1:].argmax(-1))
    out = {name: dict(median_step_ms=1e3 * statistics.median(v), steps=len(v)) for name, v in step_s.items()}
    t = models["prefetch"][0].pagedexperts.prefetch_stats()["total"]
    out["prefetch"].update(prefetch_host_ms_per_step=1e3 * (t["predict_s"] + t["issue_s"]) / (repeats * new_tokens), **t)
    out["overhead_ms_per_step"] = out["prefetch"]["median_step_ms"] - out["plain"]["median_step_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--policies", default="lru")
    ap.add_argument("--budgets", default="4,8")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = offline(args.traces, policies=args.policies.split(","), budgets=[int(b) for b in args.budgets.split(",")])
    print("| trace | policy | scenario | budget | hit % | misses/tok | exposed/tok | stall ms/tok | decode: hit % "
          "| misses/tok | exposed/tok | stall ms/tok | issued | used | wasted |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['trace']} | {r['policy']} | {r['scenario']} | {r['budget'] or 'off'} | {100 * r['hit_rate']:.1f} | "
              f"{r['misses_per_token']:.2f} | {r['exposed_per_token']:.2f} | {r['stall_ms_per_token']:.2f} | "
              f"{100 * r['decode_hit_rate']:.1f} | {r['decode_misses_per_token']:.2f} | "
              f"{r['decode_exposed_per_token']:.2f} | {r['decode_stall_ms_per_token']:.2f} | "
              f"{r['issued']} | {r['used']} | {r['wasted']} |")
    res = dict(offline=rows)
    if args.measure:
        res["measured"] = measure(args.model_path, policy=args.policies.split(",")[0], new_tokens=args.new_tokens,
                                  repeats=args.repeats)
        print(json.dumps(res["measured"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
