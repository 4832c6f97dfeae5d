"""Three serving devices in pull mode move from 1.0.0 to 2.0.0 by themselves, hot-swapping under
load with no failed request: real AgentServers (torch engine, tiny model), nginx, the real poller."""

from __future__ import annotations

import json
import threading
from http.client import HTTPConnection
from pathlib import Path

from deployer.agent.cli import http_reloader
from deployer.agent.engines import make_engine
from deployer.agent.poll import Poller
from deployer.agent.server import AgentServer
from deployer.agent.settings import AgentSettings, SmokePrompt
from deployer.agent.updater import Updater
from tests.pull.nginx import Nginx
from tests.pull.project import Project, make_device

DEVICES = 3


def _chat(port: int) -> int:
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_serving_devices_pull_and_hot_swap_without_failed_requests(
    tmp_path: Path, project: Project, nginx: Nginx
) -> None:
    project.publish(nginx.root, "1.0.0")
    servers: list[AgentServer] = []
    pollers: list[Poller] = []
    try:
        for i in range(DEVICES):
            device = make_device(tmp_path / f"d{i}", project, f"{nginx.url}/stable/")
            assert device.poll().result == "updated"  # first install before the server starts
            settings = AgentSettings(
                port=0,
                root=device.store.root,
                context_length=256,
                max_prompt_tokens=128,
                threads=1,
                smoke_prompts=(SmokePrompt(prompt="Hi", max_tokens=2),),
            )
            server = AgentServer(settings, lambda: make_engine("torch", context_length=256, threads=1))
            port = server.start()
            servers.append(server)
            assert server.reload(reason="start").ok
            reloader = http_reloader(settings.model_copy(update={"port": port}))
            pollers.append(Poller(device.store, Updater(device.store, reloader=reloader), device.settings))

        statuses: list[int] = []
        stop = threading.Event()

        def traffic(port: int) -> None:
            while not stop.is_set():
                statuses.append(_chat(port))

        clients = [threading.Thread(target=traffic, args=(s.port,)) for s in servers]
        for client in clients:
            client.start()
        project.publish(nginx.root, "2.0.0")
        outcomes = [poller.poll() for poller in pollers]
        stop.set()
        for client in clients:
            client.join(timeout=120)
        active = [server.manager.active_info().version for server in servers]
    finally:
        for server in servers:
            server.stop()
    assert [(o.result, o.payload) for o in outcomes] == [("updated", "patch")] * DEVICES
    assert all(o.install is not None and o.install.reload and o.install.reload.served for o in outcomes)
    assert active == ["2.0.0"] * DEVICES
    assert statuses and set(statuses) == {200}
