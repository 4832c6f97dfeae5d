"""The two commands end to end: `sits-deployer publish` to a directory a mirror serves, then
`sits-agent poll` and `sits-agent status` on a device root (install-only: no server running)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from deployer.agent.cli import cli as agent_cli
from deployer.cli.main import cli as deployer_cli
from tests.pull.direct import DirectMirror
from tests.pull.project import Project


def _device(root: Path, project: Project, url: str) -> None:
    (root / "etc/sits/keys").mkdir(parents=True)
    shutil.copyfile(project.public_key, root / "etc/sits/keys/release.pub")
    shutil.copyfile(project.root_metadata("canary"), root / "etc/sits/pull-root.json")
    (root / "etc/sits/pull.yaml").write_text(f"url: {url}\ntimeout_s: 5\n")


def test_publish_then_poll_then_status(tmp_path: Path, project: Project, mirror: DirectMirror) -> None:
    project.write("1.0.0")
    runner = CliRunner()
    published = runner.invoke(
        deployer_cli,
        [
            "publish",
            "-f",
            str(project.dir / "deploy.yaml"),
            "--to",
            str(mirror.root),
            "--channel",
            "canary",
            "--output",
            "json",
        ],
    )
    assert published.exit_code == 0, published.output
    (channel,) = json.loads(published.stdout)
    assert (channel["channel"], channel["version"], channel["changed"]) == ("canary", "1.0.0", True)
    assert (mirror.root / "canary/metadata/timestamp.json").is_file()

    root = tmp_path / "device"
    _device(root, project, f"{mirror.url}/canary/")
    polled = runner.invoke(agent_cli, ["poll", "--root", str(root), "--output", "json"])
    assert polled.exit_code == 0, polled.output
    assert json.loads(polled.stdout)["install"]["version"] == "1.0.0"

    status = runner.invoke(agent_cli, ["status", "--root", str(root), "--output", "json"])
    data = json.loads(status.stdout)
    assert data["current"] == "1.0.0" and data["pull"]["result"] == "updated"


def test_failed_poll_is_one_error_line_and_shows_in_status(
    tmp_path: Path, project: Project, mirror: DirectMirror
) -> None:
    project.publish(mirror.root, "1.0.0", channel="canary")
    root = tmp_path / "device"
    _device(root, project, f"{mirror.url}/no-such-channel/")
    runner = CliRunner()
    polled = runner.invoke(agent_cli, ["poll", "--root", str(root)])
    assert polled.exit_code == 1
    assert "error:" in polled.stderr and "404" in polled.stderr and "Traceback" not in polled.output
    data = json.loads(runner.invoke(agent_cli, ["status", "--root", str(root), "--output", "json"]).stdout)
    assert data["current"] is None
    assert (
        data["pull"]["result"] == "failed"
        and "404" in data["pull"]["error"]
        and data["pull"]["failures"] == 1
    )
