"""The request body limit at its edge (issue 33 item 17): a body of exactly ``--max-body-bytes``
is admitted whole, one byte more is answered 413, whether the size is declared
(Content-Length) or counted as the chunks arrive (no Content-Length).

Drives ``serving.admission.Admission`` as ASGI directly around an app that echoes the body's
size: no model, no server, milliseconds.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedexperts.serving.admission import Admission
from support.asgi_echo import _echo_size

LIMIT = 1000  # --max-body-bytes of these tests


def _request(size: int, *, declared: bool, chunk: int = 300) -> tuple[int, dict, list]:
    """POST a body of ``size`` bytes through Admission(max_body_bytes=LIMIT), in chunks of
    ``chunk`` bytes, with Content-Length when ``declared``: (status, JSON body, refusals)."""
    body = b"x" * size
    headers = [(b"content-type", b"application/json")]
    if declared:
        headers.append((b"content-length", str(size).encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
             "query_string": b"", "root_path": ""}
    pieces = [body[i:i + chunk] for i in range(0, size, chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent, refused = [], []

    async def send(msg):
        sent.append(msg)

    middleware = Admission(_echo_size, max_body_bytes=LIMIT, api_key=None,
                           refuse=lambda method, path, exc: refused.append(exc))
    asyncio.run(middleware(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload), refused


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_of_exactly_the_limit_is_admitted_whole(declared):
    status, payload, refused = _request(LIMIT, declared=declared)
    assert (status, payload, refused) == (200, {"received": LIMIT}, [])


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_one_byte_over_the_limit_is_413_naming_the_flag(declared):
    status, payload, refused = _request(LIMIT + 1, declared=declared)
    got = f"is {LIMIT + 1} bytes" if declared else f"(chunked) passed {LIMIT} bytes before its end"
    assert status == 413 and payload["error"]["code"] == "request_too_large"
    assert payload["error"]["message"] == f"request body {got}; the limit is {LIMIT} bytes (--max-body-bytes)"
    assert [e.status for e in refused] == [413]
