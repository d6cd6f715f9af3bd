"""Client connections with bounds: how many may be open, and how long one may sit between requests.

aiohttp reads headers without a deadline and keeps idle connections for an hour by default, so a client
that opens connections and sends nothing, or sends its headers a byte at a time, holds a file descriptor
and a task each for as long as it likes. `ConnectionGuard` wraps each connection's aiohttp protocol:
  - beyond `max_connections` open ones, a new connection is answered 503 and closed at once;
  - a connection whose request has started arriving must complete its headers within `header_timeout`
    (the handler starting is the sign they did), or it is closed;
  - a connection with no request in flight and no bytes arriving is closed after `keepalive_timeout`.
The body has its own deadline inside the handler (`EngineServer.read_body`), where a 408 can be answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

log = logging.getLogger("ddtree.server")

_BUSY = json.dumps(
    {
        "error": {
            "message": "too many open connections; retry later",
            "type": "service_unavailable",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Retry-After: 1\r\nContent-Length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY
)


class ConnectionGuard:
    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        max_connections: int,
        header_timeout: float,
        keepalive_timeout: float,
        refused: Callable[[], None] = lambda: None,
        timed_out: Callable[[], None] = lambda: None,
    ):
        """`factory`: aiohttp's protocol factory (`AppRunner.server`); `refused` and `timed_out` are called
        for each connection answered 503 and each closed for headers not received in time (the server's
        metrics count them)."""
        self.factory = factory
        self.max_connections, self.header_timeout, self.keepalive_timeout = (
            max_connections,
            header_timeout,
            keepalive_timeout,
        )
        self.open: dict[asyncio.BaseTransport, GuardedConnection] = {}
        self.refused, self.timed_out = refused, timed_out

    def __call__(self) -> GuardedConnection:
        return GuardedConnection(self, self.factory())

    def request_started(self, transport) -> None:
        conn = self.open.get(transport)
        if conn is not None:
            conn.requests += 1
            conn.first_byte = None

    def request_finished(self, transport) -> None:
        conn = self.open.get(transport)
        if conn is not None:
            conn.requests -= 1
            conn.idle_since = time.monotonic()


class GuardedConnection(asyncio.Protocol):
    """An aiohttp protocol with the guard's deadlines; every protocol call is passed on to it."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol):
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.requests = 0  # requests on this connection whose handler is running
        self.idle_since = time.monotonic()
        self.first_byte: float | None = None  # when the next request's first byte came
        self.timer: asyncio.TimerHandle | None = None
        self.admitted = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        if len(self.guard.open) >= self.guard.max_connections:
            self.guard.refused()
            transport.write(BUSY_RESPONSE)
            transport.close()
            return
        self.admitted = True
        self.guard.open[transport] = self
        self.inner.connection_made(transport)
        self._schedule(self.guard.keepalive_timeout)

    def _schedule(self, delay: float) -> None:
        self.timer = asyncio.get_running_loop().call_later(max(delay, 0.05), self._check)

    def _check(self) -> None:
        now = time.monotonic()
        if self.requests > 0:
            self._schedule(min(self.guard.header_timeout, self.guard.keepalive_timeout))
            return
        if self.first_byte is not None:
            deadline, what = self.first_byte + self.guard.header_timeout, "headers not received"
        else:
            deadline, what = self.idle_since + self.guard.keepalive_timeout, None
        if now < deadline:
            self._schedule(deadline - now)
            return
        if what is not None:
            self.guard.timed_out()
            log.info("closing a connection: %s within %.0f s", what, self.guard.header_timeout)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if self.requests == 0 and self.first_byte is None:
            self.first_byte = time.monotonic()
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.admitted:
            self.guard.open.pop(self.transport, None)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()
