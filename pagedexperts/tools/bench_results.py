"""``pagedexperts bench``'s outputs: the markdown table, the terminal table and the results files.

Owns: ``markdown_table`` (every column, one row per mode / K), ``terminal_table`` (the few
columns read first), ``make_results_dir`` (made and checked before the benchmark runs) and
``write_results`` (bench.md, bench.json, bench.png, command.txt) of a
``tools.bench.BenchRun``. Does not: measure (``tools.bench``) or parse flags (``commands.bench``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

logger = logging.getLogger(__name__)


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


def make_results_dir(out_dir: Path) -> None:
    """Make ``out_dir`` (parents too) and check that it is writable, before any work: a directory
    that cannot be written once raised an OSError traceback after the whole benchmark.

    Raises:
        ValueError: it is a file, cannot be made, or is not writable (names --results-dir, the path, why).
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--results-dir {out_dir} is a file; give a directory (made if missing)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--results-dir {out_dir}: cannot make the directory ({exc.strerror or exc}); "
                         "give a writable directory (made if missing)") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--results-dir {out_dir}: not writable; give a writable directory (made if missing)")


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
