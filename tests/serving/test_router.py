"""Two ``pagedexperts serve`` replicas behind sglang-router and behind vllm-router, on loopback.

Each replica is its own process (the CLI, as deployed); the router is the project's own binary
(PyPI ``sglang-router`` / ``vllm-router``, Rust wheels), found as ``$PAGEDEXPERTS_SGLANG_ROUTER``
/ ``$PAGEDEXPERTS_VLLM_ROUTER``, on PATH, or in ``.router-venv/bin/`` of the repository; each
case skips, saying how to install it, when its binary is not there. What it shows: the router
registers both replicas (sglang-router from their /health, /server_info, /model_info, under
the served model name; vllm-router from /health, model "unknown"); a load
through the router (completions, chat and the official client's ``responses.create``,
streamed and not) completes with no error and is shared by both (round robin); after one
replica is killed (SIGKILL), the same load still completes with no error, all of it on the
other; each live replica's /metrics scrapes, and its request counters add up to what was sent.
Without the router, ``test_worker_info_is_what_the_router_reads`` checks the two bodies the
router reads when it registers a replica.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.serving_fixtures import CONTEXT, HAVE_MODEL, MAX_RUNNING, MODEL_PATH, NAME, httpx, one_thread, serve  # noqa: F401
from support.serving_fixtures import client as openai_client

from pagedexperts.serving.handlers import ServeConfig  # noqa: E402  (after the server extra's importorskip)
from support.paths import ROOT

REPO = ROOT
INSTALL = "python3 -m venv .router-venv && .router-venv/bin/pip install 'sglang-router==0.3.2' 'vllm-router==0.1.17'"
# name -> (environment variable naming its binary, the arguments before the router's flags)
ROUTERS = {"sglang-router": ("PAGEDEXPERTS_SGLANG_ROUTER", ["launch"]), "vllm-router": ("PAGEDEXPERTS_VLLM_ROUTER", [])}
START_S = 240  # replicas and router up (model load, router registration), under a loaded CI machine
REQUESTS = 12  # per load phase
CLIENTS = 4


def _router_binary(name: str) -> str | None:
    for candidate in (os.environ.get(ROUTERS[name][0]), shutil.which(name), str(REPO / ".router-venv" / "bin" / name)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")


@pytest.fixture(scope="module")
def replica():
    """One replica in this process, configured as the CLI configures it (``model_path`` set)."""
    yield from serve(ServeConfig(NAME, MAX_RUNNING, CONTEXT, model_path=str(MODEL_PATH)))


def test_worker_info_is_what_the_router_reads(replica):
    """/server_info and /model_info in SGLang's field names: the router takes the model id from
    ``served_model_name`` and loads the tokenizer from ``tokenizer_path`` (a local directory)."""
    url, app = replica[0], replica[1]
    model = httpx.get(url + "/model_info", timeout=10).json()
    assert model["served_model_name"] == NAME and model["is_generation"] is True
    assert Path(model["tokenizer_path"]) == MODEL_PATH and (Path(model["tokenizer_path"]) / "tokenizer.json").exists()
    assert model["model_type"] == json.loads((MODEL_PATH / "config.json").read_text())["model_type"]
    info = httpx.get(url + "/server_info", timeout=10).json()
    runtime = app.state.serving.model.pagedexperts
    assert info["served_model_name"] == NAME and info["model_path"] == str(MODEL_PATH)
    assert (info["context_length"], info["max_running_requests"]) == (CONTEXT, MAX_RUNNING)
    assert (info["num_resident"], info["top_k"], info["num_experts"]) == (runtime.num_resident, runtime.top_k,
                                                                          runtime.num_experts)
    resolved = info["resolved"]  # the load's resolved record: K as given or by the default rule, host-planned on a CPU
    given = runtime.config.num_resident
    assert resolved["num_resident"] == (given if given is not None else max(runtime.top_k, runtime.num_experts // 4))
    assert resolved["reasons"]["num_resident"] == f"--num-resident {given}" if given is not None else (
        resolved["reasons"]["num_resident"].startswith("the default max(top_k, E // 4)"))
    assert (resolved["decide"], resolved["reasons"]["decide"]) == ("host", "auto: host on cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica(port: int, log: Path) -> subprocess.Popen:
    cli = Path(sys.executable).with_name("pagedexperts")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen([str(cli), "serve", "--model-path", str(MODEL_PATH), "--served-model-name", NAME,
                             "--port", str(port), "--context-length", "256", "--max-running-requests", "4"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _router(name: str, port: int, metrics_port: int, workers: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([_router_binary(name), *ROUTERS[name][1], "--host", "127.0.0.1", "--port", str(port),
                             "--worker-urls", *workers, "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
                             "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1",
                             "--health-check-interval-secs", "1"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait(what: str, ok, logs: list[Path]) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in logs)
    raise AssertionError(f"{what} not ready within {START_S}s\n{tails}")


def _healthy_workers(router: str) -> set[str]:
    return {w["url"] for w in httpx.get(router + "/workers", timeout=5).json()["workers"] if w["is_healthy"]}


def _requests_total(url: str) -> float:
    """The sum of ``pagedexperts_requests_total`` over endpoints and outcomes (raises if unscrapable)."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and "pagedexperts_paging_hits_total" in r.text
    return sum(float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
               if line.startswith("pagedexperts_requests_total{"))


def _one(router: str, i: int) -> str:
    """One request through the router, by kind; returns '' when it completed, else what went wrong."""
    kind = ("completions", "chat", "responses")[i % 3]
    return f"{kind}: {error}" if (error := _attempt(router, i)) else ""


def _attempt(router: str, i: int) -> str:
    try:
        if i % 3 == 0:
            r = httpx.post(router + "/v1/completions", json={"model": NAME, "prompt": "ROMEO:", "max_tokens": 4},
                           timeout=60)
            return "" if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] else r.text[:200]
        if i % 3 == 1:
            r = httpx.post(router + "/v1/chat/completions", timeout=60, json={
                "model": NAME, "messages": [{"role": "user", "content": "JULIET:"}], "max_tokens": 4})
            return "" if r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None else r.text[:200]
        c = openai_client(router)
        if i % 2:
            kinds = [e.type for e in c.responses.create(model=NAME, input="KING:", max_output_tokens=4, stream=True)]
            return "" if kinds[-1] in ("response.completed", "response.incomplete") else str(kinds)
        resp = c.responses.create(model=NAME, input="KING:", max_output_tokens=4)
        return "" if resp.usage.output_tokens >= 1 else resp.model_dump_json()
    except Exception as exc:  # counted and shown, never hidden
        return f"{type(exc).__name__}: {exc}"[:200]


def _load(router: str) -> list[str]:
    with ThreadPoolExecutor(CLIENTS) as pool:
        return [e for e in pool.map(lambda i: _one(router, i), range(REQUESTS)) if e]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ROUTERS))
def test_two_replicas_behind_a_router(tmp_path, name):
    if _router_binary(name) is None:
        pytest.skip(f"{name} not found (install: {INSTALL}, or set {ROUTERS[name][0]} to its binary)")
    ports = [_free_port() for _ in range(4)]
    workers = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    router = f"http://127.0.0.1:{ports[2]}"
    logs = [tmp_path / "replica0.log", tmp_path / "replica1.log", tmp_path / "router.log"]
    procs = [_replica(ports[0], logs[0]), _replica(ports[1], logs[1])]
    try:
        for w in workers:
            _wait(w, lambda: httpx.get(w + "/health", timeout=5).status_code == 200, logs)
        procs.append(_router(name, ports[2], ports[3], workers, logs[2]))
        _wait(f"{name} with both replicas", lambda: _healthy_workers(router) == set(workers), logs)
        assert [m["id"] for m in httpx.get(router + "/v1/models", timeout=5).json()["data"]] == [NAME]

        before = [_requests_total(w) for w in workers]
        assert _load(router) == []
        share = [_requests_total(w) - b for w, b in zip(workers, before)]
        assert sum(share) == REQUESTS and min(share) >= REQUESTS // 2 - 1, share  # round robin: about half each

        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(30)
        survivor = _requests_total(workers[0])
        at_once = _load(router)  # right after the kill, while health checks (every second) may not have seen it
        print(f"{name}, right after the kill: {len(at_once)} of {REQUESTS} failed {at_once}")
        # sglang-router retries a failed request on the other replica, but not every time (1 of
        # about 6 fresh-clone runs had one request fail right after the kill, on its call to the
        # killed replica); nothing may fail on the survivor.
        assert not any(workers[0] in e for e in at_once), at_once
        _wait(f"{name} marking the killed replica unhealthy", lambda: workers[1] not in _healthy_workers(router), logs)
        survivor = _requests_total(workers[0])
        assert _load(router) == []
        assert _requests_total(workers[0]) - survivor == REQUESTS  # the killed replica's share moved over
        with pytest.raises(httpx.ConnectError):
            httpx.get(workers[1] + "/metrics", timeout=5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
