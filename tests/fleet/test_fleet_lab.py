"""The fleet commands over real SSH against booted systemd devices of the lab (marked `lab`).

The lab's devices have Debian's python3 but no torch, so no agent can serve there: these tests cover
what the controller does before a model runs: facts over SSH (systemd detected, no agent), a plan
that bootstraps and writes the systemd units, units that systemd accepts, and `logs` via journalctl.
"""

from __future__ import annotations

import json

import pytest

from deployer.bootstrap import desired_files, write_files
from deployer.config import load_config
from deployer.fleet import Fleet
from tests.fleet.conftest import make_project
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab


@pytest.fixture
def ssh_project(hub: Lab, tmp_path, tiny_model_dir):
    devices = [
        {
            "name": f"dev{i}",
            "host": hub.device(i).address,
            "identity_file": str(hub.client_key),
            "known_hosts": str(hub.known_hosts),
        }
        for i in (1, 2, 3)
    ]
    return make_project(tmp_path / "project", {"1.0.0": tiny_model_dir}, devices)


def test_facts_and_plan_over_ssh_bootstrap_and_units(ssh_project):
    fleet = Fleet.select(load_config(ssh_project.config_path))
    try:
        facts = fleet.facts()
    finally:
        fleet.close()
    assert all(f.reachable and f.systemd and f.agent_version is None for f in facts), facts
    assert all(f.free_disk_bytes and f.free_memory_bytes for f in facts)
    result = ssh_project.run("plan", "--output", "json", "--detailed-exitcode")
    assert result.exit_code == 2
    plan = json.loads(result.stdout)
    for device in plan["devices"]:
        kinds = [s["kind"] for s in device["steps"]]
        assert kinds[:3] == ["bootstrap", "write-units", "send-artifact"]
        assert "/etc/systemd/system/sits-agent.service" in device["steps"][1]["reason"]


def test_units_written_over_ssh_are_accepted_by_systemd(ssh_project):
    config = load_config(ssh_project.config_path)
    fleet = Fleet.select(config, names=["dev1"])
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
