"""uvicorn's h11 protocol with the connection limits it leaves open.

uvicorn parses HTTP/1.1 (keep-alive, chunked bodies, pipelining, header size through h11) and
closes idle keep-alive connections, but its idle timer restarts with every byte (one byte at a
time holds a connection forever), it has no cap on open connections (`limit_concurrency`
answers 503 to every request once idle connections alone reach it), and under TLS it sees a
connection only once asyncio has finished the handshake (60 s allowed by default), so silent
TLS connections escape every limit. This subclass adds, from the moment a connection is accepted:

- TLS done here rather than by uvicorn (`loop.start_tls` on the accepted connection), so that a
  connection in its handshake is counted, capped and timed like any other;
- an absolute header deadline: from accepting a connection, or from the end of its last response,
  the next request's headers must be complete within `header_timeout_s` (first request, TLS
  handshake included) or `keep_alive_timeout_s` (later ones), however slowly they trickle in;
- a connection cap: past `max_connections`, an idle connection (no request in progress; one
  still sending its headers, or its TLS handshake, counts as idle) is closed to make room, so
  idle or half-open connections can never lock real clients out. asyncio accepts a burst of
  connections before it reads any, so a request that has arrived may still sit unread in the
  kernel: the connection closed is the longest-idle one with nothing unread, and only when there
  is none, the newest with bytes unread (an older one likelier holds a request that came before
  the burst). When every connection is busy the new one is answered 503 (plain HTTP) and closed;
- a small write buffer, so a client that stops reading is noticed (the route's send waits) after
  kilobytes, not after megabytes of buffered tokens;
- a request h11 cannot parse (a malformed Content-Length, request line or header) answered with
  the OpenAI error object, not uvicorn's text/plain;
- for the admin socket, the peer's credentials: only the agent's own user (and root) may connect.

H11Protocol, its `cycle`, `connections`, `handle_events` and `send_400_response` are uvicorn
internals, so agent/pyproject.toml pins the uvicorn range it was tested against, and
tests/agent/http/test_uvicorn_internals.py names them.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import socket
import ssl
import struct
import sys
import termios
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from deployer.agent.http.metrics import AgentMetrics
from deployer.agent.openai.schemas import ApiError

__all__ = ["ConnectionLimits", "own_uids", "protocol_class"]

WRITE_BUFFER_HIGH = 16 * 1024
# A closing TLS connection waits this long for the peer's close_notify (asyncio's default, 30 s,
# held a stopping agent that long for each silent client).
_TLS_SHUTDOWN_S = 2.0
_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_FULL_BODY = (
    b'{"error": {"message": "the agent has no free connection; retry later", '
    b'"type": "server_error", "param": null, "code": "too_many_connections"}}'
)
_FRAMING_HEADERS = ("Content-Length", "Transfer-Encoding")


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
    tls: ClassVar[ssl.SSLContext | None]
    accepted: ClassVar[set[_GuardedH11]]  # this listener's open connections, handshakes included

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting: object = None  # the cycle in place when the deadline was armed
        self._idle_since = 0.0
        self._fd = -1
        self._http = False  # H11Protocol.connection_made has run (after TLS, under TLS)
        self._raw: asyncio.Transport | None = None  # the TCP transport while TLS is set up
        self._early = bytearray()  # plaintext that came with the end of the TLS handshake

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """A connection was accepted (before any TLS handshake): count it, check its peer, start
        its header deadline, make room under the cap; then speak HTTP, or TLS first."""
        self.metrics.connections.inc()
        self.accepted.add(self)
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        self._idle_since = self.loop.time()
        if not self._peer_allowed(sock):
            transport.abort()
            return
        self._arm(self.limits.header_timeout_s)
        if len(self.accepted) > self.limits.max_connections and not self._make_room(transport):
            return
        if self.tls is None:
            self._start_http(transport)
        else:
            self._raw = transport
            self.loop.create_task(self._start_tls(transport, self.tls))

    def data_received(self, data: bytes) -> None:
        """Parse what arrived (under TLS, what came with the handshake's end waits for HTTP)."""
        if not self._http:
            self._early += data  # at most one read: start_tls returns before the next one
            return
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection."""
        self._forget()
        if self._http:
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

    def send_400_response(self, msg: str) -> None:
        """Answer a request h11 cannot parse with the OpenAI error object (uvicorn calls this while
        handling h11's RemoteProtocolError, whose text and status hint say what was wrong)."""
        exc = sys.exception()
        problem = exc if isinstance(exc, h11.RemoteProtocolError) else None
        status = problem.error_status_hint if problem is not None else 400
        detail = str(problem) if problem is not None else msg
        param = next((name for name in _FRAMING_HEADERS if name.lower() in detail.lower()), None)
        message = f"the request is not valid HTTP/1.1: {detail}"
        error = ApiError(status, message, param=param, code="invalid_http")
        body = json.dumps(error.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        response = h11.Response(status_code=status, headers=headers)
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    # -- helpers -----------------------------------------------------------------------------------

    def _start_http(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._http = True
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        if self._early:
            early, self._early = bytes(self._early), bytearray()
            super().data_received(early)

    async def _start_tls(self, transport: asyncio.Transport, context: ssl.SSLContext) -> None:
        if transport.is_closing():  # closed by the cap before the handshake began
            return
        try:
            secured = await self.loop.start_tls(
                transport,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=self.limits.header_timeout_s,
                ssl_shutdown_timeout=_TLS_SHUTDOWN_S,
            )
        except (OSError, asyncio.CancelledError):
            # Refused, reset or timed out (or the server stops): start_tls has closed the connection.
            self._forget()
            return
        if secured is None:  # closed during the handshake (the cap, the header deadline, the peer)
            self._forget()
            return
        self._raw = None
        self._start_http(secured)

    def _forget(self) -> None:
        if self in self.accepted:
            self.accepted.discard(self)
            self.metrics.connections.dec()
        self._disarm()

    def _closing(self) -> bool:
        if self._http:
            return self.transport.is_closing()
        return self._raw is None or self._raw.is_closing()

    def _close(self) -> None:
        if self._http:
            self.transport.close()
        elif self._raw is not None:
            self._raw.close()

    def _between_requests(self) -> bool:
        return not self._http or self.cycle is None or self.cycle.response_complete

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
        if not self._closing() and self._between_requests():
            self.metrics.connections_closed.labels(reason="header_timeout").inc()
            self._close()

    def _make_room(self, transport: asyncio.Transport) -> bool:
        """Close another idle connection (see the module's docstring for which), or refuse this one
        (False)."""
        idle = [c for c in self.accepted if c is not self and not c._closing() and c._between_requests()]
        silent = [c for c in idle if _unread_bytes(c._fd) == 0]
        if idle:
            victim = (
                min(silent, key=lambda c: c._idle_since) if silent else max(idle, key=lambda c: c._idle_since)
            )
            self.metrics.connections_closed.labels(reason="evicted").inc()
            victim._close()
            return True
        self.metrics.connections_closed.labels(reason="refused").inc()
        if self.tls is None:  # under TLS nothing can be said before a handshake
            transport.write(_FULL % (len(_FULL_BODY), _FULL_BODY))
        transport.close()
        return False

    def _peer_allowed(self, sock: socket.socket | None) -> bool:
        allowed = self.limits.peer_uids
        if allowed is None:
            return True
        if sock is None or sock.family != socket.AF_UNIX:
            return False
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return uid in allowed


def _unread_bytes(fd: int) -> int:
    """Bytes the kernel holds for `fd` that nobody has read yet (0 for a closed socket)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return 0


def protocol_class(
    limits: ConnectionLimits, metrics: AgentMetrics, tls: ssl.SSLContext | None = None
) -> type[H11Protocol]:
    """The protocol class one uvicorn listener uses (uvicorn instantiates it per connection);
    `tls`: the listener's server context (the handshake is done here, not by uvicorn)."""
    namespace = {"limits": limits, "metrics": metrics, "tls": tls, "accepted": set()}
    return type("AgentH11Protocol", (_GuardedH11,), namespace)


def own_uids() -> frozenset[int]:
    """The uids allowed on the admin socket: the agent's own user and root."""
    return frozenset({os.getuid(), 0})
