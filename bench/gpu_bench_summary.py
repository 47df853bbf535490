"""The markdown of ``bench/gpu_bench.py``'s result: one table per phase that ran.

Modes (decode tok/s, TTFT, hit rate, MB per token, time per token against resident), the
decode rows with the host in the loop (``gpu_decode.summary_lines``), the miss costs against
the link floor, the layer scaling (fixed and per-layer time) and the modelled 48-layer tok/s.
Does not: measure (``gpu_bench``).
"""

from __future__ import annotations

import gpu_decode  # this folder (bench/ is not a package: the running script's folder is on sys.path)


def na(value, fmt: str) -> str:
    """``value`` formatted, or "n/a" for a counter the mode does not keep (None)."""
    return "n/a" if value is None else format(value, fmt)


def summary(r: dict) -> str:
    """Markdown of the result: the tables of the phases that ran."""
    lines = [f"# gpu_bench ({r['phases']}) {r['date']} on {r['device']} (torch {r['torch']}, triton {r['triton']}), "
             f"{r['layers']} layers, expert {r['expert_bytes'] / 1e6:.2f} MB, link {r['link_gbps_pinned_expert'] or 0:.1f} "
             f"GB/s pinned, routing: {r.get('routing', 'router')}"]
    if r["modes"]:
        lines += ["", "| mode | K | decide | decode tok/s | x4 tok/s | TTFT ms | hit | MB/token | time/token vs resident |",
                  "|---|---|---|---|---|---|---|---|---|"]
    for m in r["modes"]:
        mb = None if m["bytes_per_token"] is None else m["bytes_per_token"] / 1e6
        lines.append(f"| {m['mode']} | {m['K']} | {m['decide']} | {m['decode_tok_s']:.1f} | {m['batch4_tok_s']:.1f} | "
                     f"{1e3 * m['ttft_s']:.1f} | {na(m['hit_rate'], '.1%')} | {na(mb, '.1f')} | "
                     f"{m['time_per_token_vs_resident']:.2f}x |")
    decode_rows = r.get("captured_decode", []) + r.get("decode_host", [])
    if decode_rows:
        lines += gpu_decode.summary_lines(decode_rows)
    if r["miss_costs"]:
        lines += ["", "| misses m | executor | us per layer-step | link floor us |", "|---|---|---|---|"]
    for c in r["miss_costs"]:
        floor = f"{1e6 * c['link_floor_s']:.1f}" if c["link_floor_s"] is not None else "-"
        lines.append(f"| {c['misses']} | {c['executor']} | {1e6 * c['layer_step_s']:.1f} | {floor} |")
    for mode, sc in r.get("layer_scaling", {}).items():
        lines.append(f"\n{mode} ({sc['decide']}): fixed {1e3 * sc['fixed_s']:.2f} ms/token + "
                     f"{1e6 * sc['per_layer_s']:.1f} us/layer")
    if r["modelled"]:
        lines += ["", "| trace | K (trace K) | decide | LRU hit | misses/layer-step | modelled tok/s, 48 layers |",
                  "|---|---|---|---|---|---|"]
    for m in r["modelled"]:
        lines.append(f"| {m['trace']} | {m['K']} ({m['K_trace']}) | {m['decide']} | {m['hit_rate']:.1%} | "
                     f"{m['misses_per_layer_step']:.2f} | {m['modelled_tok_s_48_layers']:.1f} |")
    return "\n".join(lines) + "\n"
