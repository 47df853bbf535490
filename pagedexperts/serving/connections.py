"""Connection handling under uvicorn: header and body timeouts, the connection cap, half-closed clients.

Owns: ``uvicorn_config`` and the HTTP protocol class it selects, uvicorn's h11 protocol with
these changes (docs/server.md, "Connections"): request headers not complete
``header_timeout_s`` after the connection opened (or after its previous response) close it
(uvicorn's keep-alive timer is cancelled by any byte, so it does not cover this); a body with no byte for ``body_timeout_s``,
or not complete ``body_deadline_s`` after its headers, is answered 408 (a reader paused by flow
control is not timed out; an answered request gets no second answer); the rest of a body
answered before it was read is dropped up to ``MAX_DISCARDED_BODY_BYTES``; beyond
``max_connections`` a request reaches the app marked ``OVER_CAP_SCOPE_KEY`` (a JSON 503,
``admission``), probes (``PROBE_PATHS``) never; a request the parser refuses gets a JSON 400;
a half-closed client is answered (an interim ``100 Continue`` tells it from a gone one).
Does not: route, validate or answer requests (``api_server``, ``handlers``).
"""

from __future__ import annotations

import json
import logging
import socket

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 5.0  # nginx's client_header_timeout is 60 s; a few seconds suffice on a LAN
DEFAULT_BODY_TIMEOUT_S = 30.0  # nginx's client_body_timeout is 60 s, between two reads
DEFAULT_BODY_DEADLINE_S = 300.0  # the whole body after its headers; Node.js's server.requestTimeout is 300 s
DEFAULT_MAX_CONNECTIONS = 1024
MAX_DISCARDED_BODY_BYTES = 64 * 2**20  # the rest of an answered body read and dropped, then the connection closes
OVER_CAP_SCOPE_KEY = "pagedexperts.over_connection_cap"  # scope key of a request beyond --max-connections
PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"  # written to a half-closed client before its response
PROBE_WAIT_S = 0.05  # a reset from a closed peer on loopback or a LAN arrives well within this
PROBE_PATHS = ("/health", "/metrics")  # answered over the connection cap (GET / HEAD)


def json_error_response(status: int, reason: bytes, message: str, code: str) -> bytes:
    """A raw HTTP/1.1 error response in OpenAI's error shape that closes its connection (what the
    protocol writes itself, before or instead of the app: a 408, the parser's 400)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % (status, reason, len(body))) + body


def body_timeout_response(message: str) -> bytes:
    """The raw HTTP/1.1 408 written to a client whose request body stalled or is late (OpenAI's error shape)."""
    return json_error_response(408, b"Request Timeout", message, "request_timeout")


def protocol_class(header_timeout_s: float, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                   max_connections: int = DEFAULT_MAX_CONNECTIONS, body_deadline_s: float = DEFAULT_BODY_DEADLINE_S):
    """uvicorn's ``H11Protocol`` with the header and body timeouts, the connection cap and
    half-close handling (module docstring). uvicorn and h11 are imported here, lazily: they
    belong to the server extra."""
    import sys

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    stalled = f"no request body bytes received for {body_timeout_s:g} s; the limit is --body-timeout"
    late = f"the request body was not complete {body_deadline_s:g} s after its headers; the limit is --body-deadline"

    class GuardedH11Protocol(H11Protocol):
        """H11Protocol that closes connections whose headers or body are late, marks requests
        over the connection cap and answers half-closed connections."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._body_timer, self._deadline_timer, self._discarded, self._app = None, None, 0, self.app
            self._arm_header_timer()

        def handle_events(self) -> None:
            """uvicorn's, with the app of a request over the cap marked (uvicorn counts the same way)."""
            over = len(self.connections) > max_connections or len(self.tasks) > max_connections
            self.app = self._over_cap_app if over else self._app
            super().handle_events()

        async def _over_cap_app(self, scope, receive, send) -> None:
            if not (scope["path"] in PROBE_PATHS and scope["method"] in ("GET", "HEAD")):
                scope[OVER_CAP_SCOPE_KEY] = max_connections
            await self._app(scope, receive, send)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request h11 cannot parse, in OpenAI's JSON shape with h11's
            reason (called while h11's RemoteProtocolError is handled)."""
            exc = sys.exc_info()[1]
            reason = str(exc) if isinstance(exc, h11.RemoteProtocolError) and str(exc) else msg
            self.transport.write(json_error_response(400, b"Bad Request", f"invalid HTTP request: {reason}",
                                                     "invalid_http_request"))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            answered = self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY
            super().data_received(data)
            if self.transport.is_closing():
                return
            if self.conn.their_state is not h11.SEND_BODY:
                self._discarded = 0
                self._cancel_body_timers()
                return
            self._discarded += len(data) if answered else 0
            if self._discarded > MAX_DISCARDED_BODY_BYTES:
                logger.info("closing a connection from %s: over %d bytes of an answered body", self.client,
                            MAX_DISCARDED_BODY_BYTES)
                self.transport.close()
                return
            if self._deadline_timer is None:  # the body's first read: its whole-body deadline starts
                self._deadline_timer = self.loop.call_later(body_deadline_s, self._body_late, True)
            self._arm_body_timer()

        def _arm_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
            self._body_timer = self.loop.call_later(body_timeout_s, self._body_late, False)

        def _cancel_body_timers(self) -> None:
            for timer in (self._body_timer, self._deadline_timer):
                if timer is not None:
                    timer.cancel()
            self._body_timer = self._deadline_timer = None

        def _body_late(self, deadline: bool) -> None:
            """A body timer fired (the whole-body ``deadline``, or the stall between reads): answer
            408 (unless answered already) and close, except while flow control pauses the reader
            (the app has not read what came: not the client's fault), when the same check runs
            again ``body_timeout_s`` later."""
            if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
                return
            if self.flow.read_paused:
                timer = self.loop.call_later(body_timeout_s, self._body_late, deadline)
                if deadline:
                    self._deadline_timer = timer
                else:
                    self._body_timer = timer
                return
            message = late if deadline else stalled
            logger.info("closing a connection from %s: %s", self.client, message)
            if self.cycle is not None and not self.cycle.response_started:
                self.cycle.response_started = True  # the app's own answer, if any, is not written
                self.transport.write(body_timeout_response(message))
            self.transport.close()

        def _arm_header_timer(self) -> None:
            self._header_wait = self.cycle  # a new request replaces self.cycle once its headers are complete
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            waiting = self.cycle is self._header_wait and (self.cycle is None or self.cycle.response_complete)
            if waiting and not self.transport.is_closing():
                logger.info("closing a connection from %s: no complete request headers in %.1fs (header timeout)",
                            self.client, header_timeout_s)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._header_timer.cancel()
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            self._cancel_body_timers()
            super().connection_lost(exc)

        def eof_received(self):
            """Half-close after a whole request: keep the connection to write the answer (True
            keeps the transport open), then close it. Otherwise close as uvicorn does. Before
            the response starts, a ``100 Continue`` probes the peer: a client that closed
            entirely answers it with a reset, and is then treated as gone (its request is
            cancelled at once), as before."""
            if self.cycle is None or self.cycle.response_complete or self.conn.their_state is not h11.DONE:
                return None
            self.cycle.keep_alive = False
            if not self.cycle.response_started:
                self.transport.write(PROBE)  # an interim response: clients skip 1xx (RFC 9110, 15.2)
                self.loop.call_later(PROBE_WAIT_S, self._probe_answered)
            return True

        def _probe_answered(self) -> None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None and not self.transport.is_closing() and \
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):  # reset: the client is gone
                self.transport.abort()

    return GuardedH11Protocol


def uvicorn_config(app, *, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                   body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
                   max_connections: int = DEFAULT_MAX_CONNECTIONS, **kwargs):
    """A ``uvicorn.Config`` serving ``app`` with the guarded protocol; ``kwargs`` go to uvicorn.
    The connection cap is the protocol's (``OVER_CAP_SCOPE_KEY``), not uvicorn's ``limit_concurrency``.

    Raises ValueError for a header timeout, body timeout or body deadline <= 0, or a connection cap < 1.
    """
    import uvicorn

    for flag, value in (("--header-timeout", header_timeout_s), ("--body-timeout", body_timeout_s),
                        ("--body-deadline", body_deadline_s)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {value}")
    if max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {max_connections}")
    return uvicorn.Config(app, http=protocol_class(header_timeout_s, body_timeout_s, max_connections, body_deadline_s),
                          **kwargs)
