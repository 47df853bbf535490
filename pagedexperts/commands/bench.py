"""``pagedexperts bench``: paged vs plain transformers, resident, offload and cpu-experts on the same model.

Owns the command's flags, their checks, and its outputs (bench.md, bench.json, bench.png,
command.txt); the measurement is ``pagedexperts.tools.bench``'s.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from pagedexperts.commands import COMMANDS
from pagedexperts.commands.common import (add_beyond_k_arguments, add_decide_argument, add_threads_argument,
                                         resolve_threads)
from pagedexperts.models.config import RUN_DTYPE_BYTES
from pagedexperts.paging.steps.table import INNER_IMPLEMENTATIONS
from pagedexperts.residency.policies import DEFAULT_POLICY, POLICIES

logger = logging.getLogger(__name__)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} {text!r}: want comma-separated integers, e.g. 8,32") from None


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help=COMMANDS["bench"],
        description="Per mode: TTFT p50 on short and long prompts, single-stream decode tok/s, wall and "
        "CPU time per decode token, each as a ratio to plain (transformers' own model, nothing attached), "
        "total tok/s at each concurrency (c prompts decoded as one batch), decode hit rate, bytes paged per "
        "token, waves per step, host planning time. Modes run interleaved in --rounds rounds (round r rotates "
        "the order by r), each warmed up untimed after its switch; numbers are medians over rounds, times "
        "and ratios with their [min-max] spread, ratios taken per round against the same round's plain run. "
        "The checkpoint is loaded once for the paged model (each mode and K re-attaches runners over the same "
        "host stores) and once more as the plain model. "
        "Writes bench.md, bench.json, bench.png and command.txt under --results-dir.",
    )
    g = p.add_argument_group("model")
    g.add_argument("--model-path", default=None, help="model directory (default: the bundled model)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N], every mode (default cpu)")
    g.add_argument("--dtype", default=None, choices=list(RUN_DTYPE_BYTES), help="default: the checkpoint's dtype")
    g.add_argument("--experts-implementation", default="grouped_mm", choices=list(INNER_IMPLEMENTATIONS),
                   help="experts kernel in every mode, plain's transformers model too (fused: grouped_mm "
                   "there); default grouped_mm, see generate --help")
    g.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES), help=f"eviction policy (default {DEFAULT_POLICY})")
    add_decide_argument(g)
    add_beyond_k_arguments(g)
    m = p.add_argument_group("modes")
    m.add_argument("--mode", default="plain,resident,paged,offload,cpu-experts",
                   help="comma-separated modes (default: all five, plain,resident,paged,offload,cpu-experts); "
                   "ratios need plain")
    m.add_argument("--num-resident", default="", metavar="K[,K...]", help="K values for paged rows (default: 2k, 4k, E/2)")
    m.add_argument("--cpu-expert-layers", type=int, default=None, metavar="N",
                   help="MoE layers computed on the CPU in cpu-experts mode, 1 to the model's MoE layers (default: half)")
    w = p.add_argument_group("workload")
    w.add_argument("--prompts", default=None, help="JSON lines (prompt / turns / question) or ShareGPT JSON (default: built-in prompts)")
    w.add_argument("--num-prompts", type=int, default=None, help="prompts of the workload, N >= 1: the first N of --prompts, "
                   "or of the built-in ones (default: all of them); more than there are is refused")
    w.add_argument("--output-tokens", type=int, default=32,
                   help="tokens generated per prompt, >= 2 to time decode (default 32)")
    w.add_argument("--long-prompt-tokens", type=int, default=256,
                   help="tokens of each long prompt (half as many as the prompts, at least 1), "
                   "timed for TTFT long (default 256)")
    w.add_argument("--concurrency", default="1,4", help="comma-separated concurrency levels (default 1,4)")
    w.add_argument("--rounds", type=int, default=5, help="rounds; each runs every mode once (default 5)")
    add_threads_argument(w)
    p.add_argument("--results-dir", default=None,
                   help="directory for bench.md, bench.json, bench.png, command.txt (default: results/bench-<time>)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pagedexperts.tools import bench
    from pagedexperts.tools.bench import BenchConfig
    from pagedexperts.tools.prompts import read_prompts
    from pagedexperts.tools.check import DEFAULT_PROMPTS

    modes = tuple(x for x in args.mode.split(",") if x)
    bad = [m for m in modes if m not in bench.BENCH_MODES]
    if bad:
        raise ValueError(f"unknown --mode {bad}; choose from {list(bench.BENCH_MODES)}")
    repeated = sorted({m for m in modes if modes.count(m) > 1})
    if repeated:
        raise ValueError(f"--mode names {repeated} more than once; give each mode once (paged takes several K "
                         "through --num-resident)")
    if args.output_tokens < 2:
        raise ValueError(f"--output-tokens must be >= 2 to measure decode, got {args.output_tokens}")
    threads, how = resolve_threads(args.threads)
    ks, concurrency = _checked_workload(args, modes)
    try:
        prompts = read_prompts(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
    except ValueError as exc:
        raise ValueError(f"--prompts {exc}") from None
    if args.num_prompts is not None and args.num_prompts > len(prompts):
        where = f"--prompts {args.prompts}" if args.prompts else "the built-in prompts (--prompts FILE for more)"
        raise ValueError(f"--num-prompts {args.num_prompts} exceeds the {len(prompts)} prompts of {where}")
    prompts = prompts[: args.num_prompts]
    out = Path(args.results_dir or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():  # a FileExistsError traceback after the whole benchmark
        raise ValueError(f"--results-dir {out} is a file; give a directory (made if missing)")
    cfg = BenchConfig(
        model_path=args.model_path, modes=modes, num_resident=ks, cpu_expert_layers=args.cpu_expert_layers or 0,
        output_tokens=args.output_tokens, concurrency=concurrency, num_prompts=len(prompts),
        long_prompt_tokens=args.long_prompt_tokens, rounds=args.rounds, threads=threads,
        device=args.device, dtype=args.dtype,
        # auto is grouped_mm here: the baselines (resident, offload, cpu-experts) run transformers' kernels
        experts_implementation="grouped_mm" if args.experts_implementation == "auto" else args.experts_implementation,
        policy=args.policy, decide=args.decide,
        beyond_k=args.beyond_k, admit_per_step=args.admit_per_step,
    )
    print(f"threads: {threads} ({how})", file=sys.stderr)
    report = bench.run_bench(cfg, prompts)
    command = "pagedexperts " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_results(report, cfg, out, command)
    print(terminal_table(report, cfg.concurrency))
    print(f"\nthe full table (TTFT long, wall and CPU ms per token, every concurrency, waves, planning time): "
          f"{out}/bench.md; per-round samples: {out}/bench.json", file=sys.stderr)
    return 0


def _checked_workload(args, modes: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(K values, concurrency levels), every workload flag checked against the model before any
    work: K in [top_k, E], --cpu-expert-layers in [1, MoE layers], counts >= 1 (--threads: ``resolve_threads``).

    Raises:
        ValueError / FileNotFoundError: a bad value (names the value, the limit and the flag).
    """
    from pagedexperts.loading.loader import read_checkpoint_config
    from pagedexperts.models.config import moe_layer_indices, num_routed_experts
    from pagedexperts.residency.planner import check_num_resident

    ks, concurrency = _ints(args.num_resident, "--num-resident"), _ints(args.concurrency, "--concurrency")
    for flag, values in (("--concurrency", concurrency), ("--num-prompts", [] if args.num_prompts is None else [args.num_prompts]),
                         ("--long-prompt-tokens", [args.long_prompt_tokens]), ("--rounds", [args.rounds])):
        for v in values:
            if v < 1:
                raise ValueError(f"{flag} {v} must be >= 1")
    _, c, _ = read_checkpoint_config(args.model_path)
    k, e = int(c.num_experts_per_tok), num_routed_experts(c)
    if "paged" in modes and not ks:
        ks = tuple(sorted({min(e, 2 * k), min(e, 4 * k), max(k, e // 2)}))
    for x in ks:
        check_num_resident(x, num_experts=e, min_slots=k)
    num_moe = len(moe_layer_indices(c))  # the loader's limit: its MoE sites follow the family rule
    layers = args.cpu_expert_layers
    if "cpu-experts" in modes and layers is not None and not 1 <= layers <= num_moe:
        raise ValueError(f"--cpu-expert-layers {layers} outside [1, {num_moe}] (the model's MoE layers; "
                         "leave it out for half)")
    return ks, concurrency


def _na(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def markdown_table(report, concurrency) -> str:
    """A ``tools.bench.BenchRun`` as a markdown table (one row per mode / K): medians over rounds, spreads
    as [min-max]; "n/a" where a mode counts nothing (plain, resident) or there is no plain row."""
    head = ["mode", "K", "TTFT short p50 ms", "TTFT long p50 ms", "decode tok/s (wall)",
            "wall ms/token", "CPU ms/token", "wall time/token vs plain", "CPU time/token vs plain"]
    head += [f"total tok/s @{c}" for c in concurrency]
    head += ["hit rate", "MB paged/token", "waves/step", "plan us/layer-step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report.results:
        ratios = [x.text(unit="x") if x else "n/a" for x in (r.ratio_wall_vs_plain, r.ratio_cpu_vs_plain)]
        cells = [r.mode, str(r.num_resident), f"{1e3 * r.ttft_short_p50_s:.1f}", f"{1e3 * r.ttft_long_p50_s:.1f}",
                 f"{r.decode_tok_s:.1f}", r.decode_wall_s_per_token.text(1e3), r.decode_cpu_s_per_token.text(1e3), *ratios]
        cells += [f"{r.total_tok_s.get(c, 0):.1f}" for c in concurrency]
        mb = None if r.bytes_per_token is None else r.bytes_per_token / 1e6
        cells += [_na(r.hit_rate, ".1%"), _na(mb, ".3f"), _na(r.waves_per_step, ".2f"),
                  _na(r.plan_us_per_layer_step, ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\n{len(report.order)} rounds, modes rotated per round; medians [min-max over rounds]; "
                 "ratios per round against that round's plain run")
    return "\n".join(lines)


def terminal_table(report, concurrency) -> str:
    """The few columns of ``markdown_table`` one reads first, aligned for a terminal (under 100
    characters for the bench's labels): decode tok/s, CPU time per token vs plain (median
    [min-max]), TTFT of the short prompts, total tok/s at the highest concurrency, hit rate and
    MB paged per token; "n/a" as in the markdown table."""
    top = max(concurrency)
    head = ["mode", "decode tok/s", "CPU/token vs plain", "TTFT ms", f"tok/s @{top}", "hit rate", "MB/token"]
    rows = [head]
    for r in report.results:
        mb = None if r.bytes_per_token is None else r.bytes_per_token / 1e6
        rows.append([r.label, f"{r.decode_tok_s:.1f}", r.ratio_cpu_vs_plain.text(unit="x") if r.ratio_cpu_vs_plain else "n/a",
                     f"{1e3 * r.ttft_short_p50_s:.0f}", f"{r.total_tok_s.get(top, 0):.1f}", _na(r.hit_rate, ".1%"),
                     _na(mb, ".3f")])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    return "\n".join(lines + [f"{len(report.order)} rounds, modes rotated per round; medians [min-max over rounds]"])


def write_results(report, cfg, out_dir: Path, command: str) -> Path:
    """bench.md, bench.json (config, rows with their per-round samples, the rounds' order),
    bench.png (if matplotlib is installed) and command.txt."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "command.txt").write_text(command + "\n")
    (out_dir / "bench.md").write_text(f"```\n{command}\n```\n\n{markdown_table(report, cfg.concurrency)}\n")
    payload = {"config": asdict(cfg), "results": [asdict(r) for r in report.results], "order": report.order,
               "command": command}
    (out_dir / "bench.json").write_text(json.dumps(payload, indent=2, default=str))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no bench.png (pip install 'pagedexperts[plots]')")
        return out_dir
    rows = report.results
    speeds = [[1.0 / r.decode_wall_s_per_token.high, r.decode_tok_s, 1.0 / r.decode_wall_s_per_token.low] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.3), 4))
    ax.bar([r.label for r in rows], [m for _, m, _ in speeds], color="tab:blue",
           yerr=[[m - lo for lo, m, _ in speeds], [hi - m for _, m, hi in speeds]], capsize=4)
    ax.set_ylabel("single-stream decode tok/s (median, min-max)")
    ax.set_title("pagedexperts bench")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=100)
    plt.close(fig)
    return out_dir
