"""Admission before any request is handled: the API key, the body-size limit, OpenAI's error shape.

Owns: the ``Admission`` ASGI middleware (the connection cap's 503, the optional Bearer API key
on /v1/*, then the body limit, before routing: a Content-Length over the limit is answered 413
from the header; a chunked body is counted as it comes and never kept), ``error_response``
(``{"error": {"message", "type", "param", "code"}}``), the shared refusals (``shutting_down``:
503 + Retry-After; ``client_disconnected``: 499) and the default body limit. Does not: parse or
validate a body (``validation``) or count refusals (the caller's ``refuse``).
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from pagedexperts.serving.connections import OVER_CAP_SCOPE_KEY
from pagedexperts.serving.validation import MAX_PROMPT_BYTES_PER_TOKEN
from pagedexperts.serving.protocol import ApiError

RETRY_AFTER_S = 1  # Retry-After of 429 (queue full) and 503 (shutting down or over the connection cap)
_GONE = object()  # Admission._read_bounded: the client disconnected mid-body

def default_max_body_bytes(context_length: int) -> int:
    """The default request body limit: 1 MiB plus 8x the longest prompt text admitted, context x
    MAX_PROMPT_BYTES_PER_TOKEN (JSON escapes take up to 6 bytes per byte of text; chat adds message framing)."""
    return 2**20 + 8 * context_length * MAX_PROMPT_BYTES_PER_TOKEN


def error_response(exc: ApiError) -> JSONResponse:
    """OpenAI's error shape for ``exc``."""
    kind = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
        exc.status, "invalid_request_error" if exc.status < 500 else "server_error")
    body = {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def shutting_down() -> ApiError:
    """The 503 + Retry-After of a request that arrives, or finishes its admission, while the server drains."""
    return ApiError("the server is shutting down; retry on another replica or later", status=503,
                    code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})


def over_connection_cap(max_connections: int) -> ApiError:
    """The 503 + Retry-After of a request on a connection beyond --max-connections."""
    return ApiError(f"the server has {max_connections} connections open, its limit (--max-connections); "
                    "retry later", status=503, code="too_many_connections",
                    headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})


def client_disconnected() -> ApiError:
    """What a client that left before its request body arrived is counted as (nobody reads it)."""
    return ApiError("the client closed the connection before its request body arrived", status=499,
                    code="client_disconnected")


def bearer_matches(header: bytes, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>``: the scheme is
    case-insensitive (RFC 7235, section 2.1), the key compared in constant time."""
    scheme, _, token = header.decode("latin-1").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"),
                                                              api_key.encode("utf-8"))


class Admission:
    """ASGI middleware run before routing: the connection cap, the API key on /v1/*, then the
    body-size limit (see the module docstring); ``refuse`` logs and counts each refusal.
    """

    def __init__(self, app, *, max_body_bytes: int, api_key: str | None, refuse) -> None:
        self.app, self.max_body_bytes, self.api_key, self.refuse = app, max_body_bytes, api_key, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if OVER_CAP_SCOPE_KEY in scope:
            return await self._answer(scope, receive, send, over_connection_cap(scope[OVER_CAP_SCOPE_KEY]))
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1/") and \
                not bearer_matches(headers.get(b"authorization", b""), self.api_key):
            return await self._answer(scope, receive, send, ApiError(
                "missing or wrong API key: send 'Authorization: Bearer <key>' (the server's --api-key)",
                status=401, code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._answer(scope, receive, send, self._too_large(int(length)))
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_bounded(receive)
            if body is None:
                return await self._answer(scope, receive, send, self._too_large(None))
            if body is _GONE:
                return self.refuse(scope["method"], scope["path"], client_disconnected())
            receive = self._replay(body, receive)
        return await self.app(scope, receive, send)

    def _too_large(self, size: int | None) -> ApiError:
        """The 413 of a body of ``size`` bytes (its Content-Length), or None: a chunked body that
        passed the limit while it was read."""
        got = f"request body is {size} bytes" if size is not None else \
            f"request body (chunked) passed {self.max_body_bytes} bytes before its end"
        return ApiError(f"{got}; the limit is {self.max_body_bytes} bytes (--max-body-bytes)",
                        status=413, code="request_too_large")

    async def _answer(self, scope, receive, send, exc: ApiError):
        self.refuse(scope["method"], scope["path"], exc)
        await error_response(exc)(scope, receive, send)

    async def _read_bounded(self, receive) -> bytes | object | None:
        """The whole body; None when it passes the limit, ``_GONE`` when the client left."""
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left before its body was complete
                return _GONE
            size += len(msg.get("body", b""))
            if size > self.max_body_bytes:
                return None
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                return b"".join(chunks)

    @staticmethod
    def _replay(body: bytes, receive):
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay
