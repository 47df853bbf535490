"""Admission and lifetime of a strict server: API key, body and prompt bounds while /health
stays responsive, the bounded queue (429), graceful shutdown (503, final events, [DONE]).

The server here runs with ``--api-key``, ``--max-running-requests 1``,
``--max-queued-requests 1`` and an 8 MB body limit. The shutdown test ends the module.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from support.serving_fixtures import CONTEXT, HAVE_MODEL, MODEL_PATH, NAME, PROMPTS, httpx, metric, one_thread, serve  # noqa: F401
from support.serving_fixtures import client as openai_client
from pagedexperts.serving.handlers import ServeConfig

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 8_000_000
LONG = {"model": NAME, "max_tokens": 200, "temperature": 0, "logit_bias": {"0": -100}, "stream": True}


@pytest.fixture(scope="module")
def strict():
    config = ServeConfig(NAME, 1, CONTEXT, max_queued_requests=1, max_body_bytes=BODY_LIMIT, api_key=KEY,
                         shutdown_timeout_s=0.5)
    yield from serve(config)


def _post(url, body, path="/v1/completions", **kw):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60, **kw)


def test_api_key_required_on_v1_only(strict):
    url = strict[0]
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.get(url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert [m.id for m in openai_client(url).with_options(api_key=KEY).models.list().data] == [NAME]
    assert metric(url, 'pagedexperts_refused_requests_total{code="invalid_api_key",status="401"}') >= 2


def _health_while(url, send) -> tuple[list[float], object]:
    """Latencies of /health polled while ``send()`` runs in a thread; (latencies, its result)."""
    result, done = {}, threading.Event()

    def run():
        result["r"] = send()
        done.set()

    threading.Thread(target=run).start()
    latencies = []
    while not done.is_set():
        start = time.perf_counter()
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.02)
    return latencies, result["r"]


def test_health_answers_while_a_5mb_prompt_is_refused(strict):
    """5 MB fits the 8 MB body limit; the prompt byte bound refuses it without tokenizing."""
    url = strict[0]
    prompt = "hello world " * (5 * 10**6 // 12)
    latencies, r = _health_while(url, lambda: _post(url, {"model": NAME, "prompt": prompt, "max_tokens": 1}))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert latencies and max(latencies) < 1.0, f"/health took up to {max(latencies):.2f}s"
    print(f"\n/health during a 5 MB prompt: {len(latencies)} polls, max {max(latencies) * 1e3:.0f} ms")


def test_body_over_the_limit_is_413_before_parsing(strict):
    url = strict[0]
    big = b'{"model": "tiny", "prompt": "' + b"x" * (BODY_LIMIT + 10) + b'"}'
    latencies, r = _health_while(url, lambda: httpx.post(url + "/v1/completions", content=big, headers=AUTH,
                                                         timeout=60))
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    assert max(latencies, default=0) < 1.0

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(BODY_LIMIT // 2**20 + 2):
            yield b"x" * 2**20

    r = httpx.post(url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert r.status_code == 413
    assert metric(url, 'pagedexperts_refused_requests_total{code="request_too_large",status="413"}') >= 2


def _open_stream(url, prompt, lines: list, started: threading.Event | None = None, *, auth=True, **body):
    """A thread streaming a LONG completion of ``prompt`` (``body`` overrides) into ``lines``:
    the status code, then each non-empty line; ``started`` set once the status is in."""
    def run():
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "prompt": prompt, **body},
                          headers=AUTH if auth else None, timeout=60) as r:
            lines.append(r.status_code)
            if started is not None:
                started.set()
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    t = threading.Thread(target=run)
    t.start()
    return t


def _wait(cond, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cond()


def test_queue_full_is_429_with_retry_after(strict):
    url, app = strict[0], strict[1]
    sched = app.state.scheduler
    a, b = [], []
    ta = _open_stream(url, PROMPTS[0], a, threading.Event())
    _wait(lambda: sched.num_running == 1)
    tb = _open_stream(url, PROMPTS[1], b, threading.Event())
    _wait(lambda: sched.num_waiting == 1)
    r = _post(url, {"model": NAME, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
    assert "--max-queued-requests" in r.json()["error"]["message"]
    assert metric(url, 'pagedexperts_refused_requests_total{code="queue_full",status="429"}') == 1
    for req in list(sched._running) + list(sched._waiting):
        sched.cancel(req)
    ta.join(30)
    tb.join(30)
    _wait(lambda: sched.num_running == 0 and sched.num_waiting == 0)


def test_zz_graceful_shutdown(strict):
    """Running and queued streams each get a final event and [DONE]; new requests 503."""
    url, app = strict[0], strict[1]
    sched = app.state.scheduler
    running, queued = [], []
    t1 = _open_stream(url, PROMPTS[2], running, threading.Event())
    _wait(lambda: sched.num_running == 1 and len(running) > 2)
    t2 = _open_stream(url, PROMPTS[3], queued, threading.Event())
    _wait(lambda: sched.num_waiting == 1)
    drain = threading.Thread(target=app.state.serving.begin_shutdown)
    drain.start()
    _wait(lambda: not app.state.serving.lifecycle.admitting)
    r = _post(url, {"model": NAME, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert httpx.get(url + "/health").status_code == 503
    drain.join(10)
    t1.join(10)
    t2.join(10)
    for lines in (running, queued):
        assert lines[0] == 200
        assert lines[-1] == "data: [DONE]", lines[-3:]
        final = json.loads(lines[-2][6:])
        assert final["error"]["code"] == "server_shutting_down", final
    assert sched.stats.aborted == 2


@pytest.mark.slow
def test_sigterm_drains_a_real_server(tmp_path):
    """``pagedexperts serve`` under SIGTERM: streams end with a final event and [DONE], the
    trace is saved, uvicorn finishes within seconds (the 0.5 s drain, not its 5 s wait for
    connections), and the process exits 0, not 143 (the drain was the clean stop asked for;
    uvicorn would re-raise the signal). The interpreter's own teardown after that is not timed."""
    import signal

    trace = tmp_path / "trace.npz"
    proc, url = _serve_process("--shutdown-timeout", "0.5", "--record-trace", str(trace))
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), x) for x in proc.stdout), daemon=True)
    reader.start()
    try:
        streams, threads = _one_running_one_queued(url)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        for t in threads:
            t.join(30)
        assert proc.wait(60) == 0
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(x for _, x in lines)
    for stream in streams:  # 2 x 450 tokens take far longer than the 0.5 s drain: both are cut
        assert stream[-1] == "data: [DONE]", (stream[-3:], log[-2000:])
        assert json.loads(stream[-2][6:]).get("error", {}).get("code") == "server_shutting_down", (stream[-2], log[-1500:])
    finished = [t for t, x in lines if "Finished server process" in x]
    assert finished and finished[0] - sent < 4.0, f"uvicorn finished {finished[0] - sent:.1f}s after SIGTERM" \
        if finished else log[-1500:]
    assert trace.exists(), log[-2000:]


def _serve_process(*args: str):
    """``pagedexperts serve`` of the bundled model in a child process on a free loopback port
    (--max-running-requests 1, K = 8, 1 thread) with ``args`` added; (Popen, url), not yet up."""
    import os
    import socket
    import subprocess
    import sys

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "pagedexperts.cli", "serve", "--port", str(port), "--served-model-name", NAME,
           "--max-running-requests", "1", *args, "--model-path", str(MODEL_PATH), "--num-resident", "8"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _one_running_one_queued(url):
    """Once the server is up, two long streams: wait until one streams and the other waits
    in the queue; (the two streams' lines, their threads)."""
    _wait(lambda: _up(url), timeout_s=120)
    streams = [[], []]
    threads = [_open_stream(url, PROMPTS[i], streams[i], auth=False, max_tokens=450) for i in range(2)]
    _wait(lambda: max(map(len, streams)) > 2 and httpx.get(url + "/health").json()["waiting"] == 1, 30)
    return streams, threads


def _up(url) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_second_signal_ends_streams_at_once_with_final_events(tmp_path):
    """A second SIGTERM during the drain (--shutdown-timeout 60) does not wait out the
    timeout, nor cut the streams bare: each gets its final event and [DONE] within seconds."""
    import signal

    proc, url = _serve_process("--shutdown-timeout", "60")
    try:
        streams, threads = _one_running_one_queued(url)
        proc.send_signal(signal.SIGTERM)
        _wait(lambda: httpx.get(url + "/health").status_code == 503)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        for t in threads:
            t.join(30)
        proc.wait(60)
        exit_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    for lines in streams:
        assert lines[-1] == "data: [DONE]", (lines[-3:], log[-2000:])
        assert json.loads(lines[-2][6:]).get("error", {}).get("code") == "server_shutting_down", lines[-2]
    assert exit_s < 3.0, f"exit took {exit_s:.1f}s after the second SIGTERM"
