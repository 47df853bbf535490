"""Load test of ``pagedexperts serve``: many concurrent streaming clients on loopback.

Starts the server in this process (uvicorn in a thread, 127.0.0.1, a free port) unless
``--url`` names a running one, then:

1. ``--compare 1,8``: the same work from 1 client, then from 8 concurrent clients; prints
   each total tok/s and the ratio (the issue asks for >= 1.5x at 8 clients).
2. ``--clients`` (32) concurrent clients, each ``--requests-per-client`` streaming
   completions, all bounded by ``--deadline-s``. Every request must end with HTTP 200, a
   finish reason and ``[DONE]``, or a clear error (counted and shown, never hidden).

Reports throughput, TTFT p50 / p99 (first text chunk), and from /metrics the decode batch
sizes, union size, waves per layer step and multi-wave steps of the run. Writes a JSON
report to ``--out``. Usage::

    python bench/load_test.py --num-resident 16 --max-running-requests 32 --out results/load_test.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "First Citizen:\nBefore we proceed any further", "KING HENRY:",
           "To be, or not to be", "MENENIUS:\nWhat work's, my countrymen", "But soft, what light", "Now is the winter",
           "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"]
MODEL_COUNTERS = ("pagedexperts_decode_steps_total", "pagedexperts_decode_rows_total",
                  "pagedexperts_prefill_steps_total")
LAYER_COUNTERS = ("pagedexperts_expert_hits_total", "pagedexperts_expert_misses_total", "pagedexperts_waves_total",
                  "pagedexperts_multi_wave_steps_total", "pagedexperts_layer_steps_total",
                  "pagedexperts_union_size_sum_total", "pagedexperts_bytes_paged_total")


@dataclass
class Outcome:
    """One request: HTTP status, tokens, TTFT and total seconds, or the error it got."""

    status: int
    tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    finish_reason: str | None = None
    error: str | None = None


def one_request(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    out = Outcome(status=0)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=max(timeout_s, 1.0)) as r:
            out.status = r.status_code
            if r.status_code != 200:
                r.read()
                out.error = r.text[:200]
                return out
            done = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]["message"]
                elif chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"]:
                    choice = chunk["choices"][0]
                    if choice["text"] and out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - start
                    out.finish_reason = choice["finish_reason"] or out.finish_reason
            if not done or out.finish_reason is None:
                out.error = out.error or "stream ended without a finish reason and [DONE]"
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.total_s = time.perf_counter() - start
    return out


def run_clients(url, model, *, clients, requests_per_client, max_tokens, deadline_s) -> tuple[list[Outcome], float]:
    """``clients`` threads, each sending its requests one after another; (outcomes, wall s)."""
    end = time.perf_counter() + deadline_s

    def client(c: int) -> list[Outcome]:
        outs = []
        for r in range(requests_per_client):
            left = end - time.perf_counter()
            if left <= 0:
                outs.append(Outcome(status=0, error="not sent: deadline reached"))
                continue
            outs.append(one_request(url, model, PROMPTS[(c + r) % len(PROMPTS)], max_tokens, left))
        return outs

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        outcomes = [o for outs in pool.map(client, range(clients)) for o in outs]
    return outcomes, time.perf_counter() - start


def scrape(url: str) -> dict[str, float]:
    """Sum of each counter of interest over its labels, and the max decode batch."""
    wanted = MODEL_COUNTERS + LAYER_COUNTERS + ("pagedexperts_max_decode_batch", "pagedexperts_single_wave_cap")
    sums = dict.fromkeys(wanted, 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def summarize(outcomes: list[Outcome], wall_s: float, before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in MODEL_COUNTERS + LAYER_COUNTERS}
    ok = [o for o in outcomes if o.status == 200 and o.error is None]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    tokens = sum(o.tokens for o in ok)
    layer_steps = d["pagedexperts_layer_steps_total"] or 1
    looked_up = d["pagedexperts_expert_hits_total"] + d["pagedexperts_expert_misses_total"]
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": sorted({o.error for o in outcomes if o.error}),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s else 0.0,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "decode_batch_mean": d["pagedexperts_decode_rows_total"] / max(1, d["pagedexperts_decode_steps_total"]),
        "decode_batch_max_so_far": after["pagedexperts_max_decode_batch"],
        "single_wave_cap": after["pagedexperts_single_wave_cap"],
        "union_size_mean": d["pagedexperts_union_size_sum_total"] / layer_steps,
        "waves_per_layer_step": d["pagedexperts_waves_total"] / layer_steps,
        "multi_wave_fraction": d["pagedexperts_multi_wave_steps_total"] / layer_steps,
        "hit_rate": d["pagedexperts_expert_hits_total"] / looked_up if looked_up else 0.0,
        "bytes_paged": d["pagedexperts_bytes_paged_total"],
    }


def phase(url, model, label, **kw) -> dict:
    before = scrape(url)
    outcomes, wall_s = run_clients(url, model, **kw)
    report = summarize(outcomes, wall_s, before, scrape(url))
    report.update(label=label, **kw)
    print(f"{label}: {report['ok']}/{report['requests']} ok, {report['completion_tokens']} tokens in "
          f"{wall_s:.1f}s = {report['tok_s']:.1f} tok/s; TTFT p50 {_ms(report['ttft_p50_s'])} "
          f"p99 {_ms(report['ttft_p99_s'])}; decode batch mean {report['decode_batch_mean']:.1f}; union mean "
          f"{report['union_size_mean']:.1f}, waves/layer-step {report['waves_per_layer_step']:.2f}, multi-wave "
          f"{report['multi_wave_fraction']:.1%}, hit rate {report['hit_rate']:.1%}", flush=True)
    for err in report["errors"]:
        print(f"  error: {err}", flush=True)
    return report


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}ms"


def start_server(args) -> tuple[str, str, object]:
    """Serve in this process on 127.0.0.1; (url, model name, uvicorn server)."""
    import torch
    import uvicorn

    from pagedexperts import load_model
    from pagedexperts.server import ServeConfig, create_app, single_wave_note

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    model, tokenizer = load_model(args.model_path, num_resident=args.num_resident)
    name = "load-test"
    context = int(model.config.max_position_embeddings)
    app = create_app(model, tokenizer, ServeConfig(name, args.max_running_requests, context))
    print(single_wave_note(model.pagedexperts, args.max_running_requests), flush=True)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", name, server


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one in this process)")
    p.add_argument("--model-path", default=None, help="model directory (default: the bundled model)")
    p.add_argument("--num-resident", type=int, default=None, help="K (default: the loader's default)")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--torch-threads", type=int, default=1, help="intra-op threads of the in-process server (0 = torch's default)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--deadline-s", type=float, default=120.0, help="no request is sent after this, per phase")
    p.add_argument("--compare", default="1,8", help="client counts for the throughput comparison ('' to skip)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)

    server = None
    if args.url:
        url = args.url.rstrip("/")
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    else:
        url, model, server = start_server(args)
    kw = dict(max_tokens=args.max_tokens, deadline_s=args.deadline_s)
    report = {"url": url, "compare": [], "load": None}
    phase(url, model, "warm-up", clients=1, requests_per_client=1, **kw)
    counts = [int(c) for c in args.compare.split(",") if c.strip()]
    for n in counts:  # the same total work for each client count
        report["compare"].append(phase(url, model, f"{n} client(s)", clients=n,
                                       requests_per_client=max(counts) * 2 // n, **kw))
    if len(report["compare"]) >= 2:
        ratio = report["compare"][-1]["tok_s"] / max(1e-9, report["compare"][0]["tok_s"])
        report["throughput_ratio"] = ratio
        print(f"throughput {counts[-1]} clients / {counts[0]} client: {ratio:.2f}x", flush=True)
    report["load"] = phase(url, model, f"{args.clients} clients", clients=args.clients,
                           requests_per_client=args.requests_per_client, **kw)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=lambda o: asdict(o)))
    if server is not None:
        server.should_exit = True
    return 0 if report["load"]["ok"] == report["load"]["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
