"""Provisioning for pull mode over the normal transport: `apply` writes pull.yaml (the device's
channel URL), pull-root.json (the channel's root) and, under systemd, the poll units; then the device
polls by itself."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from click.testing import CliRunner

from deployer.agent.cli import cli as agent_cli
from deployer.cli.main import cli as deployer_cli
from deployer.errors import ConfigError
from deployer.push.bootstrap import desired_files, stop_agent
from deployer.push.facts import PULL_CONFIG, PULL_ROOT, UNIT_DIR, DeviceSite
from deployer.transport import LocalTransport
from tests.ports import reserved_port
from tests.pull.direct import DirectMirror
from tests.pull.project import Project

CDN = "https://cdn.example/sits"


def _local(project: Project, name: str, labels: dict[str, str]) -> dict:
    (project.dir / "devices" / name).mkdir(parents=True, exist_ok=True)
    return {
        "name": name,
        "transport": "local",
        "root": f"devices/{name}",
        "python": sys.executable,
        "agent_port": reserved_port(),
        "labels": labels,
    }


def _files(project: Project, name: str) -> dict[str, bytes]:
    config = project.config()
    device = next(d for d in config.fleet.devices if d.name == name)
    return desired_files(config, DeviceSite.of(config, device), systemd=True)


def test_each_device_gets_its_channel_url_root_and_poll_units(project: Project, mirror: DirectMirror) -> None:
    project.devices = [_local(project, "c1", {"ring": "canary"}), _local(project, "m1", {"ring": "main"})]
    project.publish_extra = {"base_url": CDN}
    project.write("1.0.0")
    with pytest.raises(ConfigError) as info:
        _files(project, "c1")
    assert "channel canary has no root metadata yet" in info.value.message
    assert "sits-deployer publish --channel canary" in (info.value.hint or "")

    for channel in ("canary", "stable"):
        project.publish(mirror.root, "1.0.0", channel=channel)
    for name, channel in (("c1", "canary"), ("m1", "stable")):
        files = _files(project, name)
        assert yaml.safe_load(files[PULL_CONFIG]) == {"url": f"{CDN}/{channel}/"}
        assert files[PULL_ROOT] == project.root_metadata(channel).read_bytes()
        service = files[f"{UNIT_DIR}/sits-poll.service"].decode()
        assert f"ExecStart={sys.executable} -m deployer.agent.cli poll --config " in service
        assert f"{UNIT_DIR}/sits-poll.timer" in files
        assert files == _files(project, name)  # deterministic: a second apply writes nothing

    project.publish_extra = {}  # no base_url: push mode only
    project.write("1.0.0")
    assert not {PULL_CONFIG, PULL_ROOT} & set(_files(project, "c1"))


def test_apply_provisions_pull_mode_then_the_device_polls_by_itself(
    project: Project, mirror: DirectMirror
) -> None:
    project.devices = [_local(project, "edge", {"ring": "canary"})]
    project.publish_extra = {"base_url": mirror.url}
    project.extra = {
        "health": {"latency_budget_ms": 20000, "smoke_prompts": ["Hi"]},
        "agent": {"max_tokens": 8},
    }
    project.publish(mirror.root, "1.0.0", channel="canary")
    root = project.dir / "devices/edge"
    config = project.config()
    site = DeviceSite.of(config, config.fleet.devices[0])
    runner = CliRunner()

    def run(*args: str):
        return runner.invoke(deployer_cli, [args[0], "-f", str(project.config_path), *args[1:]])

    try:
        plan = json.loads(run("plan", "--output", "json").stdout)
        (write,) = [s for s in plan["devices"][0]["steps"] if s["kind"] == "write-units"]
        assert PULL_CONFIG in write["reason"] and PULL_ROOT in write["reason"]
        applied = run("apply", "--output", "json")
        assert applied.exit_code == 0, applied.output
        assert yaml.safe_load((root / PULL_CONFIG[1:]).read_text()) == {"url": f"{mirror.url}/canary/"}
        assert (root / PULL_ROOT[1:]).read_bytes() == project.root_metadata("canary").read_bytes()
        again = run("plan", "--detailed-exitcode")
        assert again.exit_code == 0, again.output  # converged, pull files included

        project.publish(mirror.root, "2.0.0", channel="canary")
        polled = runner.invoke(
            agent_cli, ["poll", "--config", str(root / "etc/sits/agent.yaml"), "--output", "json"]
        )
        assert polled.exit_code == 0, polled.output
        outcome = json.loads(polled.stdout)
        assert (outcome["result"], outcome["payload"]) == ("updated", "patch")
        (row,) = json.loads(run("status", "--output", "json").stdout)
        assert (row["version"], row["health"]) == ("2.0.0", "ready")  # hot-swapped by the poll
    finally:
        stop_agent(site, LocalTransport(root))
