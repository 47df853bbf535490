"""The client side of ``bench/load_test.py``: streaming completion clients, each on its own
keep-alive connection, run in a child process of their own.

``client_process`` runs ``run_clients`` in a spawned process, so the clients' Python never
competes with an in-process server for its GIL; ``one_request`` times TTFT from just before a
request is sent to its first text chunk.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "First Citizen:\nBefore we proceed any further", "KING HENRY:",
           "To be, or not to be", "MENENIUS:\nWhat work's, my countrymen", "But soft, what light", "Now is the winter",
           "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"]


@dataclass
class Outcome:
    """One request: HTTP status, tokens, TTFT and total seconds, or the error it got."""

    status: int
    tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    finish_reason: str | None = None
    error: str | None = None


def one_request(http: httpx.Client, model: str, prompt: str, max_tokens: int, timeout_s: float) -> Outcome:
    """One streaming completion on the client's own connection; TTFT and total seconds from
    just before the request is sent (the client's setup is not the server's latency)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    out = Outcome(status=0)
    start = time.perf_counter()
    try:
        with http.stream("POST", "/v1/completions", json=body, timeout=max(timeout_s, 1.0)) as r:
            out.status = r.status_code
            if r.status_code != 200:
                r.read()
                out.error = r.text[:200]
                return out
            _read_stream(r, out, start)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.total_s = time.perf_counter() - start
    return out


def _read_stream(r, out: Outcome, start: float) -> None:
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


def run_clients(url, model, *, clients, requests_per_client, max_tokens, deadline_s) -> tuple[list[Outcome], float]:
    """``clients`` threads, each sending its requests one after another on its own keep-alive
    connection; (outcomes, wall s). Runs in a child process (``client_process``): client
    threads in the server's process would hold its GIL (an ``httpx.Client`` costs ~60 ms of
    CPU to build, its TLS context; 16 built at once delayed every first request ~1 s)."""
    clock: dict[str, float] = {}  # set once, by the barrier, as every thread is released
    ready = threading.Barrier(clients + 1, action=lambda: clock.update(start=time.perf_counter()), timeout=120)

    def client(c: int) -> list[Outcome]:
        with httpx.Client(base_url=url) as http:
            ready.wait()
            outs = []
            for r in range(requests_per_client):
                left = clock["start"] + deadline_s - time.perf_counter()
                if left <= 0:
                    outs.append(Outcome(status=0, error="not sent: deadline reached"))
                    continue
                outs.append(one_request(http, model, PROMPTS[(c + r) % len(PROMPTS)], max_tokens, left))
            return outs

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, c) for c in range(clients)]
        ready.wait()  # every client built: the clock starts
        outcomes = [o for f in futures for o in f.result()]
    return outcomes, time.perf_counter() - clock["start"]


def client_process(**kw) -> tuple[list[Outcome], float]:
    """``run_clients`` in a fresh (spawned) process: its Python never competes with the server's."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_clients, **kw).result()
