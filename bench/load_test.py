"""Load test of ``pagedexperts serve``: many concurrent streaming clients on loopback.

Starts the server in this process (uvicorn in a thread, 127.0.0.1, a free port) unless
``--url`` names a running one, then:

1. ``--compare 1,8``: the same work from 1 client, then from 8 concurrent clients; prints
   each total tok/s and the ratio (the issue asks for >= 1.5x at 8 clients).
2. ``--clients`` (64) concurrent clients, each ``--requests-per-client`` (3) streaming
   completions, all bounded by ``--deadline-s``. Every request must end with HTTP 200, a
   finish reason and ``[DONE]``, or a clear error (counted and shown, never hidden).

The clients run in a child process (each on its own keep-alive connection, built before the
clock starts), so their Python never holds the server's GIL; TTFT is timed from just before
a request is sent to its first text chunk.

In-process, step 2 runs once per ``--max-running-requests`` value (e.g. ``4,16,32``) and per
``--prefill`` mode, each on a fresh server: ``one`` = one prompt per prefill forward
(``--no-chunked-prefill --max-prefill-tokens 1``, the behaviour before batched prefill),
``batched`` = admitted prompts prefilled together in a forward of their own
(``--no-chunked-prefill``), ``chunked`` = prompt chunks packed into the decode forwards (the
default). Each server first takes a burst (N = the cap clients at once, idle server) and a
steady phase (N clients one request after another: every request finds a free place, so
TTFT shows the scheduler: admission and prefill while the others decode), then the load
phase (64 clients over N places: a request waits for a place, and that wait, which only
throughput shortens, is most of its TTFT; the server's own split, mean TTFT and mean wait
for a place from its /metrics histograms, is printed). The summary table gives TTFT p50 /
p99 and tok/s of each phase, and per running cap and phase the p50 ratio of each mode to
``one``.

``--trees before=/tmp/main-src,after=.``: the same in-process runs, each in a child process
importing ``pagedexperts`` from that source tree (``PYTHONPATH``), the trees alternating per
running cap and repeat (machine drift hits both alike); the parent prints, per cap and tree,
the load phase's server CPU ms per completion token and TTFT p50 of the steady and load phases.

Reports throughput, TTFT p50 / p99 (first text chunk), and from /metrics the decode batch
sizes, prefill batch sizes, union size, waves per layer step and multi-wave steps of the
run. Writes a JSON report to ``--out``. Usage::

    python bench/load_test.py --max-running-requests 4,16,32 --prefill one,batched,chunked --out results/load_test.json
    python bench/load_test.py --max-running-requests 4,16,32 --trees before=/tmp/main-src,after=. --clients 32
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load_clients, next to this file
from load_clients import PROMPTS, Outcome, client_process  # noqa: E402

MODEL_COUNTERS = ("pagedexperts_decode_steps_total", "pagedexperts_decode_rows_total",
                  "pagedexperts_prefill_steps_total", "pagedexperts_prefill_rows_total")
TIMING_SUMS = ("pagedexperts_time_to_first_token_seconds_sum", "pagedexperts_time_to_first_token_seconds_count",
               "pagedexperts_request_queue_time_seconds_sum", "pagedexperts_request_queue_time_seconds_count")
LAYER_COUNTERS = ("pagedexperts_paging_hits_total", "pagedexperts_paging_misses_total", "pagedexperts_paging_waves_total",
                  "pagedexperts_paging_multi_wave_steps_total", "pagedexperts_paging_steps_total",
                  "pagedexperts_paging_union_sum_total", "pagedexperts_paging_bytes_paged_total")


def scrape(url: str) -> dict[str, float]:
    """Sum of each counter of interest over its labels, and the max decode batch."""
    wanted = MODEL_COUNTERS + LAYER_COUNTERS + TIMING_SUMS + ("pagedexperts_max_decode_batch", "pagedexperts_single_wave_cap")
    sums = dict.fromkeys(wanted, 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def summarize(outcomes: list[Outcome], wall_s: float, before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in MODEL_COUNTERS + LAYER_COUNTERS + TIMING_SUMS}
    ok = [o for o in outcomes if o.status == 200 and o.error is None]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    tokens = sum(o.tokens for o in ok)
    layer_steps = d["pagedexperts_paging_steps_total"] or 1
    looked_up = d["pagedexperts_paging_hits_total"] + d["pagedexperts_paging_misses_total"]
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": sorted({o.error for o in outcomes if o.error}),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s else 0.0,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        # the server's own split of TTFT (means over the phase's finished requests, from /metrics):
        # arrival -> admission (waiting for a place), and the rest (admission -> first token)
        "server_ttft_mean_s": _mean(d, "pagedexperts_time_to_first_token_seconds"),
        "queue_mean_s": _mean(d, "pagedexperts_request_queue_time_seconds"),
        "load_avg_1m": os.getloadavg()[0],
        "decode_batch_mean": d["pagedexperts_decode_rows_total"] / max(1, d["pagedexperts_decode_steps_total"]),
        "prefill_batch_mean": d["pagedexperts_prefill_rows_total"] / max(1, d["pagedexperts_prefill_steps_total"]),
        "decode_batch_max_so_far": after["pagedexperts_max_decode_batch"],
        "single_wave_cap": after["pagedexperts_single_wave_cap"],
        "union_size_mean": d["pagedexperts_paging_union_sum_total"] / layer_steps,
        "waves_per_layer_step": d["pagedexperts_paging_waves_total"] / layer_steps,
        "multi_wave_fraction": d["pagedexperts_paging_multi_wave_steps_total"] / layer_steps,
        "hit_rate": d["pagedexperts_paging_hits_total"] / looked_up if looked_up else 0.0,
        "bytes_paged": d["pagedexperts_paging_bytes_paged_total"],
    }


def _mean(d: dict, histogram: str) -> float | None:
    count = d[histogram + "_count"]
    return d[histogram + "_sum"] / count if count else None


def phase(url, model, label, **kw) -> dict:
    """One phase of clients; its summary, with ``server_cpu_ms_per_token``: this process's CPU
    time (``process_time``: the in-process server's threads, the clients run apart) per
    completion token, the throughput measure a loaded machine does not move (0 with ``--url``)."""
    before, cpu = scrape(url), time.process_time()
    outcomes, wall_s = client_process(url=url, model=model, **kw)
    cpu = time.process_time() - cpu
    report = summarize(outcomes, wall_s, before, scrape(url))
    report.update(label=label, server_cpu_ms_per_token=1e3 * cpu / max(1, report["completion_tokens"]), **kw)
    print(f"{label}: {report['ok']}/{report['requests']} ok, {report['completion_tokens']} tokens in "
          f"{wall_s:.1f}s = {report['tok_s']:.1f} tok/s ({report['server_cpu_ms_per_token']:.2f} ms server CPU per "
          f"token); TTFT p50 {_ms(report['ttft_p50_s'])} "
          f"p99 {_ms(report['ttft_p99_s'])} (server mean {_ms(report['server_ttft_mean_s'])}, of it waiting for a "
          f"place {_ms(report['queue_mean_s'])}); prefill batch mean {report['prefill_batch_mean']:.1f}, decode batch "
          f"mean {report['decode_batch_mean']:.1f}; union mean "
          f"{report['union_size_mean']:.1f}, waves/layer-step {report['waves_per_layer_step']:.2f}, multi-wave "
          f"{report['multi_wave_fraction']:.1%}, hit rate {report['hit_rate']:.1%}", flush=True)
    for err in report["errors"]:
        print(f"  error: {err}", flush=True)
    return report


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}ms"


def start_server(args, max_running: int, mode: str) -> tuple[str, str, object]:
    """Serve in this process on 127.0.0.1; (url, model name, uvicorn server)."""
    import torch
    import uvicorn

    from pagedexperts import load_model
    from pagedexperts.serving.api_server import ServeConfig, create_app, single_wave_note

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    model, tokenizer = load_model(args.model_path, num_resident=args.num_resident)
    name = "load-test"
    context = int(model.config.max_position_embeddings)
    extra = dict(PREFILL_MODES[mode])
    app = create_app(model, tokenizer, ServeConfig(name, max_running, context, **extra))
    print(single_wave_note(model.pagedexperts, max_running), flush=True)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", name, server


PREFILL_MODES = {"one": {"max_prefill_tokens": 1, "chunked_prefill": False},  # ServeConfig of each mode
                 "batched": {"chunked_prefill": False}, "chunked": {"chunked_prefill": True}}


def prefill_bench(args, prompts: int, repeats: int = 5) -> dict:
    """Seconds of one scheduler step, per prefill mode, wall (``perf_counter``) and CPU
    (``process_time``: the work itself, whatever else the machine runs): ``burst``, an idle
    scheduler admitting ``prompts`` prompts; ``join``, ``prompts - 1`` requests decoding
    while one new prompt joins (the steady state of a loaded server). Warm-up first, modes
    alternate, medians of ``repeats``."""
    import torch

    from pagedexperts import load_model
    from pagedexperts.engine.sampling import SamplingParams
    from pagedexperts.engine.scheduler import BatchScheduler
    from pagedexperts.engine.scheduler_config import SchedulerConfig

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    model, tokenizer = load_model(args.model_path, num_resident=args.num_resident)
    ids = [tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(prompts)]

    def step(extra, case) -> tuple[float, float]:
        sched = BatchScheduler(model, tokenizer, SchedulerConfig(prompts, 4096, **extra))
        for p in ids[:-1] if case == "join" else ids:
            sched.submit(p, SamplingParams(max_new_tokens=8), lambda e: None)
        if case == "join":
            for _ in range(3):
                sched.step()
            sched.submit(ids[-1], SamplingParams(max_new_tokens=8), lambda e: None)
        wall, cpu = time.perf_counter(), time.process_time()
        sched.step()
        return time.perf_counter() - wall, time.process_time() - cpu

    step({}, "burst")  # warm-up
    times = {(mode, case): [] for case in ("burst", "join") for mode in PREFILL_MODES}
    for _ in range(repeats):
        for (mode, case), v in times.items():
            v.append(step(PREFILL_MODES[mode], case))
    out = {}
    for (mode, case), v in times.items():
        out[f"{case}_{mode}_wall_s"] = statistics.median(w for w, _ in v)
        out[f"{case}_{mode}_cpu_s"] = statistics.median(c for _, c in v)
    for case, what in (("burst", f"{prompts} prompts admitted at once"), ("join", f"{prompts - 1} decoding + 1 joining")):
        print(f"one step, {what}: " + ", ".join(
            f"{m} {out[f'{case}_{m}_wall_s'] * 1e3:.0f} ms wall / {out[f'{case}_{m}_cpu_s'] * 1e3:.0f} ms CPU"
            for m in PREFILL_MODES) + f" (medians of {repeats})", flush=True)
    return out


def run_one(url, model, args, label, burst: int = 0) -> dict:
    """Warm-up, a burst (``burst`` clients at once on the idle server), the steady phase
    (``burst`` clients, each ``--requests-per-client`` requests one after another: every
    request finds a free place, so TTFT is the scheduler's admission and prefill while the
    others decode, no queueing), the optional throughput comparison, then the load phase
    (``--clients``: beyond the cap a request waits for a place, and that wait, which only
    throughput shortens, is most of its TTFT) on one server."""
    kw = dict(max_tokens=args.max_tokens, deadline_s=args.deadline_s)
    report = {"url": url, "compare": [], "load": None, "burst": None, "steady": None}
    phase(url, model, "warm-up", clients=1, requests_per_client=1, **kw)
    if burst:
        report["burst"] = phase(url, model, f"{label}: burst of {burst}", clients=burst, requests_per_client=1, **kw)
        report["steady"] = phase(url, model, f"{label}: steady, {burst} clients", clients=burst,
                                 requests_per_client=args.requests_per_client, **kw)
    counts = [int(c) for c in args.compare.split(",") if c.strip()]
    for n in counts:  # the same total work for each client count
        report["compare"].append(phase(url, model, f"{n} client(s)", clients=n,
                                       requests_per_client=max(counts) * 2 // n, **kw))
    if len(report["compare"]) >= 2:
        ratio = report["compare"][-1]["tok_s"] / max(1e-9, report["compare"][0]["tok_s"])
        report["throughput_ratio"] = ratio
        print(f"throughput {counts[-1]} clients / {counts[0]} client: {ratio:.2f}x", flush=True)
    report["load"] = phase(url, model, f"{label}: {args.clients} clients", clients=args.clients,
                           requests_per_client=args.requests_per_client, **kw)
    return report


PHASES = ("load", "steady", "burst")  # the table's column groups, in order


def print_table(runs: list[dict]) -> None:
    """One row per run: per phase TTFT p50 / p99 and tok/s (load: and the mean wait for a
    place); then per running cap the medians' ratios of each mode to ``one``, per phase."""
    print("\nrunning  prefill  ok/req   | load: TTFT p50   p99   tok/s  queue  cpu/tok | steady: TTFT p50   p99   "
          "tok/s  cpu/tok | burst: TTFT p50   p99", flush=True)
    for r in runs:
        load, steady, burst = (r.get(k) or {} for k in PHASES)
        print(f"{r['max_running']:>7}  {r['prefill']:>7}  {load['ok']:>3}/{load['requests']:<4} | "
              f"{_ms(load['ttft_p50_s']):>15} {_ms(load['ttft_p99_s']):>6} {load['tok_s']:>6.1f} "
              f"{_ms(load.get('queue_mean_s')):>6} {load['server_cpu_ms_per_token']:>5.2f}ms | "
              f"{_ms(steady.get('ttft_p50_s')):>16} {_ms(steady.get('ttft_p99_s')):>6} {steady.get('tok_s', 0.0):>6.1f} "
              f"{steady.get('server_cpu_ms_per_token', 0.0):>5.2f}ms | "
              f"{_ms(burst.get('ttft_p50_s')):>15} {_ms(burst.get('ttft_p99_s')):>6}", flush=True)

    def median(running, mode, key, part):
        values = [r[part][key] for r in runs if (r["max_running"], r["prefill"]) == (running, mode)
                  and r.get(part) and r[part][key] is not None]
        return statistics.median(values) if values else None

    for running in sorted({r["max_running"] for r in runs if isinstance(r["max_running"], int)}):
        for mode in ("batched", "chunked"):
            for part in PHASES:
                one, other = median(running, "one", "ttft_p50_s", part), median(running, mode, "ttft_p50_s", part)
                if one and other:
                    print(f"running {running}, {part}: median TTFT p50 one {_ms(one)}, {mode} {_ms(other)}: "
                          f"{mode} / one = {other / one:.2f}; median tok/s {median(running, 'one', 'tok_s', part):.1f}"
                          f" -> {median(running, mode, 'tok_s', part):.1f}, server CPU ms/token "
                          f"{median(running, 'one', 'server_cpu_ms_per_token', part):.2f} -> "
                          f"{median(running, mode, 'server_cpu_ms_per_token', part):.2f}", flush=True)


def compare_trees(args, argv: list[str]) -> list[dict]:
    """Each (running cap, repeat, tree) in a child process of this script over that tree (its
    arguments less --trees and --out, one cap); the trees alternate. Prints and returns one
    row per run: cap, tree, and the load / steady phases' numbers."""
    import subprocess
    import tempfile

    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    keep, skip = [], False
    for a in argv:  # the child's arguments: ours less --trees / --out / --max-running-requests
        if skip or a.split("=", 1)[0] in ("--trees", "--out", "--max-running-requests"):
            skip = not skip and "=" not in a
            continue
        keep.append(a)
    rows = []
    for running in (int(x) for x in args.max_running_requests.split(",")):
        for rep in range(args.repeats):
            for name, tree in (trees.items() if rep % 2 == 0 else reversed(list(trees.items()))):
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "run.json"
                    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
                    subprocess.run([sys.executable, __file__, *keep, "--repeats", "1", "--prefill-bench", "0",
                                    "--max-running-requests", str(running), "--out", str(out)], env=env, check=True)
                    (run,) = json.loads(out.read_text())["runs"]
                rows.append({"tree": name, "path": tree, **run})
    print("\nrunning  tree      | load: cpu ms/token  TTFT p50 | steady: cpu ms/token  TTFT p50", flush=True)
    for r in rows:
        load, steady = r["load"], r["steady"] or {}
        print(f"{r['max_running']:>7}  {r['tree']:<8} | {load['server_cpu_ms_per_token']:>18.2f} "
              f"{_ms(load['ttft_p50_s']):>9} | {steady.get('server_cpu_ms_per_token', 0.0):>20.2f} "
              f"{_ms(steady.get('ttft_p50_s')):>9}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one in this process per configuration)")
    p.add_argument("--model-path", default=None, help="model directory (default: the bundled model)")
    p.add_argument("--num-resident", type=int, default=None, help="K (default: the loader's default)")
    p.add_argument("--max-running-requests", default="32", help="comma-separated caps, one server each (in-process)")
    p.add_argument("--prefill", default="chunked", help="comma-separated prefill modes: one, batched, chunked (in-process)")
    p.add_argument("--torch-threads", type=int, default=1, help="intra-op threads of the in-process server (0 = torch's default)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--deadline-s", type=float, default=300.0, help="no request is sent after this, per phase")
    p.add_argument("--repeats", type=int, default=1, help="runs of each (cap, mode), alternating modes; medians reported")
    p.add_argument("--prefill-bench", type=int, default=16, metavar="N",
                   help="first time one step prefilling N prompts, per mode (0 to skip; in-process only)")
    p.add_argument("--compare", default="", help="client counts for a throughput comparison, e.g. 1,8 ('' to skip)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--trees", default=None, metavar="NAME=PATH,...",
                   help="compare source trees, e.g. before=/tmp/main-src,after=. (each run in a child process)")
    args = p.parse_args(argv)
    if args.trees:
        rows = compare_trees(args, sys.argv[1:] if argv is None else list(argv))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"trees": rows}, indent=2))
        return 0 if all(r["load"]["ok"] == r["load"]["requests"] for r in rows) else 1

    runs, steps = [], None
    if args.prefill_bench and not args.url:
        steps = prefill_bench(args, args.prefill_bench)
    if args.url:
        url = args.url.rstrip("/")
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        runs.append({"max_running": "?", "prefill": "?", **run_one(url, model, args, "server")})
    else:
        modes = [m.strip() for m in args.prefill.split(",") if m.strip()]
        unknown = sorted(set(modes) - set(PREFILL_MODES))
        if unknown:
            p.error(f"--prefill takes {sorted(PREFILL_MODES)}, got {unknown}")
        for running in (int(x) for x in args.max_running_requests.split(",")):
            for rep in range(args.repeats):  # modes alternate, so machine load drifts hit both alike
                for mode in modes:
                    url, model, server = start_server(args, running, mode)
                    runs.append({"max_running": running, "prefill": mode, "repeat": rep,
                                 **run_one(url, model, args, f"running {running}, prefill {mode}, #{rep + 1}",
                                           burst=running)})
                    server.should_exit = True
                    time.sleep(1.0)
    print_table(runs)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"steps": steps, "runs": runs}, indent=2, default=lambda o: asdict(o)))
    return 0 if all(r["load"]["ok"] == r["load"]["requests"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
