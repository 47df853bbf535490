"""``pagedexperts bench``: paged vs plain transformers, resident, offload and cpu-experts on the same model.

Owns the command's flags and their checks that need no checkpoint; the workload, the measurement
and the outputs (bench.md, bench.json, bench.png, command.txt) are ``pagedexperts.tools.bench``'s.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from pagedexperts.commands import COMMANDS
from pagedexperts.commands.common import (add_beyond_k_arguments, add_decide_argument, add_threads_argument,
                                         resolve_threads)
from pagedexperts.commands.flag_lists import comma_ints, comma_items
from pagedexperts.models.config import RUN_DTYPE_BYTES
from pagedexperts.paging.steps.table import INNER_IMPLEMENTATIONS
from pagedexperts.residency.policies import DEFAULT_POLICY, POLICIES


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
    m.add_argument("--num-resident", default=None, metavar="K[,K...]", help="K values for paged rows (default: 2k, 4k, E/2)")
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
    """Check the flags that need no checkpoint, then ``tools.bench.bench_checkpoint``; its exit code."""
    from pagedexperts.tools.bench import BENCH_MODES, BenchConfig, bench_checkpoint

    modes = comma_items(args.mode, "--mode", example="plain,paged", choices=tuple(BENCH_MODES),
                        repeat_hint=" (paged takes several K through --num-resident)")
    if args.output_tokens < 2:
        raise ValueError(f"--output-tokens must be >= 2 to measure decode, got {args.output_tokens}")
    threads, how = resolve_threads(args.threads)
    ks = () if args.num_resident is None else comma_ints(args.num_resident, "--num-resident")
    concurrency = comma_ints(args.concurrency, "--concurrency", example="1,4")
    for flag, values in (("--concurrency", concurrency), ("--num-prompts", [] if args.num_prompts is None else [args.num_prompts]),
                         ("--long-prompt-tokens", [args.long_prompt_tokens]), ("--rounds", [args.rounds])):
        for v in values:
            if v < 1:
                raise ValueError(f"{flag} {v} must be >= 1")
    cfg = BenchConfig(
        model_path=args.model_path, modes=modes, num_resident=ks, cpu_expert_layers=args.cpu_expert_layers or 0,
        output_tokens=args.output_tokens, concurrency=concurrency,
        long_prompt_tokens=args.long_prompt_tokens, rounds=args.rounds, threads=threads,
        device=args.device, dtype=args.dtype,
        # auto is grouped_mm here: the baselines (resident, offload, cpu-experts) run transformers' kernels
        experts_implementation="grouped_mm" if args.experts_implementation == "auto" else args.experts_implementation,
        policy=args.policy, decide=args.decide,
        beyond_k=args.beyond_k, admit_per_step=args.admit_per_step,
    )
    bench_checkpoint(cfg, cpu_expert_layers=args.cpu_expert_layers, prompts_path=args.prompts, num_prompts=args.num_prompts,
                     results_dir=Path(args.results_dir or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}"),
                     command="pagedexperts " + " ".join(shlex.quote(a) for a in sys.argv[1:]), threads_how=how)
    return 0
