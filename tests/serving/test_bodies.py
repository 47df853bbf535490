"""Request bodies and probes on a full connection table, on 127.0.0.1 with raw sockets (the
hostile clients) and httpx: probes (/health, /metrics; GET and HEAD) answered while every
connection is held by a slow body, a body trickled in under the between-reads timeout cut at
its whole-body deadline, no 408 after a 413 on the same connection, a body the app has not read
yet (flow control) never answered 408, and an unparsable Content-Length answered 400 in OpenAI's
JSON shape. Every wait is bounded.

Server ``timed``: ``max_connections`` 8, ``body_timeout_s`` 1.0, ``body_deadline_s`` 2.5,
``max_body_bytes`` 4096. The flow-control test runs its own ASGI app (one that reads the body
late) under the same protocol class.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from support.serving_fixtures import CONTEXT, HAVE_MODEL, MODEL_PATH, NAME, httpx, one_thread, serve  # noqa: F401
from pagedexperts.serving.connections import uvicorn_config
from pagedexperts.serving.handlers import ServeConfig

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")
CONNECTIONS = 8
BODY_TIMEOUT_S = 1.0
BODY_DEADLINE_S = 2.5
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def timed():
    yield from serve(ServeConfig(NAME, 2, CONTEXT, max_connections=CONNECTIONS, body_timeout_s=BODY_TIMEOUT_S,
                                 body_deadline_s=BODY_DEADLINE_S, max_body_bytes=BODY_LIMIT))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _post_head(length: int | str, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


def _until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """(everything the server wrote until it closed ``sock``, seconds it took), reading at most ``limit_s``."""
    start, data = time.monotonic(), b""
    sock.settimeout(0.2)
    while time.monotonic() - start < limit_s:
        try:
            part = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if not part:
            break
        data += part
    return data, time.monotonic() - start


def _responses(data: bytes) -> list[bytes]:
    """The status lines in ``data`` (each HTTP/1.1 response written on the connection)."""
    return [line for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


def test_probes_answer_over_a_full_connection_table(timed):
    """8 sockets send headers (Content-Length 1000) and 10 bytes, then a byte every 0.3 s: every
    connection of --max-connections 8 is held. /health (GET, HEAD) and /metrics still answer 200
    (a router must not mark a serving replica down); an API request gets the cap's 503."""
    url = timed[0]
    held = [socket.create_connection(("127.0.0.1", _port(url)), timeout=10) for _ in range(CONNECTIONS)]
    try:
        for s in held:
            s.sendall(_post_head(1000) + b'{"model": ')

        def feed():  # keeps each body under the between-reads timeout
            for s in held:
                s.sendall(b" ")

        time.sleep(0.2)
        for probe in (lambda: httpx.get(url + "/health", timeout=5), lambda: httpx.head(url + "/health", timeout=5),
                      lambda: httpx.get(url + "/metrics", timeout=5)):
            feed()
            r = probe()
            assert r.status_code == 200, (r.status_code, r.text[:200])
        feed()
        r = httpx.get(url + "/v1/models", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
        assert httpx.get(url + "/health", timeout=5).json()["status"] == "ok"
    finally:
        for s in held:
            s.close()


def test_head_health_is_200_without_a_body(timed):
    r = httpx.head(timed[0] + "/health", timeout=5)
    assert r.status_code == 200 and r.content == b""


def test_a_trickled_body_is_cut_at_its_deadline(timed):
    """One byte every 0.5 s never trips the 1 s between-reads timeout; the whole-body deadline
    (2.5 s after the headers) answers 408 naming --body-deadline and closes the connection."""
    with socket.create_connection(("127.0.0.1", _port(timed[0])), timeout=10) as s:
        s.sendall(_post_head(1000) + b"{")
        start, data = time.monotonic(), b""
        while time.monotonic() - start < BODY_DEADLINE_S + 3 and not data:
            time.sleep(BODY_TIMEOUT_S / 2)
            try:
                s.sendall(b" ")
            except OSError:
                break
            s.setblocking(False)
            try:
                data = s.recv(65536)
            except BlockingIOError:
                pass
            finally:
                s.setblocking(True)
        rest, _ = _until_closed(s, 3)
        cut_s = time.monotonic() - start
    head, _, body = (data + rest).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), (head, cut_s)
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "--body-deadline" in err["message"], err
    assert BODY_DEADLINE_S - 0.2 < cut_s < BODY_DEADLINE_S + 2, cut_s


def test_no_408_after_a_413_on_the_same_connection(timed):
    """A declared oversized body is answered 413 from its header; the rest then stalls past the
    body timeout: the connection closes with that one answer, no 408 written after it."""
    with socket.create_connection(("127.0.0.1", _port(timed[0])), timeout=10) as s:
        s.sendall(_post_head(5_000_000) + b"{")
        data, closed_s = _until_closed(s, BODY_TIMEOUT_S + 4)
    assert _responses(data) == [b"HTTP/1.1 413 Request Entity Too Large"], data[:400]
    assert b"request_timeout" not in data
    assert closed_s < BODY_TIMEOUT_S + 3, "the connection was not closed after the stall"


@pytest.mark.parametrize("length", ["-5", "1" * 26, "12, 13"])
def test_an_unparsable_content_length_is_a_json_400(timed, length):
    """The HTTP parser's refusal in OpenAI's JSON shape with its reason, not uvicorn's plain text."""
    with socket.create_connection(("127.0.0.1", _port(timed[0])), timeout=10) as s:
        s.sendall(_post_head(length) + b"{}")
        data, _ = _until_closed(s, 5)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), data[:300]
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_http_request" and err["type"] == "invalid_request_error", err
    assert "Content-Length" in err["message"], err


def _late_reader(wait_s: float):
    """An ASGI app that reads its request body only ``wait_s`` after the request arrived (as an
    app busy elsewhere would), then answers the byte count (``test_body_limit``'s echo)."""
    from support.asgi_echo import _echo_size

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await asyncio.sleep(wait_s)
            await _echo_size(scope, receive, send)

    return app


def test_a_body_the_app_has_not_read_is_not_timed_out():
    """A 1 MB body sent at once: uvicorn pauses reading past its 64 KiB buffer until the app
    reads, which it does 2.5 body timeouts later. The client stalled nothing: 200 with every
    byte, no 408."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn_config(_late_reader(2.5 * BODY_TIMEOUT_S), body_timeout_s=BODY_TIMEOUT_S,
                                        body_deadline_s=BODY_TIMEOUT_S * 10, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.02)
        size = 2**20
        r = httpx.post(f"http://127.0.0.1:{sock.getsockname()[1]}/", content=b"x" * size, timeout=30)
        assert (r.status_code, r.json()) == (200, {"received": size})
    finally:
        srv.should_exit = True
        thread.join(10)
