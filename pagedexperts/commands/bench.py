"""``pagedexperts bench``: paged vs resident, offload and cpu-experts on the same model."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from pagedexperts.residency.policies import DEFAULT_POLICY, POLICIES
from pagedexperts.models.config import RUN_DTYPE_BYTES
from pagedexperts.paging.waves import INNER_IMPLEMENTATIONS
from pagedexperts.commands.common import add_decide_argument


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} {text!r}: want comma-separated integers, e.g. 8,32") from None


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark paging against resident, offload and cpu-experts",
        description="Per mode: TTFT p50 on short and long prompts, single-stream decode tok/s, "
        "total tok/s at each concurrency (c prompts decoded as one batch), decode hit rate, bytes "
        "paged per token, waves per step, host planning time, and time per token vs resident. "
        "The checkpoint is loaded once; each mode and K re-attaches runners over the same host stores. "
        "Writes bench.md, bench.json, bench.png and command.txt under --results-dir.",
    )
    g = p.add_argument_group("model")
    g.add_argument("--model-path", default=None, help="model directory (default: the bundled model)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default=None, choices=list(RUN_DTYPE_BYTES))
    g.add_argument("--experts-implementation", default="grouped_mm", choices=list(INNER_IMPLEMENTATIONS))
    g.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES), help=f"eviction policy (default {DEFAULT_POLICY})")
    add_decide_argument(g)
    m = p.add_argument_group("modes")
    m.add_argument("--mode", default="resident,paged,offload,cpu-experts", help="comma-separated modes (default: all four)")
    m.add_argument("--num-resident", default="", metavar="K[,K...]", help="K values for paged rows (default: 2k, 4k, E/2)")
    m.add_argument("--cpu-expert-layers", type=int, default=0, metavar="N", help="MoE layers computed on the CPU in cpu-experts mode (default: half)")
    w = p.add_argument_group("workload")
    w.add_argument("--prompts", default=None, help="JSON lines (prompt / turns / question) or ShareGPT JSON (default: built-in prompts)")
    w.add_argument("--num-prompts", type=int, default=4)
    w.add_argument("--output-tokens", type=int, default=32)
    w.add_argument("--long-prompt-tokens", type=int, default=256)
    w.add_argument("--concurrency", default="1,4", help="comma-separated concurrency levels (default 1,4)")
    p.add_argument("--results-dir", default=None, help="default: results/bench-<time>")
    p.set_defaults(func=run)


def run(args) -> int:
    from pagedexperts.tools import bench
    from pagedexperts.tools.bench import BenchConfig, markdown_table, read_prompts, write_results
    from pagedexperts.tools.check import DEFAULT_PROMPTS
    from pagedexperts.paging.baselines import MODES

    modes = tuple(x for x in args.mode.split(",") if x)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown --mode {bad}; choose from {list(MODES)}")
    if args.output_tokens < 2:
        raise ValueError(f"--output-tokens must be >= 2 to measure decode, got {args.output_tokens}")
    ks, concurrency = _checked_workload(args, modes)
    prompts = read_prompts(args.prompts, args.num_prompts) if args.prompts else list(DEFAULT_PROMPTS)[: args.num_prompts]
    cfg = BenchConfig(
        model_path=args.model_path, modes=modes, num_resident=ks, cpu_expert_layers=args.cpu_expert_layers,
        output_tokens=args.output_tokens, concurrency=concurrency, num_prompts=len(prompts),
        long_prompt_tokens=args.long_prompt_tokens, device=args.device, dtype=args.dtype,
        experts_implementation=args.experts_implementation, policy=args.policy, decide=args.decide,
    )
    results = bench.run_bench(cfg, prompts)
    out = Path(args.results_dir or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    command = "pagedexperts " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_results(results, cfg, out, command)
    print(markdown_table(results, cfg.concurrency))
    print(f"\nresults written to {out}/", file=sys.stderr)
    return 0


def _checked_workload(args, modes: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(K values, concurrency levels), every workload flag checked against the model before any
    work: K in [top_k, E], --cpu-expert-layers in [0, MoE layers], counts >= 1.

    Raises:
        ValueError / FileNotFoundError: a bad value (names the value, the limit and the flag).
    """
    from pagedexperts.loading.loader import read_checkpoint_config
    from pagedexperts.residency.planner import check_num_resident
    from pagedexperts.models.config import moe_layer_indices, num_routed_experts

    ks, concurrency = _ints(args.num_resident, "--num-resident"), _ints(args.concurrency, "--concurrency")
    for flag, values in (("--concurrency", concurrency), ("--num-prompts", [args.num_prompts]),
                         ("--long-prompt-tokens", [args.long_prompt_tokens])):
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
    if "cpu-experts" in modes and not 0 <= args.cpu_expert_layers <= num_moe:
        raise ValueError(f"--cpu-expert-layers {args.cpu_expert_layers} outside [0, {num_moe}] (the model's MoE "
                         "layers; 0 = half)")
    return ks, concurrency
