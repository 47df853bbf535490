"""The text of ``pagedexperts preflight``'s report: one line per figure of a ``build_report``
dict, bytes in kB, MB or GB chosen by size (``sizing.format_bytes``), the verdict explained,
and when the run does not fit the device, its parts and the flag changes that would fit.
Does not: compute anything (``commands.preflight``, ``analysis.sizing``).
"""

from __future__ import annotations

from pagedexperts.analysis import sizing


def format_report(r: dict) -> str:
    """Human-readable lines of a ``build_report`` dict (bytes in kB, MB or GB by size:
    ``sizing.format_bytes``; % rounded)."""
    size = sizing.format_bytes
    lines = [
        f"model                 {r['model']}: L={r['moe_layers']} MoE layers, E={r['num_experts']}, top_k={r['top_k']}"
        + (f", run in {r['dtype']}" if r.get("dtype") else ""),
        f"expert                {size(r['expert_bytes'])}"
        + (f" (packed; {size(r['dense_expert_bytes'])} dequantized)"
           if r.get("dense_expert_bytes") and r["dense_expert_bytes"] != r["expert_bytes"] else ""),
        f"slot (expert x L)     {size(r['slot_bytes'])}{' dense' if r['slot_format'] == 'dense' else ''} "
        f"(~{r['kv_tokens_per_slot']:,.0f} KV tokens at {r['kv_bytes_per_token']:,} B/token)",
        f"host store (slot x E) {size(r['host_bytes'])}",
        f"non-expert weights    {size(r['non_expert_bytes'])} on the device"
        + (f" ({r['dequantized_modules']} quantized modules dequantized at load: {size(r['dequantized_bytes'])})"
           if r.get("dequantized_modules") else "")
        + (f" ({r['packed_linear_modules']} quantized modules kept packed: {size(r['packed_linear_bytes'])})"
           if r.get("packed_linear_modules") else "")
        + (f" ({r['non_expert_source']})" if r.get("non_expert_source") else ""),
        f"resident K            {r['num_resident']} of {r['num_experts']} ({_k_source(r)}), "
        f"{size(r['device_slot_bytes'])} on the device",
        f"batch cap             {r['single_wave_batch_cap']} (K // top_k requests always fit one wave; "
        "overlapping routing can allow more: `pagedexperts simulate` measures it)",
        f"beyond K in place     --beyond-k in-place: every batch one wave per layer-step (no cap); the link "
        f"bytes per token at a miss rate are the same as paging them in: {size(r['link_bytes_per_token_uniform'])}"
        f" at the uniform {r['uniform_miss_rate']:.0%}"
        + (f", {r['link_bytes_per_token_uniform'] / (r['link_gbps'] * sizing.GB) * 1e3:.2f} ms at "
           f"{r['link_gbps']:g} GB/s" if r.get("link_gbps") else ""),
        f"all-miss per token    {size(r['all_miss_bytes_per_token'])} (L x top_k x expert)",
        f"uniform miss rate     {r['uniform_miss_rate']:.0%} (1 - K/E)",
        f"prefill page-in       {size(r['prefill_page_in_bytes'])} ((E - K) x slot)"
        + (f", {r['prefill_page_in_s']:.3f} s at {r['link_gbps']:g} GB/s (TTFT floor)" if "prefill_page_in_s" in r else ""),
    ]
    if "verdict" in r:
        lines.append(_max_miss_line(r))
    if "fits" in r:
        lines += _format_memory(r)
    if "host_rows" in r:
        lines += _format_tiers(r)
    return "\n".join(lines)


def _k_source(r: dict) -> str:
    return {"default": "default: E/4, at least top_k, as generate and serve"}.get(r["num_resident_source"],
                                                                                  r["num_resident_source"])


def _max_miss_line(r: dict) -> str:
    """The miss rate the link allows at the measured speed (``sizing.max_miss_rate_allowed``). Above
    1 no miss rate is too high: said as such, with the link's margin over the all-miss bytes."""
    allowed, at = r["max_miss_rate_allowed"], f"{r['tok_s']:g} tok/s and {r['link_gbps']:g} GB/s"
    if allowed >= 1:
        needed = sizing.format_bytes(r["tok_s"] * r["all_miss_bytes_per_token"])
        margin = f"{allowed:,.0f}x" if allowed >= 10 else f"{allowed:.2f}x"
        return (f"max miss allowed      any: at {r['tok_s']:g} tok/s even 100% misses page only {needed}/s, under the "
                f"{r['link_gbps']:g} GB/s link ({margin}): the link does not limit this speed, so the speed says "
                "nothing about reuse")
    return f"max miss allowed      {allowed:.0%} at {at}: {_verdict_text(r)}"


def _verdict_text(r: dict) -> str:
    """The verdict with what it means (``sizing.reuse_verdict``)."""
    bound = f"{sizing.REUSE_FACTOR:.0%} of the uniform {r['uniform_miss_rate']:.0%}"
    if r["verdict"] == "reuse implied":
        return (f"reuse implied (at that speed the link pages a miss rate below {bound}: the router must "
                "reuse experts from token to token)")
    return (f"inconclusive (at that speed the link could page a miss rate of {bound} or more, so the speed "
            "does not show whether the router reuses experts; `generate` reports the measured miss rate)")


def _format_memory(r: dict) -> list[str]:
    """The device-memory lines: needs X of G, and when it does not fit, each part with the flag
    that sets it and the single flag changes that would fit (``sizing.changes_that_fit``)."""
    size = sizing.format_bytes
    needed = f"needs {size(r['memory_needed_bytes'])} of {r['device_memory_gb']:g} GB"
    per_req = r["kv_tokens_allowed"] // r["max_running_requests"]
    allowed = (f"context allowed       {r['kv_tokens_allowed']:,} KV tokens at K={r['num_resident']} "
               f"({per_req:,} per request x {r['max_running_requests']})")
    if r["fits"]:
        return [f"device memory         {needed} (fits)", allowed]
    over = r["memory_needed_bytes"] - r["device_memory_gb"] * sizing.GB
    parts = [
        (r["runtime_reserve_gb"] * sizing.GB, f"runtime reserve {r['runtime_reserve_gb']:g} GB (--runtime-reserve-gb)"),
        (r["device_slot_bytes"], f"K={r['num_resident']} slots {size(r['device_slot_bytes'])} (--num-resident)"),
        (r["kv_reserve_bytes"], f"KV reserve {size(r['kv_reserve_bytes'])} (--context-length {r['context_length']:,} "
                                f"x --max-running-requests {r['max_running_requests']})"),
        (r["non_expert_bytes"], f"non-expert weights {size(r['non_expert_bytes'])} "
                                f"({'--non-expert-gb' if r['model'] == 'explicit' else '--dtype'})"),
    ]
    lines = [f"device memory         {needed}: DOES NOT FIT, over by {size(over)}",
             "  parts, largest first: " + ", ".join(text for _, text in sorted(parts, key=lambda p: -p[0]))]
    changes = r["fit_changes"]
    lines.append("  fits with any one of: " + ", ".join(f"{flag} {value:g}" for flag, value in changes.items())
                 if changes else "  no single flag change fits: lower several, or give more --device-memory-gb")
    return lines + [allowed]


def _format_tiers(r: dict) -> list[str]:
    size = sizing.format_bytes
    lines = [f"tiers at G={r['host_memory_gb']:g} GB of host memory (store, staging, runtime allowance "
             f"{size(r['runtime_bytes'])}; slots, weights and KV on a CUDA device)",
             f"  device              K={r['num_resident']} per layer, {size(r['device_slot_bytes'])}"]
    if not r["disk_tier"]:
        return lines + [f"  host                all E={r['num_experts']} per layer, {size(r['host_tier_bytes'])}: no disk tier"]
    lines += [
        f"  host                R={r['host_rows']} per layer, {size(r['host_tier_bytes'])} "
        f"+ staging {size(r['staging_bytes'])}",
        f"  disk                {r['disk_experts_per_layer']} per layer, {size(r['disk_bytes'])} read from the checkpoint",
        f"  disk per token      {size(r['disk_bytes_per_token'])} at device miss {r['device_miss_rate']:.0%} "
        f"x host miss {r['host_miss_rate']:.0%} (L x top_k x expert x both)",
    ]
    if "disk_bound_tok_s" in r:
        lines.append(f"  disk-bound          {r['disk_bound_tok_s']:.2f} tok/s at {r['disk_gbps']:g} GB/s")
    return lines
