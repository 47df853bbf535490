"""``pagedexperts linkbench``: measure host-to-device copy GB/s, pinned and pageable (or, with
``--disk``, a checkpoint's read GB/s).

Owns the flags and the output; the timing is ``pagedexperts.analysis.linkbench``. Without an
accelerator it says so and exits 0 with no number.
"""

from __future__ import annotations

import json

from pagedexperts.commands import COMMANDS
from pagedexperts.commands.flag_lists import comma_numbers


def add_parser(subparsers) -> None:
    """Register the subcommand, its flags and ``func`` on the CLI's ``subparsers``."""
    p = subparsers.add_parser(
        "linkbench",
        help=COMMANDS["linkbench"],
        description="Times host-to-device copies with CUDA events; median of --repeats; "
        "GB/s = 1e9 B/s. Feed the pinned figure to `preflight --link-gbps`.",
    )
    p.add_argument("--sizes-mb", default=",".join(f"{x:g}" for x in (1, 4, 16, 64, 256)),
                   help="comma-separated copy sizes in MB (1e6 B) (default 1,4,16,64,256)")
    p.add_argument("--model-path", help="also time a copy of one expert of this checkpoint (headers only)")
    p.add_argument("--repeats", type=int, default=10, help="timed copies per size; the median is reported (default 10)")
    p.add_argument("--disk", metavar="PATH",
                   help="instead: read GB/s of a checkpoint (directory or .safetensors file; bundled or "
                   "bundled:FORMAT as in --model-path), page cache dropped first (posix_fadvise DONTNEED) and warm; "
                   "per-tensor preadv vs safetensors slicing")
    p.add_argument("--disk-max-gb", type=float, default=2.0, help="GB read sequentially per pass with --disk (default 2)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=run_linkbench)


def run_linkbench(args) -> int:
    """Measure and print GB/s per size and memory kind; without CUDA, say so and return 0."""
    from pagedexperts.analysis import linkbench
    from pagedexperts.analysis import sizing
    from pagedexperts.models import config as model_config

    if args.disk:
        return _run_disk(args)
    sizes = [(f"{x:g} MB", round(x * sizing.MB)) for x in comma_numbers(args.sizes_mb, "--sizes-mb", example="1,4,16")]
    if args.model_path:
        shape = model_config.moe_shape(model_config.read_config(args.model_path))
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


def _run_disk(args) -> int:
    """``--disk PATH``: print the checkpoint's read GB/s (``analysis.diskbench``); ``bundled`` and
    ``bundled:FORMAT`` name the bundled model and its variants, as every --model-path does."""
    from pagedexperts.analysis.diskbench import measure_disk
    from pagedexperts.commands.quantize import resolve_model_path

    if not args.disk_max_gb > 0:
        raise ValueError(f"--disk-max-gb {args.disk_max_gb} must be > 0")
    args.disk = resolve_model_path(args.disk)
    r = measure_disk(args.disk, max_bytes=int(args.disk_max_gb * 1e9))
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    cache = "page cache dropped first" if r["cold"] else "page cache could NOT be dropped: cold figures are warm"
    print(f"disk reads of {args.disk} ({len(r['files'])} files; {cache}; GB/s = 1e9 B/s)")
    print(f"  sequential, 16 MB reads over {r['sequential_bytes'] / 1e9:.2f} GB: cold {r['sequential_cold_gbps']:.2f}, "
          f"warm {r['sequential_warm_gbps']:.2f}")
    print(f"  per tensor, {r['tensors']} largest ({r['tensor_bytes'] / 1e6:.0f} MB), cold: preadv {r['pread_cold_gbps']:.2f}, "
          f"safetensors slicing {r['safetensors_slice_cold_gbps']:.2f}")
    print("feed the cold figure to `preflight --disk-gbps`")
    return 0
