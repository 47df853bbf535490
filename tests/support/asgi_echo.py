"""Shared by several test modules (moved from serving/test_body_limit.py)."""

from __future__ import annotations
import json


async def _echo_size(scope, receive, send):
    """The app behind the middleware: 200 with the number of body bytes it received."""
    size, more = 0, True
    while more:
        msg = await receive()
        size += len(msg.get("body", b""))
        more = msg.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps({"received": size}).encode()})
