"""Decode with the host in the loop, measured: the ``decode_host`` phase of ``gpu_bench.py``.

For resident and paged at each K, at batch 1 and 4, on gpu_bench's model (Qwen3-30B-A3B
shapes, random weights, trace-driven routing):
- decode tok/s eager (transformers' generate), and with every decode step replayed from a
  CUDA graph (``generation.graphs``: static KV cache, prefill eager) beside transformers'
  eager generate again in the same row, both under the random router (the trace routing
  uploads ids from the host each step, which a graph cannot hold); None ("n/a") with the
  reason where graphs are off for the mode; the dry run (CPU) runs the same static step
  eagerly (no capture);
- host syncs per decode step: synchronizing CUDA calls counted by
  ``torch.cuda.set_sync_debug_mode("warn")`` (each one a warning) during decode only, all of
  them, those made from pagedexperts' runtime, and those of the benchmark's trace-driven
  routing (its top-k upload, ``trace_routing``; not part of the runtime); the rest are the
  model's and generate's own (e.g. the stopping check). CUDA only (None on CPU);
- host time per MoE layer-step: wall time from the experts module's call to its return
  (forward pre- and post-hooks), decode only, p50 and mean. On CUDA the launches are
  asynchronous, so this is the host's bookkeeping plus any wait at a read-back.

A decode step makes one token per row: with batch 4, per decode token = per step / 4.
The timed run is uninstrumented; syncs and host times come from a second run.
``captured_decode`` makes the graphs rows alone (gpu_check.sh runs them second, right after
the CUDA tests). Every row records the decide path that ran and the torch and triton versions
(``row_meta``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings

import torch

BATCHES = (1, 4)
SYNC_WARNING = "synchroniz"  # in the text of every set_sync_debug_mode("warn") warning
ROUTING_DRIVER = "trace_routing.py"  # the benchmark's trace-driven top-k upload: not the runtime's


def versions() -> dict:
    """{"torch": version, "triton": version or None (not installed)}."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(torch=torch.__version__, triton=triton_version)


def row_meta(model) -> dict:
    """What every benchmark row records: the decide path of the model's runners now
    (``rt.decide``: "device" or "host"; a baseline mode plans nothing: "host") and versions."""
    return dict(decide=model.pagedexperts.decide, **versions())


def static_decode_tok_s(model, graphs, *, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tok/s over all rows of one greedy ``static_generate`` on random prompts (every
    decode step through ``graphs``: replayed CUDA graphs, or the same step run eagerly)."""
    from pagedexperts.generation.static_decode import DecodeOptions, static_generate

    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=model.device)
    times = []

    class Clock:  # static_generate reads each token back (.cpu()): the time is the token's
        def put(self, value):
            times.append(time.perf_counter())

        def end(self):
            pass

    static_generate(model, graphs, ids, torch.ones_like(ids), DecodeOptions(max_new_tokens=new_tokens, ignore_eos=True),
                    streamer=Clock())
    times = times[1:]  # the first put() is the prompt
    return batch * (len(times) - 1) / (times[-1] - times[0])


@contextlib.contextmanager
def router_routing(model, args):
    """Trace-driven routing paused (its hooks upload top-k ids from the host: not capturable),
    reinstalled afterwards (``args.routing_driver``, set by gpu_bench)."""
    driver = getattr(args, "routing_driver", None)
    if driver is None:
        yield
        return
    for h in driver.handles:
        h.remove()
    try:
        yield
    finally:
        from pagedexperts.analysis import trace_routing

        args.routing_driver = trace_routing.install(model, driver.trace)


def graphs_row(model, args, run: dict, decode_run) -> dict:
    """Decode tok/s with every decode step replayed from a CUDA graph (``generation.graphs``:
    static cache, prefill eager, warm-up captures) and, in the same minute, transformers'
    eager generate, both under the random router. Dry run (CPU): the same static step run
    eagerly (``EagerBackend``). None with the reason when graphs are off for this mode."""
    from pagedexperts.generation.graphs import DecodeGraphs, decode_graphs_for

    rt = model.pagedexperts
    if model.device.type == "cuda":
        graphs = decode_graphs_for(model)
    else:
        graphs = DecodeGraphs(model, backend="eager", max_batch=max(BATCHES))
    if graphs is None:
        return dict(graphs_tok_s=None, eager_router_tok_s=None, graphs_off=rt.resolved.reasons["cuda_graphs"])
    with router_routing(model, args):
        static_decode_tok_s(model, graphs, batch=run["batch"], prompt_len=8, new_tokens=3)  # warm-up: capture
        tok_s = static_decode_tok_s(model, graphs, **run)
        _, eager = decode_run(model, **run)
    return dict(graphs_tok_s=tok_s, eager_router_tok_s=eager, graphs_off=None, graphs=graphs.summary())


class _DecodeProbe:
    """Streamer that opens the decode window at the first new token: from then on it counts
    sync warnings (``caught`` grows) and experts-module host times (``layer_s``)."""

    def __init__(self, model, caught: list) -> None:
        self.caught, self.puts, self.layer_s, self.sync_start = caught, 0, [], None
        self._t0 = None
        self.handles = []
        for site in model.pagedexperts.sites:
            self.handles.append(site.module.register_forward_pre_hook(self._enter))
            self.handles.append(site.module.register_forward_hook(self._leave))

    def _enter(self, module, args) -> None:
        self._t0 = time.perf_counter()

    def _leave(self, module, args, out) -> None:
        if self.sync_start is not None:
            self.layer_s.append(time.perf_counter() - self._t0)

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put() is the prompt, the second the first new token
            self.sync_start = len(self.caught)

    def end(self) -> None:
        pass

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def instrumented_run(model, *, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """One greedy generate: decode syncs per step (all, pagedexperts') and host time per
    MoE layer-step (p50, mean; seconds)."""
    cuda = model.device.type == "cuda"
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=model.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = _DecodeProbe(model, caught)
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=probe)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            probe.remove()
    steps = new_tokens - 1
    syncs = [w for w in caught[probe.sync_start:] if SYNC_WARNING in str(w.message).lower()]
    driver = [w for w in syncs if w.filename.endswith(ROUTING_DRIVER)]
    ours = [w for w in syncs if "/pagedexperts/" in w.filename and not w.filename.endswith(ROUTING_DRIVER)]
    return dict(host_syncs_per_decode_step=len(syncs) / steps if cuda else None,
                pagedexperts_syncs_per_decode_step=len(ours) / steps if cuda else None,
                routing_driver_syncs_per_decode_step=len(driver) / steps if cuda else None,
                host_s_per_layer_step_p50=statistics.median(probe.layer_s),
                host_s_per_layer_step_mean=statistics.fmean(probe.layer_s))


def decode_host(model, args, *, repage, decode_run, graphs: bool = True) -> list[dict]:
    """Rows of (mode, K, batch): eager and (``graphs``) graphs decode tok/s, syncs, host times.
    ``repage`` and ``decode_run`` are gpu_bench's (``runners.repage``; (TTFT, tok/s))."""
    rows = []
    for mode, k in [("resident", None)] + [("paged", k) for k in args.ks]:
        repage(model, mode=mode, num_resident=k)
        for batch in BATCHES:
            run = dict(batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
            decode_run(model, batch=batch, prompt_len=8, new_tokens=3)  # warm-up
            _, eager = decode_run(model, **run)
            measured = graphs_row(model, args, run, decode_run) if graphs else dict(graphs_tok_s=None,
                                                                                 eager_router_tok_s=None,
                                                                                 graphs_off="--phases rest")
            row = dict(mode=mode, K=model.pagedexperts.num_resident, batch=batch, **row_meta(model), eager_tok_s=eager,
                       **measured, **instrumented_run(model, **run))
            rows.append(row)
            syncs = row["host_syncs_per_decode_step"]
            print(f"  {mode:8s} K={row['K']:4d} batch {batch} ({row['decide']}): eager {eager:8.1f} tok/s, graphs "
                  f"{_na(row['graphs_tok_s'], '.1f')} vs eager {_na(row['eager_router_tok_s'], '.1f')} (router), "
                  f"syncs/step {_na(syncs, '.1f')}, host "
                  f"{1e6 * row['host_s_per_layer_step_p50']:.1f} us/layer-step (p50)", flush=True)
    return rows


def captured_decode(model, args, *, repage, decode_run) -> list[dict]:
    """The CUDA-graph rows alone (paged at each K first, then resident; batch 1 and 4):
    graphs tok/s beside transformers' eager generate under the random router."""
    rows = []
    for mode, k in [("paged", k) for k in args.ks] + [("resident", None)]:
        repage(model, mode=mode, num_resident=k)
        for batch in BATCHES:
            run = dict(batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
            row = dict(mode=mode, K=model.pagedexperts.num_resident, batch=batch, **row_meta(model),
                       **graphs_row(model, args, run, decode_run))
            rows.append(row)
            print(f"  {mode:8s} K={row['K']:4d} batch {batch} ({row['decide']}): graphs "
                  f"{_na(row['graphs_tok_s'], '.1f')} tok/s vs eager {_na(row['eager_router_tok_s'], '.1f')} (router)"
                  + (f", graphs off: {row['graphs_off']}" if row["graphs_off"] else ""), flush=True)
    return rows


def _na(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def summary_lines(rows: list[dict]) -> list[str]:
    """Markdown table of ``decode_host`` and ``captured_decode`` rows (the latter without the
    eager, sync and host-time columns: "-")."""
    lines = ["", "| mode | K | batch | decide | eager tok/s | graphs tok/s (eager, random router) | syncs/decode step "
             "(pagedexperts, routing driver) | host us/layer-step p50 (mean) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        syncs = _na(r.get("host_syncs_per_decode_step"), ".1f")
        ours = _na(r.get("pagedexperts_syncs_per_decode_step"), ".1f")
        driver = _na(r.get("routing_driver_syncs_per_decode_step"), ".1f")
        host = "-" if "host_s_per_layer_step_p50" not in r else (
            f"{1e6 * r['host_s_per_layer_step_p50']:.1f} ({1e6 * r['host_s_per_layer_step_mean']:.1f})")
        eager = "-" if "eager_tok_s" not in r else f"{r['eager_tok_s']:.1f}"
        lines.append(f"| {r['mode']} | {r['K']} | {r['batch']} | {r['decide']} | {eager} | "
                     f"{_na(r['graphs_tok_s'], '.1f')} ({_na(r['eager_router_tok_s'], '.1f')}) | {syncs} ({ours}, {driver}) | "
                     f"{host} |")
    lines.append("graphs: decode steps replayed from CUDA graphs (static KV cache), beside transformers' eager "
                 "generate in the same row, both under the random router (trace routing uploads ids from the "
                 "host); n/a: graphs off for the mode (reason in the JSON); dry run: the static step eagerly")
    return lines
