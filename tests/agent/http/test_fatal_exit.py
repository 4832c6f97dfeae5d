"""A stop the agent did not ask for is a failure: `sits-agent serve` whose event loop stops answering
exits non-zero, so that systemd's Restart=on-failure brings it back (it exited 0, and stayed down).

The agent runs as `sits-agent serve` in a process; its loop is held by a blocking call put on it
from inside (the fault under test: a request that computes on the loop), right after it listens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from deployer.agent.ota.store import DeviceStore

REPO = Path(__file__).resolve().parents[3]
PREFIX = "sits-agent event "
# `sits-agent serve`, with the event loop made to block for an hour once the server listens.
STUCK_SERVE = """
import sys, time
from deployer.agent.cli import main
from deployer.agent.http import server

started = server.AgentServer.start

def start(self):
    port = started(self)
    self._loop.call_soon_threadsafe(time.sleep, 3600)
    return port

server.AgentServer.start = start
sys.argv = ["sits-agent", "serve", "--config", sys.argv[1]]
main()
"""


def test_an_event_loop_that_stops_answering_exits_non_zero(tmp_path, tiny_model_dir):
    store = DeviceStore(tmp_path / "root")
    store.ensure_layout()
    shutil.copytree(tiny_model_dir, store.version_dir("v1"))
    store.set_pointer("current", "v1")
    config = tmp_path / "agent.yaml"
    config.write_text(
        f"port: 0\nroot: {store.root}\nthreads: 1\ncontext_length: 256\nmax_prompt_tokens: 128\n"
        "drain_timeout_s: 1\nsmoke_prompts:\n  - prompt: Hi\n    max_tokens: 2\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NOTIFY_SOCKET", None)
    done = subprocess.run(
        [sys.executable, "-c", STUCK_SERVE, str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    events = [json.loads(line.split(PREFIX, 1)[1]) for line in done.stderr.splitlines() if PREFIX in line]
    stopping = [e for e in events if e["event"] == "stopping"]
    assert [e["reason"] for e in stopping] == ["the event loop stopped answering"]
    assert "error: the HTTP server's event loop stopped answering" in done.stderr
