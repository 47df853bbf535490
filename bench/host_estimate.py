"""Host time per decode step of a 48-layer model, estimated from measured per-layer costs.

A Qwen3-30B-A3B-like MoE layer in everything the host sees (E = 128 routed experts, top-8,
K slots) but with tiny tensors (hidden 64), so the kernels take next to nothing and the time
of a layer-step is the host's: top-k read-back, union, wave plan, slot map, page-in issue,
the remap and the combine. Routing comes from a real trace (``pagedexperts.analysis.trace_routing``,
default the shared OLMoE trace), so hits and misses follow real text. For each batch B
(decode rows per step) it measures, per MoE layer-step: the paging stats' own plan and
read-back p50 (``stats.TimeDistribution``) and the whole experts call (p50), for the mode
``resident`` (no paging) and paged at each K, with the new planner and the old one (the test
oracle, tests/support/planner_oracle.py) in the same run; then multiplies by 48 layers.

Usage: python bench/host_estimate.py [--num-resident 32,64] [--batches 1,8,32] [--tokens 48]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import planner_oracle  # noqa: E402
from pagedexperts.loading import build as build_module, runners  # noqa: E402
from pagedexperts.paging import host_executor as pager  # noqa: E402
from pagedexperts.residency import planner, policies  # noqa: E402
from pagedexperts.analysis import trace_routing  # noqa: E402

PLANNERS = {"before": planner_oracle,  # the old planner (test oracle) and the new
            "after": SimpleNamespace(Residency=planner.Residency, make_policy=policies.make_policy)}

LAYERS_48 = 48  # Qwen3-30B-A3B's MoE layers
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=128,
             num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=1024)
TRACE = ROOT.parent / "shared" / "data" / "traces" / "olmoe_1b7b_layer0_gsm8k.jsonl"


def build(layers: int, k: int):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=layers, **SHAPE)
    fill = lambda m, sites, stores, dev: runners.random_fill(m, sites, stores, dev, seed=0)  # noqa: E731
    return build_module.build_from_options(config, fill, num_resident=k, device="cpu", dtype="float32", mode="paged")


def call_times(model) -> list[float]:
    """Hooks that time every experts call (pre- to post-forward); returns the list they fill."""
    times, start = [], {}
    for site in model.pagedexperts.sites:
        site.module.register_forward_pre_hook(lambda m, a: start.__setitem__(id(m), time.perf_counter()))
        site.module.register_forward_hook(lambda m, a, o: times.append(time.perf_counter() - start[id(m)]))
    return times


def decode(model, batch: int, tokens: int, times: list[float]) -> list[float]:
    """Per layer-step experts-call times of the decode steps of one greedy generate."""
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, 8))
    model.pagedexperts.reset_stats()
    times.clear()
    prefill = []

    class Mark:  # the first put() is the prompt, the second the first token: prefill done
        def put(self, value):
            prefill.append(len(times))

        def end(self):
            pass

    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, pad_token_id=0, streamer=Mark())
    return times[prefill[1]:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-resident", default="32,64")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--layers", type=int, default=4, help="MoE layers of the measured model")
    ap.add_argument("--routing-trace", default=str(TRACE))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ks, batches = [int(x) for x in args.num_resident.split(",")], [int(x) for x in args.batches.split(",")]
    model = build(args.layers, ks[0])
    routing = trace_routing.install(model, args.routing_trace)
    times = call_times(model)
    rows = []
    jobs = [("resident", None, "after")] + [("paged", k, p) for k in ks for p in PLANNERS]
    for mode, k, which in jobs:
        pager.Residency, runners.make_policy = PLANNERS[which].Residency, PLANNERS[which].make_policy
        runners.repage(model, mode=mode, num_resident=k)
        decode(model, 1, 4, times)  # warm-up
        for b in batches:
            routing.rewind()  # every job sees the same tokens: before and after must count the same hits
            layer_steps = decode(model, b, args.tokens, times)
            tot = model.pagedexperts.stats().total()
            t = tot.time_summary()
            rows.append(dict(mode=mode, K=model.pagedexperts.num_resident, batch=b, planner=which,
                             call_us=1e6 * statistics.median(layer_steps),
                             plan_us=1e6 * t["plan_s"]["p50"], readback_us=1e6 * t["sync_s"]["p50"],
                             hit_rate=tot.hit_rate, waves_per_step=tot.waves_per_step))
    print(report(rows, args))
    return 0


def report(rows: list[dict], args) -> str:
    out = [f"# Host time per decode step, {LAYERS_48} MoE layers (E=128, top-8; routing: {Path(args.routing_trace).name})",
           "", "Per MoE layer-step p50 in us, measured in situ on a {}-layer model; 48-layer ms = 48 x per layer-step.".format(args.layers),
           "bookkeeping = plan (union, wave plan, slot map) + top-k read-back (on a GPU the read-back also waits for the",
           "layer's router kernels). experts call = the whole experts step (tiny kernels included).",
           "", "| mode | planner | K | batch | hit rate | waves/step | plan us | read-back us | experts call us "
           "| 48-layer bookkeeping ms/step | 48-layer experts calls ms/step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        book = r["plan_us"] + r["readback_us"]
        out.append(f"| {r['mode']} | {r['planner']} | {r['K']} | {r['batch']} | {r['hit_rate']:.2f} | {r['waves_per_step']:.2f} | "
                   f"{r['plan_us']:.1f} | {r['readback_us']:.1f} | {r['call_us']:.0f} | "
                   f"{LAYERS_48 * book / 1e3:.2f} | {LAYERS_48 * r['call_us'] / 1e3:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
