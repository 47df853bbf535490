"""``pagedexperts simulate``: replay a routing trace for several K and policies.

Owns: the flags, the choice of replays (as recorded, or B streams interleaved), and the tables,
JSON and PNG plots of their results. The replay itself is ``pagedexperts.analysis.simulate``.
"""

from __future__ import annotations

import json
import os
import sys

from pagedexperts.commands import COMMANDS
from pagedexperts.commands.flag_lists import comma_ints, comma_items
from pagedexperts.extras import require
from pagedexperts.analysis import simulate as sim
from pagedexperts.residency.policies import DEFAULT_POLICY
from pagedexperts.analysis.trace import TRACE_SUFFIXES, load_trace
from pagedexperts.loading.bundled import bundled_traces_path

BUNDLED_TRACES = "bundled"  # --trace bundled: the bundled model's own routing traces


def add_parser(subparsers) -> None:
    """Register the subcommand, its flags and ``func`` on the CLI's ``subparsers``."""
    p = subparsers.add_parser(
        "simulate",
        help=COMMANDS["simulate"],
        description="Replay a routing trace (.npz from generate --record-trace, a JSON-lines trace, or a "
        "directory of one model's traces) through the "
        "runtime's own residency classes: hit rate, misses and bytes per token, waves and union per "
        "step; Belady's optimal policy as the bound; uniform-random routing as the reference.",
    )
    p.add_argument("--trace", required=True,
                   help="a trace file (.npz from generate --record-trace, or .jsonl), a directory of traces of one "
                   "model (every *.npz and *.jsonl in it replayed as one set, each file's requests their own "
                   "streams), or bundled: the bundled model's own traces")
    what = p.add_argument_group("what to replay")
    what.add_argument("--num-resident", help="comma-separated K values, each in [top_k, E] as the runtime takes them "
                      "(default: 2k, 4k, E/2)")
    default = ",".join(dict.fromkeys(["lru", DEFAULT_POLICY, "belady"]))
    what.add_argument("--policy", default=default,
                      help=f"comma-separated policies from {sim.policy_names()} (default {default}: LRU as the "
                      f"baseline, {DEFAULT_POLICY} (the runtime's --policy default) and Belady's optimal bound)")
    what.add_argument("--batch-sizes", help="comma-separated B: interleave B request streams per step "
                      "(default: replay the steps as recorded)")
    what.add_argument("--host-rows", type=int, metavar="R",
                      help="two-level replay: R host rows per layer under the K device slots (the disk "
                      "tier); reports host hit rate and disk reads per token")
    what.add_argument("--no-uniform", action="store_true", help="skip the uniform-random routing reference")
    what.add_argument("--seed", type=int, default=0, help="seed of the uniform routing (default 0)")
    model = p.add_argument_group("model check and time model")
    model.add_argument("--experts", type=int, help="E of the model: the trace must match")
    model.add_argument("--top-k", type=int, help="top_k of the model: the trace must match")
    model.add_argument("--expert-mb", type=float, default=0.0,
                       help="MB of one expert (1e6 B), for the MB paged per token column (default 0: no such column)")
    model.add_argument("--link-gbps", type=float, help="host-to-device GB/s, for modelled decode tok/s (with --expert-mb and --compute-ms-per-layer)")
    model.add_argument("--compute-ms-per-layer", type=float, help="compute ms per MoE layer per step, for tok/s")
    model.add_argument("--model-layers", type=int, help="MoE layers of the model the recorded layers stand for")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print results as JSON")
    out.add_argument("--per-layer", action="store_true", help="also print per-layer rows")
    out.add_argument("--plot-dir", help="write hit_rate_vs_k.png and union_vs_batch.png here (needs matplotlib)")
    p.set_defaults(func=run_simulate)


def run_simulate(args) -> int:
    """Load the trace, replay every (B, routing, policy, K), print tables or --json, plot."""
    if args.plot_dir:
        require("plots", "--plot-dir")  # before the replay, not after it
        if os.path.exists(args.plot_dir) and not os.path.isdir(args.plot_dir):  # a traceback after the replay
            raise ValueError(f"--plot-dir {args.plot_dir} is a file; give a directory (made if missing)")
    if (args.experts is None) != (args.top_k is None):
        raise ValueError("pass both --experts and --top-k to check the trace against a model")
    _check_time_model(args)
    given_ks = None if args.num_resident is None else comma_ints(args.num_resident, "--num-resident", example="8,32")
    policies = list(comma_items(args.policy, "--policy", example="lru,belady", choices=tuple(sim.policy_names())))
    batch_sizes = [None] if args.batch_sizes is None else list(comma_ints(args.batch_sizes, "--batch-sizes",
                                                                          example="1,4"))
    if args.trace == BUNDLED_TRACES:
        args.trace = str(bundled_traces_path())
    if not os.path.exists(args.trace):
        raise ValueError(f"--trace {args.trace}: no such file or directory")
    trace = load_trace(args.trace, num_experts=args.experts, top_k=args.top_k)
    e, k = trace.meta.num_experts, trace.meta.top_k
    ks = list(given_ks) if given_ks is not None else sim.default_num_resident(num_experts=e, top_k=k)
    for x in ks:
        sim.check_num_resident(x, num_experts=e, top_k=k)  # the runtime's bound: K >= top_k
    streams = sim.request_streams(trace, min_streams=max(batch_sizes)) if args.batch_sizes is not None else None
    grid = dict(num_experts=e, top_k=k, num_resident=ks, policies=policies, uniform=not args.no_uniform,
                seed=args.seed, expert_bytes=round(args.expert_mb * 1e6), host_rows=args.host_rows)
    results = []
    for b in batch_sizes:
        steps = sim.recorded_steps(trace) if b is None else sim.batched_steps(streams, batch_size=b)
        results += sim.run_grid(steps, batch_size=b, **grid)
    rows = [_row(r, args, k) for r in results]
    if args.json:
        print(json.dumps({"trace": args.trace, "meta": _meta(trace), "results": rows}, indent=2))
    else:
        print(_header(trace, args))
        print(format_hit_table(rows, expert_mb=args.expert_mb))
        if args.batch_sizes:
            print()
            print(format_batch_table(rows, top_k=k))
        if args.per_layer:
            print()
            print(format_layer_table(rows))
    if args.plot_dir:
        paths = plot(rows, plot_dir=args.plot_dir, top_k=k)
        print("plots written: " + ", ".join(paths), file=sys.stderr)  # stderr: --json stays one document
    return 0


def _check_time_model(args) -> None:
    """--expert-mb, --link-gbps, --compute-ms-per-layer, --model-layers: in range, and the
    tok/s model's flags given together (none is silently ignored). Raises ValueError."""
    if args.expert_mb < 0:
        raise ValueError(f"--expert-mb {args.expert_mb} must be >= 0")
    if args.link_gbps is not None and args.link_gbps <= 0:
        raise ValueError(f"--link-gbps {args.link_gbps} must be > 0")
    if args.compute_ms_per_layer is not None and args.compute_ms_per_layer < 0:
        raise ValueError(f"--compute-ms-per-layer {args.compute_ms_per_layer} must be >= 0")
    if args.model_layers is not None and args.model_layers < 1:
        raise ValueError(f"--model-layers {args.model_layers} must be >= 1")
    if args.link_gbps is not None and args.compute_ms_per_layer is None:
        raise ValueError("--link-gbps needs --compute-ms-per-layer for the modelled decode tok/s")
    if args.link_gbps is not None and not args.expert_mb:
        raise ValueError("--link-gbps needs --expert-mb (bytes paged per miss) for the modelled decode tok/s")
    if args.compute_ms_per_layer is not None and args.link_gbps is None:
        raise ValueError("--compute-ms-per-layer needs --link-gbps for the modelled decode tok/s")
    if args.model_layers is not None and args.link_gbps is None:
        raise ValueError("--model-layers needs --link-gbps and --compute-ms-per-layer (it scales the modelled tok/s)")


def _meta(trace) -> dict:
    m = trace.meta
    return dict(model_id=m.model_id, num_experts=m.num_experts, top_k=m.top_k, layers=list(m.layers),
                steps=len(trace), tokens=trace.num_tokens, notes=list(m.notes))


def _header(trace, args) -> str:
    m = trace.meta
    what = f"trace {os.path.basename(args.trace)}"
    if os.path.isdir(args.trace):
        what = f"{sum(f.endswith(TRACE_SUFFIXES) for f in os.listdir(args.trace))} traces in {args.trace}"
    return (f"{what}: {m.model_id or '?'}, E={m.num_experts}, top_k={m.top_k}, "
            f"layers {list(m.layers)}, {len(trace)} steps, {trace.num_tokens} tokens")


def _row(r: sim.SimResult, args, top_k: int) -> dict:
    d = r.stats.as_dict()
    tot = r.stats.total()
    row = dict(routing=r.routing, policy=r.policy, num_resident=r.num_resident, batch_size=r.batch_size,
               steps=max(s.steps for s in r.stats.layers.values()), tokens=d["tokens"],
               hit_rate=d["hit_rate"], misses_per_token=d["misses_per_token"],
               bytes_per_token=d["bytes_per_token"], union_mean=d["union_mean"], union_max=d["union_max"],
               waves_per_step=tot.waves_per_step,
               single_wave_fraction=1 - tot.multi_wave_steps / tot.steps if tot.steps else 0.0,
               batch_cap=r.num_resident // top_k, layers=d["layers"])
    if args.host_rows is not None:
        row.update(host_rows=args.host_rows, host_hit_rate=d["host_hit_rate"],
                   disk_reads_per_token=d["disk_reads"] / d["tokens"] if d["tokens"] else 0.0,
                   disk_bytes_per_token=d["disk_bytes_per_token"])
    if args.link_gbps is not None:
        row["modelled_decode_tok_s"] = sim.modelled_decode_tok_s(
            r.decode, link_gbps=args.link_gbps, compute_ms_per_layer=args.compute_ms_per_layer,
            model_layers=args.model_layers)
    return row


def format_hit_table(rows: list[dict], *, expert_mb: float = 0.0) -> str:
    """Hit rate per (B, routing, policy, K): one line each; B '-' = steps as recorded."""
    cols = ["B", "routing", "policy", "K", "steps", "tokens", "hit%", "miss/tok"]
    cols += ["MB/tok"] if expert_mb else []
    cols += ["tok/s"] if rows and "modelled_decode_tok_s" in rows[0] else []
    two_level = bool(rows) and "host_rows" in rows[0]
    cols += ["R", "host%", "disk/tok"] + (["diskMB/t"] if expert_mb else []) if two_level else []
    lines = [" ".join(f"{c:>8}" for c in cols)]
    for r in rows:
        vals = [r["batch_size"] or "-", r["routing"], r["policy"], r["num_resident"], r["steps"], r["tokens"],
                f"{100 * r['hit_rate']:.1f}", f"{r['misses_per_token']:.3f}"]
        vals += [f"{r['bytes_per_token'] / 1e6:.2f}"] if expert_mb else []
        vals += [f"{r['modelled_decode_tok_s']:.1f}"] if "modelled_decode_tok_s" in r else []
        if two_level:
            vals += [r["host_rows"], f"{100 * r['host_hit_rate']:.1f}", f"{r['disk_reads_per_token']:.3f}"]
            vals += [f"{r['disk_bytes_per_token'] / 1e6:.2f}"] if expert_mb else []
        lines.append(" ".join(f"{v:>8}" for v in vals))
    return "\n".join(lines)


def format_batch_table(rows: list[dict], *, top_k: int) -> str:
    """Union size and waves vs B (trace routing; policy-independent), per K, next to K // top_k."""
    seen, lines = set(), [" ".join(f"{c:>9}" for c in ["B", "B*k", "union", "max", "K", "K//k", "1-wave%", "waves"])]
    for r in rows:
        key = (r["batch_size"], r["num_resident"])
        if r["routing"] != "trace" or key in seen:
            continue
        seen.add(key)
        vals = [r["batch_size"], r["batch_size"] * top_k, f"{r['union_mean']:.1f}", r["union_max"], r["num_resident"],
                r["batch_cap"], f"{100 * r['single_wave_fraction']:.1f}", f"{r['waves_per_step']:.2f}"]
        lines.append(" ".join(f"{v:>9}" for v in vals))
    return "\n".join(lines)


def format_layer_table(rows: list[dict]) -> str:
    """Per-layer hit rate and union of every replay."""
    lines = [" ".join(f"{c:>8}" for c in ["B", "routing", "policy", "K", "layer", "hit%", "union"])]
    for r in rows:
        for layer, s in r["layers"].items():
            vals = [r["batch_size"] or "-", r["routing"], r["policy"], r["num_resident"], layer,
                    f"{100 * s['hit_rate']:.1f}", f"{s['union_mean']:.1f}"]
            lines.append(" ".join(f"{v:>8}" for v in vals))
    return "\n".join(lines)


def plot(rows: list[dict], *, plot_dir: str, top_k: int) -> list[str]:
    """Write hit_rate_vs_k.png (first B replayed) and, with batches, union_vs_batch.png."""
    require("plots", "--plot-dir")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    first_b = rows[0]["batch_size"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for routing, policy in sorted({(r["routing"], r["policy"]) for r in rows}):
        pts = sorted((r["num_resident"], r["hit_rate"]) for r in rows
                     if (r["routing"], r["policy"], r["batch_size"]) == (routing, policy, first_b))
        ax.plot(*zip(*pts), marker="o", linestyle="--" if routing == "uniform" else "-", label=f"{policy} ({routing})")
    ax.set(xlabel="K resident experts per layer", ylabel="hit rate", ylim=(0, 1),
           title=f"hit rate vs K (B={first_b or 'as recorded'})")
    ax.legend()
    paths = [os.path.join(plot_dir, "hit_rate_vs_k.png")]
    fig.savefig(paths[0], dpi=120, bbox_inches="tight")
    plt.close(fig)
    batch = sorted({(r["batch_size"], r["union_mean"], r["union_max"]) for r in rows
                    if r["routing"] == "trace" and r["batch_size"]})
    if batch:
        fig, ax = plt.subplots(figsize=(6, 4))
        bs = [b for b, _, _ in batch]
        ax.plot(bs, [u for _, u, _ in batch], marker="o", label="union mean")
        ax.plot(bs, [m for _, _, m in batch], marker="^", label="union max")
        ax.plot(bs, [b * top_k for b in bs], linestyle=":", color="gray", label="B x top_k")
        for kk in sorted({r["num_resident"] for r in rows}):
            ax.axhline(kk, linewidth=0.8, color="black", alpha=0.4)
            ax.text(bs[0], kk, f" K={kk}", va="bottom", fontsize=8)
        ax.set(xlabel="batch size B (requests per step)", ylabel="distinct experts per step and layer",
               title="union size vs batch")
        ax.legend()
        paths.append(os.path.join(plot_dir, "union_vs_batch.png"))
        fig.savefig(paths[1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths
