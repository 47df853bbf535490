"""Host planning cost of ``Residency.plan``: the O(log K) planner against the one it replaced.

Both planners run in this one process on the same routing (uniform random top-k per token,
seeded): ``before`` is the old planner kept as the test oracle (tests/support/planner_oracle.py),
``after`` is pagedexperts.residency (planner and policies). Steps before every slot is filled are warm-up, not timed.

Targets (issue 13): per-miss plan time at K = 128 over K = 16 at E = 256, batch 32, top-8, at
most 1.5 (LRU and LFU; adaptive within 2x of LFU); median plan time at E = 128, K = 16 and 64:
at most 15 us at batch 1 and 60 us at batch 32.

Usage: python bench/plan_bench.py [--steps 300] [--policies lru,lfu,adaptive,flru] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import planner_oracle as before  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from pagedexperts.residency import planner, policies  # noqa: E402

after = SimpleNamespace(Residency=planner.Residency, make_policy=policies.make_policy)

TOP_K = 8


def routing(num_experts: int, batch: int, steps: int, seed: int) -> list[list[int]]:
    """Per step, the distinct experts of ``batch`` tokens each routed to TOP_K distinct experts
    uniformly at random (what the pager hands ``plan``: a list of distinct ids, unsorted)."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((steps, batch, num_experts)), axis=2)[:, :, :TOP_K]
    return [list(set(step.reshape(-1).tolist())) for step in ids]


def measure(module, policy: str, *, num_experts: int, num_slots: int, batch: int, steps: int) -> dict:
    """Times of ``plan`` over ``steps`` timed steps after a warm-up that fills every slot."""
    res = module.Residency(num_experts, num_slots, module.make_policy(policy, num_slots))
    warm = routing(num_experts, batch, 64, seed=1)
    for union in warm:
        res.plan(union)
    times, misses = [], []
    gc.collect()
    for union in routing(num_experts, batch, steps, seed=2):
        t0 = time.perf_counter()
        plan = res.plan(union)
        times.append(time.perf_counter() - t0)
        misses.append(plan.misses)
    # per miss: the median step's time over the median step's misses (a shared host preempts
    # some steps for milliseconds, which would dominate a sum)
    return dict(median_us=1e6 * statistics.median(times),
                per_miss_us=1e6 * statistics.median(times) / max(statistics.median(misses), 1),
                misses_per_step=sum(misses) / steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--policies", default="lru,lfu,adaptive,flru")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    rows = []
    for impl, module in (("before", before), ("after", after)):
        for policy in policies:
            for e, ks, batches in ((256, (16, 128), (32,)), (128, (16, 64), (1, 8, 32))):
                for k in ks:
                    for b in batches:
                        r = measure(module, policy, num_experts=e, num_slots=k, batch=b, steps=args.steps)
                        rows.append(dict(impl=impl, policy=policy, E=e, K=k, batch=b, **r))
    print(report(rows, policies))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def report(rows: list[dict], policies: list[str]) -> str:
    def get(impl, policy, e, k, b):
        return next(r for r in rows if (r["impl"], r["policy"], r["E"], r["K"], r["batch"]) == (impl, policy, e, k, b))

    out = ["## Per-miss plan time, E=256, batch 32, top-8 (uniform routing)", "",
           "| policy | impl | K=16 us/miss | K=128 us/miss | K=128 / K=16 | median us K=16 | median us K=128 |",
           "|---|---|---|---|---|---|---|"]
    for p in policies:
        for impl in ("before", "after"):
            a, b = get(impl, p, 256, 16, 32), get(impl, p, 256, 128, 32)
            out.append(f"| {p} | {impl} | {a['per_miss_us']:.2f} | {b['per_miss_us']:.2f} | "
                       f"{b['per_miss_us'] / a['per_miss_us']:.2f} | {a['median_us']:.0f} | {b['median_us']:.0f} |")
    out += ["", "## Median plan time (us), E=128, top-8 (uniform routing); targets: <= 15 at batch 1, <= 60 at batch 32",
            "", "| policy | impl | K | batch 1 | batch 8 | batch 32 | misses/step at 32 |", "|---|---|---|---|---|---|---|"]
    for p in policies:
        for impl in ("before", "after"):
            for k in (16, 64):
                r = [get(impl, p, 128, k, b) for b in (1, 8, 32)]
                out.append(f"| {p} | {impl} | {k} | {r[0]['median_us']:.1f} | {r[1]['median_us']:.1f} | "
                           f"{r[2]['median_us']:.1f} | {r[2]['misses_per_step']:.0f} |")
    lfu = {impl: get(impl, "lfu", 256, 128, 32)["median_us"] for impl in ("before", "after")}
    if "adaptive" in policies and "lfu" in policies:
        ad = {impl: get(impl, "adaptive", 256, 128, 32)["median_us"] for impl in ("before", "after")}
        out += ["", "adaptive / lfu median plan time at E=256, K=128, batch 32: "
                + ", ".join(f"{impl} {ad[impl] / lfu[impl]:.2f}x" for impl in ("before", "after"))]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
