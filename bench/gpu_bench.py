"""Real-scale GPU benchmark: a Qwen3-30B-A3B-shaped model with random bf16 weights, paged.

Run by ``bench/gpu_check.sh`` on an NVIDIA GPU machine (python 3.12, torch 2.11, triton 3.6,
transformers 5.17; nothing installed, the package used from the source tree). ``--dry-run``
runs the same code paths on CPU at tiny sizes (part of the test suite). The model has
Qwen3-30B-A3B's shapes and ``--layers`` (default 4) layers: a 48-layer store is 9.7 GB of
pinned memory and its build and compiles eat a 6-minute run. ``--phases captured`` runs the
build and the CUDA-graph decode rows only (gpu_check.sh's second phase), ``--phases rest``
everything but those. Every row records the decide path that ran (``rt.decide``: "device" is
the device-planned step, what ``--decide auto`` picks on CUDA with triton) and the torch and
triton versions.

What it measures (written as JSON and markdown under ``--out``):
1. Decode tok/s (single stream and a batch of 4) and TTFT for modes resident, offload and
   paged at each K, on a model with Qwen3-30B-A3B's published shapes (hidden 2048, 128
   experts, top-8, expert intermediate 768, 32 heads, 4 KV heads, head dim 128) but
   ``--layers`` layers (no download is possible). Random weights route near-uniformly, so the
   top-k is driven from a real routing trace (``--routing-trace``, default the shared OLMoE
   trace): hit rates and bytes paged follow real text; kernel times are real.
2. The cost of one MoE layer's decode step with m = 0, 1, 2, 4, 8 misses, against the
   link-bound floor m x expert bytes / measured pinned GB/s, by the executor the model's paged
   rows use (``rt.decide``: the device-planned ``DeviceExecutor`` on CUDA, else the host's).
3. The decode token time split into a per-token fixed part (embedding, lm_head, the generate
   loop) and a per-layer part, from single-stream decode at ``--layers`` and half as many
   layers, for resident and for paged at K = E (all hits: paging's fixed per-layer cost).
4. Decode with the host in the loop (``gpu_decode``), resident and paged at each K, batch 1
   and 4: eager tok/s, CUDA-graph tok/s with the same step run eagerly beside it (both under
   the random router: trace routing uploads ids from the host, which a graph cannot hold),
   host syncs per decode step, host time per MoE layer-step.
5. Modelled decode tok/s of the 48-layer model: fixed + 48 x (paged per-layer cost at 0 misses
   + the extra cost of the simulator's LRU misses per layer-step on real routing traces,
   replayed one request stream at a time; K scaled to the trace's E, misses to this top_k),
   every cost measured on the model's own decide path (item 2 and 3's paged rows).

The JSON is rewritten after every phase (a timeout keeps what finished). Real traces: the
files given by ``--traces``, default ``.gpu_traces/`` (an ignored folder that
``bench/gpu_check.sh --prepare`` fills and the device run carries), else ../shared/data/traces.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gpu_decode  # noqa: E402  (this folder: the decode_host phase)
from gpu_decode import row_meta, versions  # noqa: E402
from gpu_bench_summary import na, summary  # noqa: E402  (this folder: the markdown)
from pagedexperts.loading import build as build_module, runners  # noqa: E402
from pagedexperts.paging.device_executor import DeviceExecutor  # noqa: E402
from pagedexperts.paging.host_executor import HostExecutor  # noqa: E402

REAL = dict(  # Qwen3-30B-A3B config.json (published), except the layer count
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
)
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
    num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=512,
)
REAL_MOE_LAYERS = 48  # Qwen3-30B-A3B
CARRIED_TRACES = ROOT / ".gpu_traces"  # ignored; filled by gpu_check.sh --prepare


def build(args):
    from transformers import Qwen3MoeConfig

    shape = TINY if args.dry_run else REAL
    config = Qwen3MoeConfig(num_hidden_layers=args.layers, **shape)
    fill = lambda m, sites, stores, dev: runners.random_fill(m, sites, stores, dev, seed=0)  # noqa: E731
    return build_module.build_from_options(
        config, fill, num_resident=args.ks[0], device=args.device, dtype=args.dtype, mode="paged"
    )


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def decode_run(model, *, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(TTFT seconds, decode tok/s over all rows) of one greedy generate on random prompts."""
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=model.device)
    times = []

    class Clock:
        def put(self, value):
            sync(model.device)
            times.append(time.perf_counter())

        def end(self):
            pass

    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=Clock())
    times = times[1:]
    return times[0] - start, batch * (len(times) - 1) / (times[-1] - times[0])


def bench_modes(model, args) -> list[dict]:
    rows = []
    jobs = [("resident", None), ("offload", None)] + [("paged", k) for k in args.ks]
    for mode, k in jobs:
        runners.repage(model, mode=mode, num_resident=k)
        decode_run(model, batch=1, prompt_len=8, new_tokens=3)  # warm-up
        model.pagedexperts.reset_stats()
        ttft, tok_s = decode_run(model, batch=1, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
        stats = model.pagedexperts.stats().as_dict()
        counted = stats["layer_steps"] > 0  # resident counts nothing: its counters are n/a (None)
        _, tok_s4 = decode_run(model, batch=4, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
        rows.append(dict(mode=mode, K=model.pagedexperts.num_resident, **row_meta(model), ttft_s=ttft, decode_tok_s=tok_s,
                         batch4_tok_s=tok_s4, hit_rate=stats["hit_rate"] if counted else None,
                         bytes_per_token=stats["bytes_per_token"] if counted else None, waves=stats["waves"],
                         plan_us_per_layer_step=1e6 * stats["plan_s"] / max(1, stats["layer_steps"]),
                         sync_us_per_layer_step=1e6 * stats["sync_s"] / max(1, stats["layer_steps"])))
        print(f"  {mode:9s} K={rows[-1]['K']:4d}: {tok_s:8.1f} tok/s, x4 {tok_s4:8.1f} tok/s, "
              f"TTFT {1e3 * ttft:7.1f} ms, hit {na(rows[-1]['hit_rate'], '.1%')}", flush=True)
    base = rows[0]["decode_tok_s"]
    for r in rows:
        r["time_per_token_vs_resident"] = base / r["decode_tok_s"]
    return rows


def miss_costs(model, args, link_gbps: float | None) -> list[dict]:
    """Seconds of one MoE layer's decode step (T = 1) with m of its top_k experts missing, by
    the executor of the model's decide path (``layer_executor``)."""
    rt = model.pagedexperts
    site, store = rt.sites[0], rt.stores[rt.sites[0].name]
    k, e = rt.top_k, rt.num_experts
    dev = torch.device(args.device)
    runners.repage(model, mode="paged", num_resident=args.ks[0])  # rt.decide of a paged row
    pager = layer_executor(rt.decide, site.layer, store, args.ks[0], dev)
    hidden = torch.randn(1, site.module.hidden_dim, dtype=store.specs[0].dtype, device=dev)
    weights = torch.full((1, k), 1.0 / k, dtype=hidden.dtype, device=dev)
    hot = list(range(k))
    pager.step(site.module, hidden, torch.tensor([hot], device=dev), weights)  # make `hot` resident
    cold = [x for x in range(e) if x not in hot]
    out, c = [], 0
    for m in sorted({0, 1, 2, 4, min(8, k)}):
        if m > k:
            continue
        times = []
        for _ in range(args.repeats):
            chosen = hot[: k - m] + [cold[(c + j) % len(cold)] for j in range(m)]
            c += m
            ids = torch.tensor([chosen], device=dev)
            sync(dev)
            t0 = time.perf_counter()
            pager.step(site.module, hidden, ids, weights)
            sync(dev)
            times.append(time.perf_counter() - t0)
            pager.step(site.module, hidden, torch.tensor([hot], device=dev), weights)  # hot back in
        floor = m * store.expert_bytes / (link_gbps * 1e9) if link_gbps else None
        out.append(dict(misses=m, layer_step_s=statistics.median(times), link_floor_s=floor,
                        executor=type(pager).__name__, **row_meta(model)))
        print(f"  m={m}: {1e6 * out[-1]['layer_step_s']:8.1f} us/layer-step"
              + (f" (link floor {1e6 * floor:7.1f} us)" if floor is not None else ""), flush=True)
    return out


def layer_executor(decide: str, layer: int, store, num_slots: int, dev: torch.device):
    """A fresh executor of one layer on the ``decide`` path ("device": ``DeviceExecutor``, the
    Triton kernels on CUDA; "host": ``HostExecutor`` with a copy stream on CUDA)."""
    if decide == "device":
        return DeviceExecutor(layer=layer, store=store, num_slots=num_slots, device=dev, inner="grouped_mm", policy="lru",
                           backend="triton" if dev.type == "cuda" else "torch")
    return HostExecutor(layer=layer, store=store, num_slots=num_slots, device=dev, inner="grouped_mm",
                               copy_stream=torch.cuda.Stream(dev) if dev.type == "cuda" else None)


def split_token_time(token_s: dict[int, float]) -> tuple[float, float]:
    """{layers: seconds per decode token} at two layer counts -> (fixed seconds per token,
    seconds per layer), from token_s(L) = fixed + L x per_layer (a line through two points).
    Timing noise can tilt the line past either axis: the fixed part is clamped to [0, token
    time at the larger L] and the per-layer part recomputed through that point."""
    (l1, t1), (l2, t2) = sorted(token_s.items())
    fixed = t2 - l2 * (t2 - t1) / (l2 - l1)
    fixed = min(max(fixed, 0.0), t2)
    return fixed, (t2 - fixed) / l2


def modelled_token_s(*, fixed_s: float, per_layer_s: float, extra_miss_s: float, layers: int) -> float:
    """Seconds per decode token of a ``layers``-layer model: the per-token fixed cost once, and
    per layer the paged layer cost at 0 misses plus the extra cost of its misses."""
    return fixed_s + layers * (per_layer_s + extra_miss_s)


def miss_extra_s(costs: list[dict], m: float) -> float:
    """Extra seconds of a layer-step with m misses over one with 0 (linear interpolation; a
    negative value, timing noise, counts as 0)."""
    import numpy as np

    base = costs[0]["layer_step_s"]
    extra = np.interp(m, [c["misses"] for c in costs], [c["layer_step_s"] - base for c in costs])
    return max(0.0, float(extra))


def layer_scaling(model, args) -> dict:
    """Single-stream seconds per decode token at ``--layers`` and half as many, for resident
    and for paged at K = E; their (fixed, per-layer) split."""
    cfg, rt = model.config, model.pagedexperts
    full = cfg.num_hidden_layers
    out = {}
    for mode, k in (("resident", None), ("paged", rt.num_experts)):
        runners.repage(model, mode=mode, num_resident=k)
        token_s = {}
        for layers in (full, max(1, full // 2)):
            cfg.num_hidden_layers = layers  # the decoder runs self.layers[:num_hidden_layers]
            try:
                decode_run(model, batch=1, prompt_len=8, new_tokens=3)  # warm-up (pages all in)
                _, tok_s = decode_run(model, batch=1, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
            finally:
                cfg.num_hidden_layers = full
            token_s[layers] = 1.0 / tok_s
        fixed, per_layer = split_token_time(token_s)
        out[mode] = dict(token_s=token_s, fixed_s=fixed, per_layer_s=per_layer, **row_meta(model))
        print(f"  {mode:9s}: fixed {1e3 * fixed:.2f} ms/token, {1e6 * per_layer:.1f} us/layer", flush=True)
    return out


def modelled(costs: list[dict], scaling: dict, ks: list[int], num_experts: int,
             top_k: int, traces: list[Path]) -> list[dict]:
    """Modelled tok/s of the 48-layer model from each trace's LRU decode misses per layer-step."""
    from pagedexperts.analysis import simulate
    from pagedexperts.analysis.trace import load_trace

    fixed_s, paged_layer_s = scaling["paged"]["fixed_s"], scaling["paged"]["per_layer_s"]
    rows = []
    for path in traces:
        tr = load_trace(path)
        steps = simulate.batched_steps(simulate.request_streams(tr), batch_size=1)  # single streams
        for k in ks:
            k_trace = max(tr.meta.top_k, round(k / num_experts * tr.meta.num_experts))
            _, decode = simulate.replay(steps, num_experts=tr.meta.num_experts, num_resident=k_trace, policy="lru")
            tot = decode.total()
            m_bar = tot.misses / max(1, tot.steps) * top_k / tr.meta.top_k  # scaled to this top_k
            token_s = modelled_token_s(fixed_s=fixed_s, per_layer_s=paged_layer_s,
                                       extra_miss_s=miss_extra_s(costs, m_bar), layers=REAL_MOE_LAYERS)
            rows.append(dict(trace=path.name, K=k, K_trace=k_trace, hit_rate=tot.hit_rate, decide=scaling["paged"]["decide"],
                             misses_per_layer_step=m_bar, modelled_tok_s_48_layers=1.0 / token_s))
    return rows


def default_traces() -> list[Path]:
    """Carried traces if present, else the shared data folder (this machine only)."""
    for folder in (CARRIED_TRACES, ROOT.parent / "shared" / "data" / "traces"):
        found = sorted(folder.glob("*.jsonl")) + sorted(folder.glob("*.npz"))
        if found:
            return found
    return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (same code paths)")
    p.add_argument("--out", default="results/gpu", help="output folder")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--phases", choices=["all", "captured", "rest"], default="all",
                   help="captured: build + the CUDA-graph decode rows; rest: all but those (gpu_check.sh)")
    p.add_argument("--num-resident", default="40,92")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--traces", nargs="*", default=None,
                   help="routing traces (default: .gpu_traces/*, else ../shared/data/traces/*)")
    p.add_argument("--routing-trace", default=None, metavar="PATH",
                   help="drive the model's top-k from this trace (pagedexperts.analysis.trace_routing) so paging sees the "
                   "reuse of real text; default: the shared OLMoE trace when present (not in --dry-run); 'none': "
                   "the random router's own choice")
    args = p.parse_args(argv)
    args.ks = [int(x) for x in args.num_resident.split(",")]
    if args.dry_run:
        args.device, args.dtype, args.layers = "cpu", "float32", min(args.layers, 2)
        args.ks = [6, 10]
        args.new_tokens, args.prompt_len, args.repeats = min(args.new_tokens, 4), 8, 3
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run", file=sys.stderr)
            return 2
        args.device, args.dtype = "cuda", "bfloat16"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from pagedexperts.analysis import linkbench

    traces = [Path(t) for t in args.traces] if args.traces is not None else default_traces()
    if not traces:
        print(f"WARNING: no routing traces (looked in {CARRIED_TRACES}); the modelled table "
              "will be empty; run bench/gpu_check.sh --prepare first", file=sys.stderr, flush=True)
    result = dict(date=time.strftime("%Y-%m-%d"), device=linkbench.accelerator_name() or "cpu (dry run)",
                  **versions(), layers=args.layers, phases=args.phases, phases_done=[], modes=[], miss_costs=[],
                  layer_scaling={}, modelled=[], decode_host=[], captured_decode=[], link_gbps_pinned_expert=None)
    name = "gpu_bench" if args.phases == "all" else f"gpu_bench_{args.phases}"

    def done(phase: str, **values) -> None:  # rewrite the JSON after every phase
        result.update(values)
        result["phases_done"].append(phase)
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
        print(f"[phase {phase} done, {time.perf_counter() - t0:.1f} s]", flush=True)

    t0 = time.perf_counter()
    model = build(args)
    routing = use_routing_trace(model, args)
    rt = model.pagedexperts
    done("build", routing=routing, expert_bytes=rt.expert_bytes, build_s=time.perf_counter() - t0)
    if args.phases == "captured":
        done("captured_decode", captured_decode=gpu_decode.captured_decode(model, args, repage=runners.repage,
                                                                           decode_run=decode_run))
    else:
        run_rest(model, args, traces, done)
    (out / ("summary.md" if args.phases == "all" else f"{name}.md")).write_text(summary(result))
    print(summary(result))
    return 0


def run_rest(model, args, traces: list[Path], done) -> None:
    """The phases after the build, but for ``--phases captured``'s (which ``all`` runs inside
    decode_host)."""
    from pagedexperts.analysis import linkbench

    rt = model.pagedexperts
    link = None
    if not args.dry_run:
        res = linkbench.measure(sizes=[("expert", rt.expert_bytes), ("64 MB", 64_000_000)], repeats=10)
        link = next(r.gbps for r in res if r.label == "expert" and r.memory == "pinned")
    done("link", link_gbps_pinned_expert=link)
    done("modes", modes=bench_modes(model, args))
    done("decode_host", decode_host=gpu_decode.decode_host(model, args, repage=runners.repage, decode_run=decode_run,
                                                           graphs=args.phases == "all"))
    costs = miss_costs(model, args, link)
    done("miss_costs", miss_costs=costs)
    scaling = layer_scaling(model, args)
    done("layer_scaling", layer_scaling=scaling)
    done("modelled", modelled=modelled(costs, scaling, args.ks, rt.num_experts, rt.top_k, traces))


def use_routing_trace(model, args) -> str:
    """Install trace-driven routing (``--routing-trace``); returns what routes the model."""
    path = args.routing_trace
    if path is None and not args.dry_run:
        found = [t for t in default_traces() if t.name == "olmoe_1b7b_layer0_gsm8k.jsonl"]
        path = str(found[0]) if found else "none"
    if not path or path == "none":
        return "router (random weights)"
    from pagedexperts.analysis import trace_routing

    args.routing_driver = trace_routing.install(model, path)  # gpu_decode pauses it for the graphs rows
    print(f"routing driven by the trace {path}", flush=True)
    return f"trace {Path(path).name}"


if __name__ == "__main__":
    sys.exit(main())
