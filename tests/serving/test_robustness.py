"""Found by trying to break the server as clients and attackers would (see the module's tests):
a request that can never fit the queue, a client leaving while it sends its body, a request
finishing its admission after a shutdown began, the Bearer scheme's case.

One server here: ``--max-running-requests 1``, ``--max-queued-requests 2``, ``--api-key``.
The shutdown test ends the module.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from support.serving_fixtures import CONTEXT, HAVE_MODEL, MODEL_PATH, NAME, httpx, metric, one_thread, serve  # noqa: F401
from pagedexperts.serving.handlers import ServeConfig

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUEUE = 2


@pytest.fixture(scope="module")
def small():
    yield from serve(ServeConfig(NAME, 1, CONTEXT, max_queued_requests=QUEUE, api_key=KEY, shutdown_timeout_s=0.2))


def test_more_sequences_than_the_queue_holds_is_400_not_429(small):
    """429 means 'retry later'; a request needing more places than an idle server has (the
    running place + --max-queued-requests) never fits, so clients that retry 429 (the openai
    client does) would retry in vain. One that fits an idle server is served."""
    url = small[0]
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"model": NAME, "prompt": ["a", "b"], "n": 2, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and "= 4 sequences; at most 3 fit an idle server" in err["message"]
    assert "--max-queued-requests" in err["message"] and "--max-running-requests" in err["message"]
    ok = httpx.post(url + "/v1/completions", headers=AUTH, timeout=30,
                    json={"model": NAME, "prompt": "a", "n": QUEUE + 1, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == QUEUE + 1


def test_client_leaving_while_sending_its_body_is_not_a_500(small, caplog):
    url = small[0]
    internal = 'pagedexperts_refused_requests_total{code="internal_error",status="500"}'
    before = metric(url, internal, default=0.0)
    port = int(url.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
    gone = 'pagedexperts_refused_requests_total{code="client_disconnected",status="499"}'
    with caplog.at_level("WARNING", logger="pagedexperts.serving"):
        for framing, part in ((b"content-length: 1000", b'{"model"'),  # read by the route
                              (b"transfer-encoding: chunked", b'8\r\n{"model"\r\n')):  # by the body limit
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(head + framing + b"\r\n\r\n" + part)
                time.sleep(0.3)
        deadline = time.monotonic() + 5
        while metric(url, gone, default=0.0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert metric(url, gone, default=0.0) == 2
    assert metric(url, internal, default=0.0) == before
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_bearer_scheme_is_case_insensitive(small):
    """RFC 7235 section 2.1: the auth-scheme is case-insensitive; the key itself is not."""
    url = small[0]
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"BEARER {KEY}"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY.upper()}"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": KEY}).status_code == 401


def test_zz_request_whose_admission_ends_after_shutdown_gets_503(small):
    """A request still being validated when the drain finishes must not be queued on the
    stopped scheduler (its client would wait forever): it gets 503 + Retry-After."""
    url, app = small[0], small[1]
    serving = app.state.serving
    admit = serving.admit

    def admit_then_shut_down(raw, chat):
        prepared = admit(raw, chat)
        serving.begin_shutdown(0)  # the drain completes while this request is in admission
        return prepared

    serving.admit = admit_then_shut_down
    try:
        r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=10,
                       json={"model": NAME, "prompt": "x", "max_tokens": 2})
    finally:
        serving.admit = admit
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "server_shutting_down"
    assert json.loads(httpx.get(url + "/health").text)["status"] == "shutting_down"
