"""Slow retrieval and endless data against pull mode, from a real HTTP server on loopback.

A device polls a channel from a server that turns hostile once the device runs 1.0.0 and 2.0.0 is
published: it trickles a byte at a time, each just inside the idle timeout (so no single receive
ever times out), or it never stops sending. The poll gives up within its bounds (`max_download_s`,
the signed lengths) with an error that says why, records it, and the device keeps serving 1.0.0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from deployer.agent.ota.fetch import DeadlineExceeded
from deployer.errors import FormatError, TransportError
from tests.pull.project import Project, make_device
from tests.pull.serving import chat, serve

TRICKLE_GAP_S = 0.2  # between two bytes: well inside the device's 1 s idle timeout
SAFETY_S = 60  # the server's own limit, so that a device without a deadline fails instead of hanging


class HostileServer(ThreadingHTTPServer):
    """Serves `root`; requests whose path contains `match` get `mode`: None (honest), "trickle" or
    "endless". `hostile` is set once a hostile answer has started."""

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)  # port 0: the kernel picks, we read it back
        self.root = root
        self.mode: str | None = None
        self.match = ""
        self.hostile = threading.Event()
        self.closing = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: HostileServer

    def do_GET(self) -> None:
        path = (self.server.root / unquote(urlsplit(self.path).path).lstrip("/")).resolve()
        if not path.is_file() or self.server.root.resolve() not in path.parents:
            self.send_error(404)
            return
        data = path.read_bytes()
        mode = self.server.mode if self.server.match in self.path else None
        self.send_response(200)
        if mode != "endless":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if mode is None:
            self.wfile.write(data)
            return
        self.server.hostile.set()
        give_up = time.monotonic() + SAFETY_S
        try:
            if mode == "trickle":
                for i in range(len(data)):
                    if self.server.closing.wait(TRICKLE_GAP_S) or time.monotonic() > give_up:
                        break
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
            else:
                while not self.server.closing.is_set() and time.monotonic() < give_up:
                    self.wfile.write(data or b"x")
        except OSError:
            pass  # the device hung up: what it should do
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[HostileServer]:
    published = tmp_path / "published"
    published.mkdir()
    server = HostileServer(published)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.closing.set()
    server.shutdown()
    server.server_close()


def _on_v1(tmp_path: Path, project: Project, server: HostileServer):
    project.publish(server.root, "1.0.0")
    device = make_device(
        tmp_path / "d1", project, f"{server.url}/stable/", timeout_s=1, max_download_s=2, max_resumes=0
    )
    assert device.poll().result == "updated" and device.store.current_version() == "1.0.0"
    project.publish(server.root, "2.0.0")
    return device


def test_a_trickling_server_cannot_hold_a_poll_and_the_device_keeps_serving(
    tmp_path: Path, project: Project, server: HostileServer
) -> None:
    device = _on_v1(tmp_path, project, server)
    agent, poller = serve(device)
    server.mode, server.match = "trickle", "/targets/"
    failure: list[BaseException] = []

    def poll() -> None:
        try:
            poller.poll(force=True)
        except BaseException as exc:
            failure.append(exc)

    polling = threading.Thread(target=poll)
    try:
        polling.start()
        assert server.hostile.wait(60), "the poll never reached the download"
        assert chat(agent.port) == 200  # served while the download crawls
        polling.join(SAFETY_S + 30)
        assert not polling.is_alive()
        assert chat(agent.port) == 200
        assert agent.manager.active_info().version == "1.0.0"
    finally:
        server.closing.set()
        polling.join(SAFETY_S + 30)
        agent.stop()
    (error,) = failure
    assert isinstance(error, DeadlineExceeded), error
    assert "download time of 2 s is spent" in error.message and "too slowly" in error.message
    assert device.store.current_version() == "1.0.0"
    assert poller.read_state().result == "failed" and "too slowly" in poller.read_state().error


@pytest.mark.parametrize(
    ("mode", "match", "error", "message"),
    [
        ("trickle", "/metadata/timestamp.json", DeadlineExceeded, "too slowly"),
        ("endless", "/targets/", FormatError, "sent more than the signed"),
        ("endless", "/metadata/timestamp.json", TransportError, "cannot download"),
    ],
)
def test_slow_or_endless_data_is_refused_and_nothing_changes(
    tmp_path: Path, project: Project, server: HostileServer, mode: str, match: str, error, message: str
) -> None:
    device = _on_v1(tmp_path, project, server)
    server.mode, server.match = mode, match
    with pytest.raises(error, match=message):
        device.poll(force=True)
    assert server.hostile.is_set()
    assert device.store.current_version() == "1.0.0"
    assert device.store.read_state().installed_version == "1.0.0"
    assert device.read_state().result == "failed"
