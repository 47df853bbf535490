"""The tables of ``bench/real_shape.py``: its measurements (``run``'s and ``quantized``'s JSON
dicts) as markdown, each number a median with its [min-max] spread over rounds.

``table``: per mode ms / token, ratio to plain, misses and MB paged per token, extra ms over
plain and the memcpy bound; ``quantized_table``: the same against plain bf16, and one expert's
conversion beside its memcpy. Does not: measure (``real_shape.measure``, ``measure_quantized``).
"""

from __future__ import annotations

import statistics


def med(xs) -> str:
    """``median [min-max]`` of ``xs``, two decimals."""
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def table(res: dict, label: str) -> str:
    times, gbps = res["times"], res["memcpy_gbps"]
    plain = times["plain"]
    lines = [f"## {label}", f"{res['pagedexperts']}; {res['layers']} layers, {res['threads']} thread(s), "
             f"{res['tokens']} decode tokens x {res['rounds']} rounds, CPU time; memcpy {gbps:.2f} GB/s",
             "| mode | ms / token | ratio to plain | misses / token | MB paged / token | extra ms vs plain | bound ms (MB paged at memcpy) |",
             "|---|---|---|---|---|---|---|"]
    for name, ts in times.items():
        ms = [t * 1e3 for t in ts]
        if name == "plain":
            lines.append(f"| plain | {med(ms)} | 1 | | | | |")
            continue
        ratios = [t / p for t, p in zip(ts, plain)]
        extra = [(t - p) * 1e3 for t, p in zip(ts, plain)]
        miss = statistics.median(c[0] for c in res["counters"][name])
        mb = statistics.median(c[1] for c in res["counters"][name]) / 1e6
        bound = mb / 1e3 / gbps * 1e3
        lines.append(f"| {name} | {med(ms)} | {med(ratios)} | {miss:.1f} | {mb:.1f} | {med(extra)} | {bound:.2f} |")
    return "\n".join(lines)


def quantized_table(res: dict) -> str:
    """The ``quantized`` table: per mode ms / token and its ratio to plain bf16 (median [min-max]
    over rounds), misses and MB paged per token; one expert's conversion against its memcpy."""
    times, plain = res["times"], res["times"]["plain"]
    lines = [f"{res['pagedexperts']}; {res['layers']} layers, {res['threads']} thread(s), {res['tokens']} decode tokens x "
             f"{res['rounds']} rounds, CPU time; one expert {res['expert_bytes'] / 1e6:.2f} MB packed: converted to the "
             f"int4 kernel's layout in {res['convert_ms']:.1f} ms, memcpy {res['expert_bytes'] / res['memcpy_gbps'] / 1e6:.2f} ms",
             "| mode | ms / token | ratio to plain bf16 | misses / token | MB paged / token |", "|---|---|---|---|---|"]
    for name, ts in times.items():
        ms = [t * 1e3 for t in ts]
        if name == "plain":
            lines.append(f"| plain transformers, bf16 original | {med(ms)} | 1 | | |")
            continue
        miss = statistics.median(c[0] for c in res["counters"][name])
        mb = statistics.median(c[1] for c in res["counters"][name]) / 1e6
        lines.append(f"| paged {name} | {med(ms)} | {med([t / p for t, p in zip(ts, plain)])} | {miss:.1f} | {mb:.2f} |")
    return "\n".join(lines)
