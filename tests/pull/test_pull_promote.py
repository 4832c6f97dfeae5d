"""Ring advancement: `promote --from canary` publishes to stable only once every canary device runs
canary's release and serves it; until then it refuses, naming each device that lags. Real serving
agents (in process), read over the local transport like any fleet, and a mirror."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from deployer.agent.http.server import AgentServer
from deployer.cli.main import cli as deployer_cli
from deployer.errors import SitsError
from deployer.pull.publish import published_artifact
from deployer.push.promote import promote
from deployer.push.state import read_audit
from tests.pull.direct import DirectMirror
from tests.pull.project import Project, make_device
from tests.pull.serving import serve

RINGS = {"c1": "canary", "c2": "canary", "s1": "stable"}


def _refusal(project: Project, mirror: DirectMirror) -> str:
    with pytest.raises(SitsError) as info:
        promote(project.config(), "canary", str(mirror.root))
    return info.value.message


def test_promote_waits_for_the_canary_ring_then_publishes_to_stable(
    tmp_path: Path, project: Project, mirror: DirectMirror
) -> None:
    for channel in ("canary", "stable"):
        project.publish(mirror.root, "1.0.0", channel=channel)
    servers: dict[str, AgentServer] = {}
    try:
        pollers = {}
        for name, channel in RINGS.items():
            device = make_device(tmp_path / name, project, f"{mirror.url}/{channel}/")
            assert device.poll().result == "updated"
            servers[name], pollers[name] = serve(device)
        project.devices = [
            {
                "name": name,
                "transport": "local",
                "root": str(tmp_path / name),
                "python": sys.executable,
                "agent_port": servers[name].port,
                "labels": {"ring": "canary" if channel == "canary" else "main"},
            }
            for name, channel in RINGS.items()
        ]
        project.publish(mirror.root, "2.0.0", channel="canary")
        stable_v1 = published_artifact(project.config(), "stable")

        refused = _refusal(project, mirror)
        assert "not promoting 2.0.0 from canary to stable: 2 of 2 device(s)" in refused
        assert "c1: runs 1.0.0, not 2.0.0 (ready)" in refused and "c2: runs 1.0.0" in refused
        assert "s1" not in refused  # only the ring being promoted is checked

        assert pollers["c1"].poll().payload == "patch"  # installs and hot-swaps
        make_device(tmp_path / "c2", project, f"{mirror.url}/canary/").poll()  # installs, no reload
        refused = _refusal(project, mirror)
        assert "1 of 2 device(s)" in refused and "c2: installed 2.0.0 but does not serve it" in refused
        assert published_artifact(project.config(), "stable") == stable_v1  # nothing was published

        assert servers["c2"].reload(reason="test").ok
        args = ["-f", str(project.config_path), "--from", "canary", "--to", str(mirror.root)]
        done = CliRunner().invoke(deployer_cli, ["promote", *args, "--output", "json"])
        assert done.exit_code == 0, done.output
        promotion = json.loads(done.stdout)
        assert (promotion["channel"], promotion["version"]) == ("stable", "2.0.0")
        assert [(r["device"], r["health"]) for r in promotion["ring"]] == [("c1", "ready"), ("c2", "ready")]

        outcome = pollers["s1"].poll()
        assert (outcome.result, outcome.payload) == ("updated", "patch")
        assert servers["s1"].manager.active_info().version == "2.0.0"
    finally:
        for server in servers.values():
            server.stop()
    records = [r for r in read_audit(project.dir / ".sits") if r["action"] == "promote"]
    assert [r["status"] for r in records] == ["refused", "refused", "published"]
