"""`run_server` as systemd runs it: READY=1, watchdog pings, SIGHUP reload of the store's `current`
pointer (RELOADING=1 then READY=1), SIGTERM (STOPPING=1, exit 0), and one journal line per event."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
from http.client import HTTPConnection
from pathlib import Path

import pytest

from deployer.agent.ota.store import DeviceStore

REPO = Path(__file__).resolve().parents[3]
PREFIX = "sits-agent event "
SERVE = (
    "import sys; from pathlib import Path; from deployer.agent.settings import load_settings; "
    "from deployer.agent.http.server import run_server; run_server(load_settings(Path(sys.argv[1])))"
)


class _Journal:
    """The agent's stderr (its journal lines), read as they come by a thread; `port` is where the
    agent said it listens: it binds port 0 and reports the port, so no port is picked in advance."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._listening = queue.Queue[str]()
        self._reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.lines.append(line)
            if PREFIX in line and json.loads(line.split(PREFIX, 1)[1])["event"] == "listening":
                self._listening.put(line)
        self._listening.put("")  # the agent exited

    def port(self) -> int:
        line = self._listening.get(timeout=120)
        assert line, "the agent exited before listening:\n" + "".join(self.lines)
        return int(json.loads(line.split(PREFIX, 1)[1])["reason"].rsplit(":", 1)[1])

    def text(self) -> str:
        """Everything, once the agent has exited."""
        self._reader.join(timeout=60)
        return "".join(self.lines)


def _wait_for(sock: socket.socket, key: str, seen: list[dict]) -> dict:
    """Receive notify datagrams until one carries `key`; every datagram is kept in `seen`."""
    while True:
        fields = dict(line.split("=", 1) for line in sock.recv(4096).decode().split("\n"))
        seen.append(fields)
        if key in fields:
            return fields


@pytest.fixture
def device_root(tmp_path, tiny_model_dir, tiny_model_dir_b):
    store = DeviceStore(tmp_path / "root")
    store.ensure_layout()
    shutil.copytree(tiny_model_dir, store.version_dir("v1"))
    shutil.copytree(tiny_model_dir_b, store.version_dir("v2"))
    store.set_pointer("current", "v1")
    return store


def _get_json(port: int, path: str) -> dict:
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def test_notify_reload_on_sighup_and_journal_lines(tmp_path, device_root):
    config = tmp_path / "agent.yaml"
    config.write_text(
        f"port: 0\nroot: {device_root.root}\nthreads: 1\ncontext_length: 256\nmax_prompt_tokens: 128\n"
        "smoke_prompts:\n  - prompt: Hi\n    max_tokens: 2\n"
    )
    notify_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    sock.settimeout(120)
    env = {**os.environ, "PYTHONPATH": str(REPO), "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "200000"}
    env.pop("WATCHDOG_PID", None)
    # inductor's cache goes under the store; Triton's stays where the operator put it.
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "operator-triton")
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(config)], env=env, stderr=subprocess.PIPE, text=True
    )
    journal = _Journal(proc)
    seen: list[dict] = []
    try:
        port = journal.port()
        assert _wait_for(sock, "READY", seen)["STATUS"] == "serving v1"
        assert (device_root.base / "cache/inductor").is_dir()
        assert _get_json(port, "/v1/models")["data"][0]["version"] == "v1"
        _wait_for(sock, "WATCHDOG", seen)

        device_root.set_pointer("current", "v2")
        proc.send_signal(signal.SIGHUP)
        assert _wait_for(sock, "RELOADING", seen)["STATUS"] == "loading v2"
        assert _wait_for(sock, "READY", seen)["STATUS"] == "serving v2"
        assert [m["version"] for m in _get_json(port, "/v1/models")["data"]] == ["v2", "v1"]

        proc.send_signal(signal.SIGTERM)
        _wait_for(sock, "STOPPING", seen)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
    assert proc.returncode == 0
    stderr = journal.text()
    events = [json.loads(line.split(PREFIX, 1)[1]) for line in stderr.splitlines() if PREFIX in line]
    assert all(line.startswith("<") for line in stderr.splitlines() if PREFIX in line)  # journald priority
    names = [e["event"] for e in events]
    assert names[0] == "compile-caches"  # before anything loads
    assert (events[0]["TORCHINDUCTOR_CACHE_DIR"], events[0]["TRITON_CACHE_DIR"]) == (
        str(device_root.base / "cache/inductor"),
        str(tmp_path / "operator-triton"),
    )
    assert names[1] == "listening"
    loaded = [(e["version"], e["device"], e["reason"]) for e in events if e["event"] == "loaded"]
    assert loaded == [("v1", "cpu", "cpu (asked for)"), ("v2", "cpu", "cpu (asked for)")]  # the default
    swaps = [(e["version"], e["reason"]) for e in events if e["event"] == "swap-started"]
    assert swaps == [("v1", "start"), ("v2", "sighup")]
    assert {"event": "swap-succeeded", "version": "v2"}.items() <= next(
        e for e in events if e["event"] == "swap-succeeded" and e["version"] == "v2"
    ).items()
    # v1 unloads after the swap, on its engine thread once drained (which may come after SIGTERM
    # here: nothing waits for it), v2 at shutdown.
    unloaded = {e["version"]: i for i, e in enumerate(events) if e["event"] == "unloaded"}
    assert sorted(unloaded) == ["v1", "v2"]
    assert names.index("stopping") < unloaded["v2"]


def test_a_version_that_fails_to_load_exits_non_zero_without_ready(tmp_path, device_root, broken_model_dir):
    store = device_root
    shutil.copytree(broken_model_dir, store.version_dir("v3"))
    store.set_pointer("current", "v3")
    config = tmp_path / "agent.yaml"
    config.write_text(
        f"port: 0\nroot: {store.root}\nthreads: 1\ncontext_length: 256\nmax_prompt_tokens: 128\n"
    )
    notify_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "NOTIFY_SOCKET": notify_path}
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, str(config)], env=env, capture_output=True, text=True, timeout=120
    )
    sock.setblocking(False)
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            break
    sock.close()
    assert proc.returncode != 0
    assert not any("READY=1" in m for m in messages)  # systemd never sees it start: OnFailure= can roll back
    assert "v3 failed to start (load)" in proc.stderr
