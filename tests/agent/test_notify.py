"""sd_notify datagrams reach a real unix socket; the watchdog pings; journal lines are JSON."""

import json
import logging
import os
import socket

import pytest

from deployer.agent.notify import Notifier, Watchdog, lifecycle_event, watchdog_interval_s


@pytest.fixture
def notify_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    yield path, sock
    sock.close()


def _fields(sock):
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.split("\n"))


def test_ready_reloading_status_stopping(notify_socket):
    path, sock = notify_socket
    notifier = Notifier(path)
    assert notifier.ready("serving 1.0.0")
    assert _fields(sock) == {"READY": "1", "STATUS": "serving 1.0.0"}
    assert notifier.reloading("loading 1.1.0")
    fields = _fields(sock)
    assert fields["RELOADING"] == "1"
    assert int(fields["MONOTONIC_USEC"]) > 0
    assert notifier.status("busy")
    assert _fields(sock) == {"STATUS": "busy"}
    assert notifier.stopping("bye")
    assert _fields(sock)["STOPPING"] == "1"


def test_abstract_socket_name():
    name = f"sits-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(30)
    try:
        assert Notifier("@" + name).send(READY=1)
        assert sock.recv(64) == b"READY=1"
    finally:
        sock.close()


def test_without_socket_everything_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    assert not notifier.ready("x")
    assert not Watchdog(notifier, interval_s=0.01).start()


def test_unreachable_socket_is_logged_not_raised(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="sits.agent"):
        assert not Notifier(str(tmp_path / "gone.sock")).ready("x")
    assert "sd_notify" in caplog.text


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval_s() is None


def test_watchdog_pings_while_healthy(notify_socket):
    path, sock = notify_socket
    watchdog = Watchdog(Notifier(path), healthy=lambda: True, interval_s=0.01)
    assert watchdog.start()
    try:
        assert sock.recv(64) == b"WATCHDOG=1"
        assert sock.recv(64) == b"WATCHDOG=1"
    finally:
        watchdog.stop()
    assert watchdog.pings >= 2


def test_watchdog_stays_silent_when_unhealthy(notify_socket):
    path, sock = notify_socket
    checks = []

    def unhealthy():
        checks.append(1)
        return len(checks) > 5  # healthy again after 5 checks: the first ping proves the others were skipped

    watchdog = Watchdog(Notifier(path), healthy=unhealthy, interval_s=0.01)
    watchdog.start()
    try:
        assert sock.recv(64) == b"WATCHDOG=1"
    finally:
        watchdog.stop()
    assert len(checks) >= 6
    assert watchdog.pings <= len(checks) - 5


def test_lifecycle_event_is_one_json_line(caplog):
    with caplog.at_level(logging.INFO, logger="sits.agent"):
        record = lifecycle_event("swap-failed", version="1.2.0", reason="smoke too slow", phase="smoke")
    (message,) = [r.getMessage() for r in caplog.records]
    prefix = "sits-agent event "
    assert message.startswith(prefix)
    assert json.loads(message[len(prefix) :]) == record
    assert record == {
        "event": "swap-failed",
        "version": "1.2.0",
        "reason": "smoke too slow",
        "phase": "smoke",
    }
