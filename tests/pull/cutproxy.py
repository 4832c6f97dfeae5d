"""A loopback TCP proxy that hangs up once, when the bytes sent down (server to client, over all its
connections) pass N: a link dying mid-download. tests/transport/proxy.py cuts the other way."""

from __future__ import annotations

import contextlib
import socket
import threading


class DownstreamCutProxy:
    """Listen on 127.0.0.1 and forward to `target`; cut the connection carrying byte `cut_after` down."""

    def __init__(self, target: tuple[str, int], cut_after: int) -> None:
        self.target = target
        self.cut_after = cut_after
        self.connections = 0
        self.down = 0
        self.cut = False
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def close(self) -> None:
        """Stop accepting and close every socket."""
        self._stop.set()
        for sock in list(self._sockets):
            _hang_up(sock)
        self._thread.join(timeout=5)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            self._sockets += [client, upstream]
            self.connections += 1
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if downstream:
                    with self._lock:
                        room = self.cut_after - self.down if not self.cut else len(data)
                        cut_here = room < len(data)
                        self.cut = self.cut or cut_here
                        data = data[: max(room, 0)] if cut_here else data
                        self.down += len(data)
                    if cut_here:
                        dst.sendall(data)
                        break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _hang_up(src)
            _hang_up(dst)


def _hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
