"""``pagedexperts linkbench``: measure host-to-device copy GB/s, pinned and pageable.

Owns the flags and the output; the timing is ``pagedexperts.linkbench``. Without an
accelerator it says so and exits 0 with no number.
"""

from __future__ import annotations

import json


def add_parser(subparsers) -> None:
    """Register the subcommand, its flags and ``func`` on the CLI's ``subparsers``."""
    p = subparsers.add_parser(
        "linkbench",
        help="measure host-to-device copy bandwidth (GB/s), pinned and pageable",
        description="Times host-to-device copies with CUDA events; median of --repeats; "
        "GB/s = 1e9 B/s. Feed the pinned figure to `preflight --link-gbps`.",
    )
    p.add_argument("--sizes-mb", default=",".join(f"{x:g}" for x in (1, 4, 16, 64, 256)),
                   help="comma-separated copy sizes in MB (1e6 B) (default 1,4,16,64,256)")
    p.add_argument("--model-path", help="also time a copy of one expert of this checkpoint (headers only)")
    p.add_argument("--repeats", type=int, default=10, help="timed copies per size; the median is reported (default 10)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=run_linkbench)


def run_linkbench(args) -> int:
    """Measure and print GB/s per size and memory kind; without CUDA, say so and return 0."""
    from pagedexperts import linkbench, sizing

    try:
        sizes = [(f"{float(x):g} MB", round(float(x) * sizing.MB)) for x in args.sizes_mb.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sizes-mb {args.sizes_mb!r} is not a comma-separated list of numbers") from None
    if args.model_path:
        shape = sizing.moe_shape(config=sizing.read_config(args.model_path))
        expert = sizing.checkpoint_sizes(model_path=args.model_path, num_experts=shape.num_experts).expert_bytes
        sizes.append(("expert", expert))
    results = linkbench.measure(sizes=sizes, repeats=args.repeats)
    device = linkbench.accelerator_name() if results is not None else None
    if args.json:
        print(json.dumps({"accelerator": device,
                          "results": [r.as_dict() for r in results] if results is not None else []}, indent=2))
    elif results is None:
        print("no accelerator: torch sees no CUDA device, so there is no host-to-device link to measure")
    else:
        print(f"host-to-device copies on {device} (median of {args.repeats}; GB/s = 1e9 B/s)")
        print(f"{'size':>12} {'bytes':>12} {'pinned GB/s':>12} {'pageable GB/s':>14}")
        by = {(r.label, r.memory): r for r in results}
        for label, n in sizes:
            print(f"{label:>12} {n:>12,} {by[label, 'pinned'].gbps:>12.2f} {by[label, 'pageable'].gbps:>14.2f}")
    return 0
