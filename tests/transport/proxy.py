"""A loopback TCP proxy that counts the bytes each connection carries and can cut the link, once
or every N bytes (a flaky link).

It stands between a client and a server (an SSH client and a device, a device and nginx) to drop a
real connection mid-transfer (both sockets are closed, as when a link dies) and to measure what
really crossed the wire. `direction` says which way is counted and cut: "up" (client to server, an
upload) or "down" (server to client, a download).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Literal


class CuttingProxy:
    """Listen on 127.0.0.1 and forward to `target`. Each time the bytes sent in `direction`, over
    all connections, pass a multiple of `cut_after` (up to `cuts` times), the connection carrying
    that byte is cut (the bytes up to the limit still arrive); after the last cut connections are
    left alone."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        cut_after: int | None = None,
        cuts: int = 1,
        direction: Literal["up", "down"] = "up",
        timeout: float = 30,
    ) -> None:
        self.target = target
        self.cut_after = cut_after
        self.cuts = cuts
        self.direction = direction
        self.timeout = timeout
        self.counted: list[int] = []  # bytes in `direction`, per accepted connection, in order
        self.cuts_made = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True)]
        self._threads[0].start()

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def cut(self) -> bool:
        """Whether a connection was cut."""
        return self.cuts_made > 0

    @property
    def total(self) -> int:
        """Bytes in `direction` over every connection."""
        return sum(self.counted)

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        return len(self.counted)

    def close(self) -> None:
        """Stop accepting, close every socket, and wait for the forwarding threads."""
        self._stop.set()
        with self._lock:
            for sock in self._sockets:
                _hang_up(sock)  # shutdown wakes a thread blocked in recv; close alone would not
        for thread in self._threads:
            thread.join(timeout=5)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=self.timeout)
            with self._lock:
                index = len(self.counted)
                self.counted.append(0)
                self._sockets += [client, upstream]
            up = self.direction == "up"
            for src, dst, counted in ((client, upstream, up), (upstream, client, not up)):
                thread = threading.Thread(
                    target=self._pump, args=(src, dst, index if counted else None), daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket, index: int | None) -> None:
        src.settimeout(self.timeout)
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                cut_here = False
                if index is not None:
                    data, cut_here = self._count(index, data)
                dst.sendall(data)
                if cut_here:
                    break  # the link dies here: nothing after the limit arrives
        except OSError:
            pass
        finally:
            _hang_up(src)
            _hang_up(dst)

    def _count(self, index: int, data: bytes) -> tuple[bytes, bool]:
        """Count `data` on connection `index`; trim it and report a cut when it passes the limit."""
        with self._lock:
            if self.cut_after is not None and self.cuts_made < self.cuts:
                room = self.cut_after * (self.cuts_made + 1) - sum(self.counted)
                if room < len(data):
                    self.cuts_made += 1
                    data = data[: max(room, 0)]
                    self.counted[index] += len(data)
                    return data, True
            self.counted[index] += len(data)
            return data, False


def _hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
