"""Loopback ports for servers that another process starts later: reserved, never picked and freed.

Binding port 0, closing the socket and handing the number on races: anything may take the port
before the server binds it. A `PortReservation` keeps its socket bound, with SO_REUSEADDR and
never listening, for as long as the port is in use. On Linux the kernel then hands that port to no
other bind(0) or outgoing connection and refuses a plain bind of it, while the server it is meant
for, which binds with SO_REUSEADDR (Python's http.server, nginx, werkzeug all do), may listen on it
(a listening socket is the one thing SO_REUSEADDR sockets may not share).

The demo's agents and the tests' and benches' servers whose port must be written into a config
before they start use it; a server started in-process binds port 0 itself and reports its port.
"""

from __future__ import annotations

import socket
from types import TracebackType

__all__ = ["PortReservation"]


class PortReservation:
    """A port of `host` held for a server that binds it later; `close()` (or leaving the `with`
    block) gives it back once that server is done."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.host = host
        self.port: int = self._socket.getsockname()[1]

    def close(self) -> None:
        """Give the port back."""
        self._socket.close()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
