"""Three serving devices in pull mode move from 1.0.0 to 2.0.0 by themselves, hot-swapping under
load with no failed request: real AgentServers (torch engine, tiny model), nginx, the real poller."""

from __future__ import annotations

import threading
from pathlib import Path

from deployer.agent.http.server import AgentServer
from deployer.agent.ota.poll import Poller
from tests.pull.nginx import Nginx
from tests.pull.project import Project, make_device
from tests.pull.serving import chat, serve

DEVICES = 3


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
            server, poller = serve(device)
            servers.append(server)
            pollers.append(poller)

        statuses: list[int] = []
        stop = threading.Event()

        def traffic(port: int) -> None:
            while not stop.is_set():
                statuses.append(chat(port))

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
