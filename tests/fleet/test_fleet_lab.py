"""The fleet commands over real SSH against booted systemd devices of the lab (marked `lab`).

Bootstrap installs the agent's runtime (torch and the rest) from the controller's wheelhouse into
/opt/sits/venv (the devices reach no index), then our wheel, and the agent really serves. First,
what the controller does before a model runs: facts over SSH (systemd detected, no agent), a plan
that bootstraps and writes the systemd units, units that systemd accepts, and `logs` via
journalctl. Then a rollout through the real CLI (the tests build on each other, in file order): v1
from scratch, started by systemd as a Type=notify service; v2 as a patch under canary;
`rollback --to 1.0.0`; and a crash-looping agent that systemd's OnFailure= unit returns to the
previous version.
"""

from __future__ import annotations

import json
import time

import pytest

from deployer.config import load_config
from deployer.push.bootstrap import desired_files, write_files
from deployer.push.fleet import FleetSession
from tests.fleet.conftest import make_project
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module", autouse=True)
def fresh_devices(lab: Lab) -> None:
    """Devices 1-3 as from the factory, whatever an earlier module left on them."""
    for i in (1, 2, 3):
        lab.reset(i)


@pytest.fixture
def ssh_project(hub: Lab, tmp_path, tiny_model_dir):
    devices = hub.inventory((1, 2, 3))
    return make_project(tmp_path / "project", {"1.0.0": tiny_model_dir}, devices)


def test_facts_and_plan_over_ssh_bootstrap_and_units(ssh_project):
    fleet = FleetSession.select(load_config(ssh_project.config_path))
    try:
        facts = fleet.facts()
    finally:
        fleet.close()
    assert all(f.reachable and f.systemd and f.agent_version is None for f in facts), facts
    assert all(f.free_disk_bytes and f.free_memory_bytes for f in facts)
    assert ssh_project.run("build", "-q").exit_code == 0  # plan never builds (issue 18)
    result = ssh_project.run("plan", "--output", "json", "--detailed-exitcode")
    assert result.exit_code == 2
    plan = json.loads(result.stdout)
    for device in plan["devices"]:
        kinds = [s["kind"] for s in device["steps"]]
        assert kinds[:3] == ["bootstrap", "write-units", "send-artifact"]
        assert "/etc/systemd/system/sits-agent.service" in device["steps"][1]["reason"]


def test_units_written_over_ssh_are_accepted_by_systemd(ssh_project):
    config = load_config(ssh_project.config_path)
    fleet = FleetSession.select(config, names=["dev1"])
    site = fleet.sites["dev1"]
    transport = fleet.transport(site)
    try:
        written = write_files(site, transport, desired_files(config, site, systemd=True))
        assert "/etc/systemd/system/sits-agent.service" in written
        assert write_files(site, transport, desired_files(config, site, systemd=True)) == []  # by hash
        loaded = transport.run("systemctl daemon-reload && systemctl show -p LoadState,Type sits-agent")
        assert "LoadState=loaded" in loaded.stdout and "Type=notify" in loaded.stdout
        facts = fleet.facts()[0]
        assert facts.unit_hashes["/etc/systemd/system/sits-agent.service"]
    finally:
        fleet.close()


def test_logs_over_ssh_reads_the_journal(ssh_project):
    result = ssh_project.cli("logs", "dev2", "-f", str(ssh_project.config_path), "--since", "1 hour ago")
    assert result.exit_code == 0, result.output


# -- a real rollout onto the lab: bootstrap puts the agent's runtime in /opt/sits/venv ------------

CANARY = {"type": "canary", "steps": [1, "100%"], "analysis_window": "1s", "offline": "skip"}
NAMES = ("dev1", "dev2", "dev3")


@pytest.fixture(scope="module")
def lab_project(lab: Lab, tmp_path_factory, tiny_model_dir, tiny_model_dir_b):
    """One project for the rollout tests below (they build on each other, in file order)."""
    devices = lab.inventory((1, 2, 3), rings=True)
    models = {"1.0.0": tiny_model_dir, "2.0.0": tiny_model_dir_b}
    return make_project(tmp_path_factory.mktemp("lab-rollout"), models, devices)


def _status(project) -> dict[str, dict]:
    result = project.run("status", "--output", "json")
    assert result.exit_code == 0, result.output
    return {row["device"]: row for row in json.loads(result.stdout)}


def _versions(project) -> dict[str, str | None]:
    return {name: row["version"] for name, row in _status(project).items()}


def _unit_state(lab: Lab, index: int) -> str:
    return lab.nsenter(index, ["systemctl", "show", "-p", "ActiveState,Type,MainPID", "sits-agent"])


def test_apply_v1_over_ssh_runs_the_agent_under_systemd(hub: Lab, lab_project):
    result = lab_project.run("apply", "--output", "json")
    assert result.exit_code == 0, result.output
    assert {r["status"] for r in json.loads(result.stdout)["results"]} == {"updated"}
    for i in (1, 2, 3):
        state = _unit_state(hub, i)
        assert "ActiveState=active" in state and "Type=notify" in state, state
        ready = hub.nsenter(i, ["python3", "-c", READYZ])
        assert ready.strip() == "200", ready
    rows = _status(lab_project)
    assert {n: (r["version"], r["health"]) for n, r in rows.items()} == dict.fromkeys(
        NAMES, ("1.0.0", "ready")
    )
    again = lab_project.run("plan", "--output", "json", "--detailed-exitcode")
    assert again.exit_code == 0, again.output  # converged: nothing left to do
    owner = hub.nsenter(1, ["stat", "-c", "%U", "/var/lib/sits/state.json"])
    assert owner.strip() == "sits"  # the store stays the service user's


def test_v2_patch_under_canary_then_fleet_rollback(hub: Lab, lab_project):
    lab_project.write("2.0.0", strategy=CANARY)
    assert lab_project.run("build", "-q").exit_code == 0  # plan never builds (issue 18)
    plan = json.loads(lab_project.run("plan", "--output", "json").stdout)
    assert all(d["steps"][0]["kind"] == "send-patch" for d in plan["devices"]), plan
    result = lab_project.run("apply", "--output", "json")
    assert result.exit_code == 0, result.output
    assert {r["status"] for r in json.loads(result.stdout)["results"]} == {"updated"}
    assert _versions(lab_project) == dict.fromkeys(NAMES, "2.0.0")
    back = lab_project.run("rollback", "--to", "1.0.0", "--output", "json")
    assert back.exit_code == 0, back.output
    rows = _status(lab_project)
    assert {n: (r["version"], r["health"]) for n, r in rows.items()} == dict.fromkeys(
        NAMES, ("1.0.0", "ready")
    )


def test_crash_looping_agent_is_rolled_back_by_systemd(hub: Lab, lab_project):
    """Corrupt the active weights on dev2: restarts fail, OnFailure= runs sits-rollback.service."""
    assert _versions(lab_project)["dev2"] == "1.0.0"  # after the fleet rollback; previous: 2.0.0
    hub.nsenter(2, ["sh", "-c", CORRUPT])
    hub.nsenter(2, ["systemctl", "--no-block", "restart", "sits-agent"])
    deadline = time.monotonic() + 300
    rows: dict = {}
    while time.monotonic() < deadline:
        time.sleep(5)
        rows = _status(lab_project)
        if rows["dev2"]["version"] == "2.0.0" and rows["dev2"]["health"] == "ready":
            break
    assert (rows["dev2"]["version"], rows["dev2"]["health"]) == ("2.0.0", "ready"), rows
    ran = hub.nsenter(
        2, ["systemctl", "show", "-p", "ExecMainStartTimestampMonotonic,ExecMainStatus", "sits-rollback"]
    )
    started = dict(line.split("=", 1) for line in ran.split())
    assert int(started["ExecMainStartTimestampMonotonic"]) > 0 and started["ExecMainStatus"] == "0", ran
    journal = hub.nsenter(2, ["journalctl", "-u", "sits-agent", "--no-pager", "-o", "cat"])
    assert "OnFailure" in journal or "repeated too quickly" in journal, journal[-2000:]
    assert "ActiveState=active" in _unit_state(hub, 2)
    assert {rows[n]["version"] for n in ("dev1", "dev3")} == {"1.0.0"}  # the others untouched


CORRUPT = (
    "for f in $(find -L /var/lib/sits/current -type f -name '*.safetensors'); do "
    'chmod u+w "$f"; truncate -s 64 "$f"; done'
)
READYZ = (
    "import urllib.request, urllib.error\n"
    "try: print(urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=5).status)\n"
    "except urllib.error.HTTPError as e: print(e.code)\n"
    "except OSError as e: print(e)\n"
)
