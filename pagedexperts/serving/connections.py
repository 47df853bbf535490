"""Connection handling under uvicorn: the header timeout, the connection cap, half-closed clients.

Owns: ``uvicorn_config`` (the uvicorn settings the server runs with) and the HTTP protocol
class it selects, uvicorn's h11 protocol with three changes:

- a connection whose request headers are not complete ``header_timeout_s`` after it opened
  (or after its previous response) is closed: a client sending one header byte at a time
  (slowloris) or nothing at all holds a connection for at most that long. uvicorn's own
  keep-alive timer is cancelled by any byte received, so it does not cover this.
- at most ``max_connections`` connections are open: beyond that a request gets uvicorn's 503
  (``limit_concurrency``, which counts the connection asking, hence the + 1).
- a client that half-closes (shuts its write side after sending the whole request, as
  ``printf ... | nc -N`` does) is answered: the end of its input does not close the
  connection, which closes after the response. A client that closed entirely sends the same
  end of input; an interim ``100 Continue`` written at once tells them apart (a closed peer
  answers it with a reset), so a gone client's request is still cancelled at once.

Does not: route, validate or answer requests (``api_server``, ``handlers``).
"""

from __future__ import annotations

import logging
import socket

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 5.0  # nginx's client_header_timeout is 60 s; a few seconds suffice on a LAN
DEFAULT_MAX_CONNECTIONS = 1024
PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"  # written to a half-closed client before its response
PROBE_WAIT_S = 0.05  # a reset from a closed peer on loopback or a LAN arrives well within this


def protocol_class(header_timeout_s: float):
    """uvicorn's ``H11Protocol`` with the header timeout and half-close handling (module
    docstring). uvicorn and h11 are imported here, lazily: they belong to the server extra."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        """H11Protocol that closes connections whose headers are late and answers half-closed ones."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

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
                   max_connections: int = DEFAULT_MAX_CONNECTIONS, **kwargs):
    """A ``uvicorn.Config`` serving ``app`` with the guarded protocol; ``kwargs`` go to uvicorn.

    Raises ValueError for a header timeout <= 0 or a connection cap < 1.
    """
    import uvicorn

    if not header_timeout_s > 0:
        raise ValueError(f"--header-timeout must be > 0 seconds, got {header_timeout_s}")
    if max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {max_connections}")
    return uvicorn.Config(app, http=protocol_class(header_timeout_s), limit_concurrency=max_connections + 1, **kwargs)
