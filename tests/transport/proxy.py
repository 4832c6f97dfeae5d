"""A loopback TCP proxy that counts the bytes each connection sends upstream and can cut the first one.

It stands between the SSH client and a device to drop a real connection mid-upload (both sockets are
closed, as when a link dies) and to measure what the client really sent on the wire.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttingProxy:
    """Listen on 127.0.0.1; forward to `target`; cut connection #1 after `cut_after` upstream bytes."""

    def __init__(self, target: tuple[str, int], *, cut_after: int | None = None, timeout: float = 30) -> None:
        self.target = target
        self.cut_after = cut_after
        self.timeout = timeout
        self.upstream_bytes: list[int] = []  # per accepted connection, in order
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
                index = len(self.upstream_bytes)
                self.upstream_bytes.append(0)
                self._sockets += [client, upstream]
            limit = self.cut_after if index == 0 else None
            for src, dst, counted in ((client, upstream, True), (upstream, client, False)):
                thread = threading.Thread(
                    target=self._pump, args=(src, dst, index if counted else None, limit), daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket, index: int | None, limit: int | None) -> None:
        src.settimeout(self.timeout)
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if index is not None:
                    if limit is not None and self.upstream_bytes[index] + len(data) > limit:
                        break  # the link dies here: this data never arrives
                    self.upstream_bytes[index] += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _hang_up(src)
            _hang_up(dst)


def _hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
