"""Start-up of a full packed host store: read from the stored kernel layout vs converted at load.

Issue 46. Where every expert fits in host memory (no disk tier) and the experts run packed on the
CPU, the load either reads the stored layout (the checkpoint's kernel-layout/ or the cache,
``loading.stored_layout.read_stored_layout``) or converts every expert to torch's int4 pack
(``--no-stored-layout``, or no valid layout). Each load runs in its own child process
(``load_model`` as ``pagedexperts generate`` calls it: default options, the start-up independence
check on); the two alternate round by round; CPU seconds (``time.process_time``, every thread) and
wall seconds of ``load_model``, peak RSS; medians [min-max]. ``--cold`` drops the checkpoint's
files and the stored layout from the page cache before each load (``bench/real_disk.py``).

Usage (a few GB of RAM: under the shared lock):
  flock /work/notes/bigmem.lock python bench/stored_layout_load.py /work/ckpts/real4-w4a16 \
      --stored-layout-dir /work/ckpts/kernel-layouts --rounds 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("converted", "stored")


def child(args) -> None:
    """One load in this process; prints one JSON line."""
    from pagedexperts import load_model

    options = {"stored_layout": False} if args.mode == "converted" else {"stored_layout_dir": args.stored_layout_dir}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    model, _ = load_model(args.path, **options)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    resolved = model.pagedexperts.resolved
    print(json.dumps({"mode": args.mode, "cpu_s": cpu, "wall_s": wall,
                      "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
                      "disk_tier": resolved.host_memory.disk_tier, "implementation": resolved.experts_implementation,
                      "stored_layout": resolved.stored_layout, "why": resolved.reasons.get("stored_layout")}))


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--stored-layout-dir", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="drop the files from the page cache before each load")
    p.add_argument("--child", choices=MODES, dest="mode", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mode:
        return child(args)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            if args.cold:
                from real_disk import drop_page_cache

                drop_page_cache(Path(args.path), Path(args.stored_layout_dir))
            out = subprocess.run([sys.executable, __file__, args.path, "--stored-layout-dir", args.stored_layout_dir,
                                  "--child", mode], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps({"round": r, **row}), flush=True)
            results[mode].append(row)
    print("\n| load | CPU s | wall s | peak RSS GB | store |\n| --- | --- | --- | --- | --- |")
    for mode in MODES:
        rows = results[mode]
        print(f"| {mode} | {_spread([x['cpu_s'] for x in rows])} | {_spread([x['wall_s'] for x in rows])} | "
              f"{_spread([x['peak_rss_gb'] for x in rows])} | {rows[-1]['why']} |")
    ratio = [c["cpu_s"] / s["cpu_s"] for c, s in zip(results["converted"], results["stored"])]
    print(f"\nCPU time converted / stored, per round: {_spread(ratio)}x")


if __name__ == "__main__":
    main()
