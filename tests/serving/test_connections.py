"""Connections on 127.0.0.1: slow and idle sockets are closed after the header timeout while
normal clients are served, stalled bodies after the body timeout, a declared oversized body
answered 413 from its header, the connection cap (503 in OpenAI's shape), half-closed clients
answered, and the ``"usage": null`` of non-final stream chunks. Every loop is bounded.

Servers: ``guarded`` (``header_timeout_s`` 1.0, ``max_connections`` 40) and ``capped``
(4 running places, ``max_queued_requests`` 2, ``max_connections`` 8, ``body_timeout_s`` 1.0,
``max_body_bytes`` 4096).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from support.serving_fixtures import CONTEXT, HAVE_MODEL, MODEL_PATH, NAME, httpx, one_thread, serve  # noqa: F401
from pagedexperts.serving.connections import uvicorn_config
from pagedexperts.serving.handlers import ServeConfig

pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no model at {MODEL_PATH}")
HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 40
SLOW = 30  # slowloris sockets
CAPPED_CONNECTIONS = 8
BODY_TIMEOUT_S = 1.0
BODY_LIMIT = 4096
QUEUED = 2


@pytest.fixture(scope="module")
def guarded():
    yield from serve(ServeConfig(NAME, 4, CONTEXT, header_timeout_s=HEADER_TIMEOUT_S, max_connections=MAX_CONNECTIONS))


@pytest.fixture(scope="module")
def capped():
    yield from serve(ServeConfig(NAME, 4, CONTEXT, max_connections=CAPPED_CONNECTIONS, body_timeout_s=BODY_TIMEOUT_S,
                                 max_body_bytes=BODY_LIMIT, max_queued_requests=QUEUED))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset), without blocking."""
    sock.setblocking(False)
    try:
        return sock.recv(1024) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def _request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def test_slowloris_sockets_are_closed_and_others_served(guarded):
    url = guarded[0]
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    socks = [socket.create_connection(("127.0.0.1", _port(url))) for _ in range(SLOW)]
    idle = socket.create_connection(("127.0.0.1", _port(url)))  # sends nothing at all
    start, served_s, closed = time.monotonic(), [], set()
    for i in range(60):  # one header byte per socket every 0.1 s, for at most 6 s
        for j, s in enumerate(socks):
            if j not in closed:
                try:
                    s.send(head[i: i + 1])
                except OSError:
                    closed.add(j)
        if i % 10 == 5:  # a normal client, meanwhile
            t = time.monotonic()
            r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200
            served_s.append(time.monotonic() - t)
        closed |= {j for j, s in enumerate(socks) if j not in closed and _closed(s)}
        if len(closed) == SLOW and time.monotonic() - start > 2 * HEADER_TIMEOUT_S:
            break
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    assert len(closed) == SLOW, f"{SLOW - len(closed)} slow sockets still open after {elapsed:.1f}s"
    assert elapsed < HEADER_TIMEOUT_S + 4
    assert _closed(idle)
    assert max(served_s) < 5, f"normal clients waited {served_s}"
    for s in socks + [idle]:
        s.close()


def test_a_slow_next_request_on_a_kept_alive_connection_is_closed(guarded):
    """After a response, the next request's headers have the same timeout (uvicorn's keep-alive
    timer stops at the first byte)."""
    with socket.create_connection(("127.0.0.1", _port(guarded[0]))) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 3
        gone = False
        while time.monotonic() < deadline and not gone:
            try:
                s.send(b"G")
            except OSError:
                gone = True
            gone = gone or _closed(s)
            time.sleep(0.1)
        assert gone


def test_prompt_headers_are_not_cut(guarded):
    """A client that sends its headers in pieces within the timeout is answered."""
    with socket.create_connection(("127.0.0.1", _port(guarded[0]))) as s:
        for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
            s.sendall(part)
            time.sleep(HEADER_TIMEOUT_S / 4)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_connection_cap(guarded):
    url = guarded[0]
    held = [socket.create_connection(("127.0.0.1", _port(url))) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        r = httpx.get(url + "/v1/models", timeout=10)  # the 41st connection
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_connections", r.text  # OpenAI's shape, not uvicorn's text
        assert "--max-connections" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # probes are answered over the cap
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while httpx.get(url + "/v1/models", timeout=10).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 200


def _stalled_body(url: str, length: int) -> socket.socket:
    """A socket that sent a POST's headers declaring ``length`` body bytes, and one byte of it."""
    s = socket.create_connection(("127.0.0.1", _port(url)), timeout=10)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              f"content-length: {length}\r\n\r\n{{".encode())
    return s


def _answer(sock: socket.socket) -> bytes:
    """What the server wrote until it closed ``sock`` (bounded by the socket's timeout)."""
    data = b""
    for _ in range(100):
        try:
            part = sock.recv(65536)
        except OSError:
            break
        if not part:
            break
        data += part
    return data


def test_stalled_bodies_are_timed_out(capped):
    """8 bodies stalled at --max-connections 8 hold every connection (the next request gets 503);
    within the body timeout each gets a 408 in OpenAI's shape and requests are served again."""
    url = capped[0]
    socks = [_stalled_body(url, 100) for _ in range(CAPPED_CONNECTIONS)]
    try:
        start = time.monotonic()
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 503
        status = 503
        while status != 200 and time.monotonic() - start < BODY_TIMEOUT_S + 3:
            time.sleep(0.1)
            status = httpx.get(url + "/v1/models", timeout=10).status_code
        healthy_s = time.monotonic() - start
        assert status == 200, f"still {status} {healthy_s:.1f}s after {CAPPED_CONNECTIONS} stalled bodies"
        assert healthy_s < BODY_TIMEOUT_S + 1.5
        for s in socks:
            head, _, body = _answer(s).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), head
            assert json.loads(body)["error"]["code"] == "request_timeout"
    finally:
        for s in socks:
            s.close()


def test_a_body_sent_slowly_but_steadily_is_not_cut(capped):
    """The body timeout is between two reads, not for the whole body."""
    body = json.dumps({"model": NAME, "prompt": "ROMEO:", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", _port(capped[0])), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode())
        for i in range(0, len(body), len(body) // 3 + 1):  # 3 pieces over 1.8 x the timeout
            time.sleep(BODY_TIMEOUT_S * 0.6)
            s.sendall(body[i: i + len(body) // 3 + 1])
        assert _answer(s).startswith(b"HTTP/1.1 200")


def test_declared_oversized_body_is_answered_from_its_header(capped):
    """Content-Length over --max-body-bytes and a byte sent: 413 at once, not after the body."""
    with _stalled_body(capped[0], 5_000_000) as s:
        start = time.monotonic()
        s.settimeout(BODY_TIMEOUT_S / 2)  # well before the body timeout's 408
        head, _, body = _answer(s).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), f"{head[:40]!r} after {time.monotonic() - start:.2f}s"
        assert json.loads(body[: body.index(b"}}") + 2])["error"]["code"] == "request_too_large"
    payload = {"model": NAME, "prompt": "x" * (2 * BODY_LIMIT)}  # a client that sends it all still reads its 413
    r = httpx.post(capped[0] + "/v1/completions", json=payload, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("stream", [False, True])
def test_half_closed_client_is_answered(guarded, stream):
    """The client sends its request and shuts its write side (``nc -N``): it still gets the answer
    (a client gone entirely is still cancelled at once: test_server_api's non-streaming one)."""
    body = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0, "stream": stream}
    with socket.create_connection(("127.0.0.1", _port(guarded[0])), timeout=30) as s:
        s.sendall(_request("/v1/completions", body))
        s.shutdown(socket.SHUT_WR)
        data = b""
        for _ in range(1000):  # until the server closes
            part = s.recv(65536)
            if not part:
                break
            data += part
    probe = b"HTTP/1.1 100 Continue\r\n\r\n"  # the interim response that tells a half-close from a close
    assert data.startswith(probe) or stream, data[:200]
    head, _, payload = data.removeprefix(probe).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), data[:200]
    if stream:
        assert b"data: [DONE]" in payload and b'"finish_reason": "length"' in payload
    else:
        assert json.loads(payload)["choices"][0]["finish_reason"] == "length"


def test_usage_null_in_non_final_chunks(guarded):
    """With include_usage, every chunk but the last has ``"usage": null`` (OpenAI's shape)."""
    for path, extra in (("/v1/completions", {"prompt": "ROMEO:"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        for include in (True, False):
            body = {"model": NAME, "max_tokens": 5, "temperature": 0, "stream": True, **extra}
            if include:
                body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", guarded[0] + path, json=body, timeout=60) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
            if include:
                assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
                assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
            else:
                assert all("usage" not in c for c in chunks)


def test_a_burst_the_free_places_take_is_not_refused(capped):
    """4 running places + --max-queued-requests 2 on an idle server: 6 requests sent at once are
    all served (4 admitted at the next step, 2 wait), none answered 429."""
    from concurrent.futures import ThreadPoolExecutor

    from support.serving_fixtures import client

    c = client(capped[0])
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda p: c.completions.create(model=NAME, prompt=p, max_tokens=2).choices[0].text,
                              ["ROMEO:", "JULIET:", "KING:", "To be", "Now is", "But soft"]))
    assert len(texts) == 6


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="--header-timeout"):
        uvicorn_config(None, header_timeout_s=0)
    with pytest.raises(ValueError, match="--body-deadline must be > 0 seconds, got -1"):
        uvicorn_config(None, body_deadline_s=-1)
    with pytest.raises(ValueError, match="--max-connections"):
        uvicorn_config(None, max_connections=0)
    with pytest.raises(ValueError, match="--body-timeout"):
        uvicorn_config(None, body_timeout_s=0)
