"""uvicorn's h11 protocol with the connection limits it leaves open.

uvicorn parses HTTP/1.1 (keep-alive, chunked bodies, pipelining, header size through h11) and
closes idle keep-alive connections, but its idle timer restarts with every byte (one byte at a
time holds a connection forever) and it has no cap on open connections (`limit_concurrency`
answers 503 to every request once idle connections alone reach it). This subclass adds:

- an absolute header deadline: from accepting a connection, or from the end of its last response,
  the next request's headers must be complete within `header_timeout_s` (first request) or
  `keep_alive_timeout_s` (later ones), however slowly they trickle in;
- a connection cap: past `max_connections`, the connection idle the longest (no request in
  progress, which includes one still sending its headers) is closed to make room, so idle or
  half-open connections can never lock real clients out; when every connection is busy the new
  one is answered 503 and closed;
- a small write buffer, so a client that stops reading is noticed (the route's send waits) after
  kilobytes, not after megabytes of buffered tokens;
- for the admin socket, the peer's credentials: only the agent's own user (and root) may connect.

H11Protocol, its `cycle`, `connections` and `handle_events` are uvicorn internals, so agent/pyproject.toml
pins the uvicorn range it was tested against, and tests/agent/http/test_uvicorn_internals.py names them.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from deployer.agent.http.metrics import AgentMetrics

__all__ = ["ConnectionLimits", "own_uids", "protocol_class"]

WRITE_BUFFER_HIGH = 16 * 1024
_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_FULL_BODY = (
    b'{"error": {"message": "the agent has no free connection; retry later", '
    b'"type": "server_error", "param": null, "code": "too_many_connections"}}'
)


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits one listener enforces."""

    max_connections: int
    header_timeout_s: float
    keep_alive_timeout_s: float
    peer_uids: frozenset[int] | None = None  # unix socket: uids allowed to connect (None: any)


class _GuardedH11(H11Protocol):
    limits: ClassVar[ConnectionLimits]
    metrics: ClassVar[AgentMetrics]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting: object = None  # the cycle in place when the deadline was armed
        self._idle_since = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Accept (or refuse) a connection and start its header deadline."""
        super().connection_made(transport)
        self.metrics.connections.inc()
        if not self._peer_allowed(transport):
            transport.abort()
            return
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self._idle_since = self.loop.time()
        self._arm(self.limits.header_timeout_s)
        if len(self.connections) > self.limits.max_connections:
            self._make_room(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection."""
        self.metrics.connections.dec()
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        """Parse what arrived; a new request's complete headers end the header deadline."""
        super().handle_events()
        if self._deadline is not None and self.cycle is not self._awaiting:
            self._disarm()

    def on_response_complete(self) -> None:
        """After each response, the next request's headers have keep_alive_timeout_s to arrive."""
        self._idle_since = self.loop.time()
        if not self.transport.is_closing():
            self._arm(self.limits.keep_alive_timeout_s)
        super().on_response_complete()

    # -- helpers -----------------------------------------------------------------------------------

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._awaiting = self.cycle
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing() and self._idle():
            self.metrics.connections_closed.labels(reason="header_timeout").inc()
            self.transport.close()

    def _make_room(self, transport: asyncio.Transport) -> None:
        idle = [
            c
            for c in self.connections
            if c is not self and isinstance(c, _GuardedH11) and c._idle() and not c.transport.is_closing()
        ]
        if idle:
            oldest = min(idle, key=lambda c: c._idle_since)
            self.metrics.connections_closed.labels(reason="evicted").inc()
            oldest.transport.close()
            return
        self.metrics.connections_closed.labels(reason="refused").inc()
        transport.write(_FULL % (len(_FULL_BODY), _FULL_BODY))
        transport.close()

    def _peer_allowed(self, transport: asyncio.Transport) -> bool:
        allowed = self.limits.peer_uids
        if allowed is None:
            return True
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family != socket.AF_UNIX:
            return False
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return uid in allowed


def protocol_class(limits: ConnectionLimits, metrics: AgentMetrics) -> type[H11Protocol]:
    """The protocol class one uvicorn listener uses (uvicorn instantiates it per connection)."""
    return type("AgentH11Protocol", (_GuardedH11,), {"limits": limits, "metrics": metrics})


def own_uids() -> frozenset[int]:
    """The uids allowed on the admin socket: the agent's own user and root."""
    return frozenset({os.getuid(), 0})
