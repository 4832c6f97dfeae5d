"""Three lab devices in pull mode move to v2 by themselves (marked `lab`).

Real devices (booted systemd in nspawn, real sshd), the real CLI, nginx from Debian serving the
published channel inside the hub namespace at the hub's bridge address. `apply` puts v1 on the
devices over SSH and provisions them for pull mode (pull.yaml, pull-root.json, the poll units, the
timer enabled); then v2 is published and each device installs it with its own poll (started with
`systemctl start sits-poll.service` rather than waiting for the 15-minute timer) while a client in
the hub keeps asking every device: no request fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from deployer.cli.main import cli as deployer_cli
from deployer.demo.traffic import Traffic
from tests.lab.api_key import LAB_API_KEY, lab_agent
from tests.lab.lab import Lab
from tests.lab.netns import HUB_ADDRESS
from tests.pull.nginx import Nginx, start_nginx, stop_nginx
from tests.pull.project import Project, make_project

pytestmark = pytest.mark.lab

INDICES = (1, 2, 3)
PORT = 8080


@pytest.fixture
def pull_fleet(
    hub: Lab, tmp_path: Path, sources: dict[str, Path], built_store: Path
) -> Iterator[tuple[Project, Nginx]]:
    """Factory-fresh devices 1-3, a project whose devices poll `stable`, nginx serving it in the hub."""
    for i in INDICES:
        hub.reset(i)
    proc, nginx = start_nginx(tmp_path / "published", tmp_path / "nginx", host=HUB_ADDRESS.split("/")[0])
    try:
        project = make_project(tmp_path / "project", sources, built_store)
        project.devices = hub.inventory(INDICES)
        project.publish_extra = {"base_url": nginx.url}
        project.extra = {
            "agent": lab_agent(project.config_path.parent, PORT),
            "health": {"readiness_timeout": "300s", "latency_budget_ms": 60000, "smoke_prompts": ["Hi"]},
        }
        yield project, nginx
    finally:
        stop_nginx(proc)


def _run(project: Project, *args: str):
    return CliRunner().invoke(deployer_cli, [args[0], "-f", str(project.config_path), *args[1:]])


def _status(project: Project) -> dict[str, tuple[str | None, str]]:
    result = _run(project, "status", "--output", "json")
    assert result.exit_code == 0, result.output
    return {row["device"]: (row["version"], row["health"]) for row in json.loads(result.stdout)}


def test_three_lab_devices_pull_v2_by_themselves_with_no_failed_request(hub: Lab, pull_fleet) -> None:
    project, nginx = pull_fleet
    project.publish(nginx.root, "1.0.0")
    applied = _run(project, "apply", "--output", "json", "--parallel", "3")
    assert applied.exit_code == 0, applied.output
    assert {r["status"] for r in json.loads(applied.stdout)["results"]} == {"updated"}
    for i in INDICES:
        pull = yaml.safe_load(hub.nsenter(i, ["cat", "/etc/sits/pull.yaml"]))
        assert pull == {"url": f"{nginx.url}/stable/"}
        assert hub.nsenter(i, ["systemctl", "is-enabled", "sits-poll.timer"]).strip() == "enabled"
    again = _run(project, "plan", "--output", "json", "--detailed-exitcode")
    assert again.exit_code == 0, again.output  # provisioned and converged: nothing left to write

    project.publish(nginx.root, "2.0.0")
    targets = [(hub.device(i).address, PORT) for i in INDICES]
    with Traffic(targets, question="Hi", max_requests=5000, api_key=LAB_API_KEY) as traffic:
        for i in INDICES:
            hub.nsenter(i, ["systemctl", "start", "sits-poll.service"], timeout=600)
    assert traffic.report.failed == 0, traffic.report.errors
    assert traffic.report.versions.keys() >= {"1.0.0", "2.0.0"}, traffic.report
    assert _status(project) == {f"dev{i}": ("2.0.0", "ready") for i in INDICES}
    for i in INDICES:
        state = json.loads(hub.nsenter(i, ["cat", "/var/lib/sits/pull/poll-state.json"]))
        # "up-to-date" when the timer (whose first run may already be due) polled v2 in first.
        assert state["result"] in ("updated", "up-to-date") and not state["error"], state
    fetched = [path.rsplit(".", 1)[-1] for path, status, _ in nginx.requests() if status == 200]
    assert fetched.count("patch") == len(INDICES)  # each device fetched its patch, not the full artifact
