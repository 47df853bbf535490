"""Shared pieces of the server tests: the model, a served app on loopback, helpers.

One real server (uvicorn in a thread, loopback, a free port) per test module that asks for
``server``: the bundled model with K = top_k slots and ``--max-running-requests 4``. Tests
talk to it with the official ``openai`` client and raw ``httpx``. Imported by the
``test_server*.py`` modules (pytest finds the fixtures in their namespace).

``PAGEDEXPERTS_TEST_MODEL`` may name another directory with the bundled model's architecture
(development while the bundled model is being retrained); by default the bundled model.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from pagedexperts import bundled_model_path, load_model  # noqa: E402
from pagedexperts.generation.config import SamplingConfig  # noqa: E402
from pagedexperts.serving.api_server import create_app  # noqa: E402
from pagedexperts.serving.connections import uvicorn_config  # noqa: E402
from pagedexperts.serving.handlers import ServeConfig  # noqa: E402
from pagedexperts.engine.scheduler import BatchScheduler  # noqa: E402
from pagedexperts.engine.scheduler_config import SchedulerConfig  # noqa: E402

MODEL_PATH = Path(os.environ.get("PAGEDEXPERTS_TEST_MODEL") or bundled_model_path())
NAME = "tiny"
MAX_RUNNING = 4
CONTEXT = 256
MAX_TOKENS = 12
PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "First Citizen:\nBefore we proceed", "KING HENRY:",
           "To be, or not to be", "MENENIUS:\nWhat work", "But soft, what light", "Now is the winter"]

HAVE_MODEL = (MODEL_PATH / "config.json").exists()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine, 2 threads made steps 30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ref():
    """A second copy of the model (K = top_k) for in-process references; never served."""
    return load_model(MODEL_PATH, num_resident=_top_k())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The served model on 127.0.0.1 (a free port); yields (url, app, trace path, uvicorn server, thread)."""
    trace = tmp_path_factory.mktemp("serve") / "trace.npz"
    yield from serve(ServeConfig(NAME, MAX_RUNNING, CONTEXT, record_trace=str(trace)), trace)


def serve(config: ServeConfig, trace=None):
    """Serve a fresh copy of the model with ``config`` on loopback (a generator for fixtures)."""
    import uvicorn

    model, tokenizer = load_model(MODEL_PATH, num_resident=_top_k())
    app = create_app(model, tokenizer, config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn_config(app, header_timeout_s=config.header_timeout_s,
                                        body_timeout_s=config.body_timeout_s, body_deadline_s=config.body_deadline_s,
                                        max_connections=config.max_connections, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started, "server did not start"
    yield url, app, trace, srv, thread
    srv.should_exit = True
    thread.join(30)


def _top_k() -> int:
    return json.loads((MODEL_PATH / "config.json").read_text())["num_experts_per_tok"]


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metric(url, name: str, default: float | None = None) -> float:
    """A sample of /metrics by its full name with labels, e.g. 'x_total{layer="0"}'."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        raise AssertionError(f"{name} not in /metrics")
    return default


def schedule(model, tokenizer, prompts, *, max_running, max_tokens=MAX_TOKENS, **config):
    """Output token ids of ``prompts`` on a fixed schedule: all queued, then stepped."""
    sched = BatchScheduler(model, tokenizer, SchedulerConfig(max_running, CONTEXT, **config))
    return run_schedule(sched, tokenizer, prompts, max_tokens=max_tokens), sched.stats


def run_schedule(sched, tokenizer, prompts, *, max_tokens=MAX_TOKENS) -> list[list[int]]:
    """Queue ``prompts`` (greedy), step ``sched`` until idle; the output ids of each."""
    reqs = [sched.submit(tokenizer(p)["input_ids"], SamplingConfig(max_new_tokens=max_tokens), lambda e: None)
            for p in prompts]
    while sched.num_running or sched.num_waiting:
        sched.step()
    return [r.output_ids for r in reqs]


def assert_scored_prompt(model, events, prompt: list[int], *, top: int) -> None:
    """The one event of a scoring request (max_tokens 0, prompt logprobs, ``top`` alternatives):
    finished by length with no completion token, and its prompt logprobs equal to the
    log_softmax of one direct forward over ``prompt`` (1e-4; the first token has none), each
    position's ``top`` alternatives sorted by logprob."""
    (event,) = events
    assert (event.finish_reason, event.completion_tokens) == ("length", 0)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    got = event.prompt_logprobs
    assert [e.token_id for e in got] == prompt and got[0].logprob is None
    want = [lp[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    assert [e.logprob for e in got[1:]] == pytest.approx(want, abs=1e-4)
    assert all(len(e.top) == top and e.top[0][2] >= e.top[1][2] for e in got[1:])
