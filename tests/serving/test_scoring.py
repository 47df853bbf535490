"""A scoring request (echo + logprobs, max_tokens 0) on a served model is chunked like any
prompt: while it is prefilled, /health answers and a running stream keeps getting tokens.

The server here runs with ``--max-prefill-tokens 8``: a prompt of P tokens takes ceil(P / 8)
steps, and with a stream decoding every one of them is a mixed step (the stream's decode and
a chunk of the prompt in one forward). Hand count: the scheduler's ``mixed_steps`` grows by
exactly ceil(P / 8) and ``prefill_tokens`` by P while the scoring request runs; the stream's
client sees tokens arrive during that time, and every /health poll answers.
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from support.serving_fixtures import HAVE_MODEL, MODEL_PATH, NAME, PROMPTS, httpx, metric, one_thread, serve  # noqa: F401
from pagedexperts.serving.handlers import ServeConfig

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")
BUDGET = 8
CONTEXT = 512
SCORED = " ".join(PROMPTS * 3)  # ~180 tokens: ~23 steps at a budget of 8


@pytest.fixture(scope="module")
def chunked():
    yield from serve(ServeConfig(NAME, 4, CONTEXT, max_prefill_tokens=BUDGET))


def _stream(url, arrivals: list[float], stop: threading.Event) -> None:
    """A long greedy stream (end of sequence forbidden); the arrival time of each text chunk."""
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True,
            "logit_bias": {"0": -100}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if stop.is_set() or line == "data: [DONE]":
                return
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                arrivals.append(time.perf_counter())


def _score(url, result: dict) -> None:
    body = {"model": NAME, "prompt": SCORED, "max_tokens": 0, "echo": True, "logprobs": 1}
    result["sent"] = time.perf_counter()
    result["r"] = httpx.post(url + "/v1/completions", json=body, timeout=120)
    result["done"] = time.perf_counter()


def test_scoring_is_chunked_while_health_and_a_stream_keep_moving(chunked):
    url = chunked[0]
    arrivals, stop = [], threading.Event()
    streamer = threading.Thread(target=_stream, args=(url, arrivals, stop), daemon=True)
    streamer.start()
    deadline = time.monotonic() + 60
    while len(arrivals) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(arrivals) >= 3, "the stream did not start"
    mixed, prefilled = metric(url, "pagedexperts_mixed_steps_total"), metric(url, "pagedexperts_prefill_tokens_total")
    result: dict = {}
    scorer = threading.Thread(target=_score, args=(url, result))
    scorer.start()
    health = []
    while scorer.is_alive():
        start = time.perf_counter()
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        health.append(time.perf_counter() - start)
        time.sleep(0.02)
    scorer.join()
    steps = metric(url, "pagedexperts_mixed_steps_total") - mixed
    tokens = metric(url, "pagedexperts_prefill_tokens_total") - prefilled
    stop.set()
    r = result["r"]
    assert r.status_code == 200, r.text
    body = r.json()
    p = body["usage"]["prompt_tokens"]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["token_logprobs"]) == p
    assert streamer.is_alive(), "the stream ended before the scoring request did"
    assert (steps, tokens) == (math.ceil(p / BUDGET), p)  # every chunk shared a forward with the stream's decode
    during = [t for t in arrivals if result["sent"] <= t <= result["done"]]
    assert len(during) >= steps // 2, f"the stream got {len(during)} tokens during {steps} scoring steps"
    assert health and max(health) < 2.0, f"/health took up to {max(health):.2f}s"  # ~0.4 s on 2 loaded cores
    print(f"\nscoring {p} tokens in {steps} steps: the stream got {len(during)} tokens meanwhile; "
          f"/health {len(health)} polls, max {max(health) * 1e3:.0f} ms")
