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
  connection, which closes after the response. A client that closed entirely looks the same
  until a write fails, so its non-streamed request runs to completion (a stream is cancelled
  at the next chunk it cannot take).

Does not: route, validate or answer requests (``api_server``, ``handlers``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("pagedexperts.server")

DEFAULT_HEADER_TIMEOUT_S = 5.0  # nginx's client_header_timeout is 60 s; a few seconds suffice on a LAN
DEFAULT_MAX_CONNECTIONS = 1024


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
            keeps the transport open), then close it. Otherwise close as uvicorn does."""
            if self.cycle is not None and not self.cycle.response_complete and self.conn.their_state is h11.DONE:
                self.cycle.keep_alive = False
                return True
            return None

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
