"""A project with a 3-device LOCAL fleet on the tiny checkpoint: deploy.yaml, inventory, key, hooks.

Each device is a directory; its agent runs as a background `sits-agent serve` on its own port.
`project.stop_agents()` (called at teardown) ends every agent the tests started, by pid file.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from deployer.cli.main import cli
from deployer.config import load_config
from deployer.push.bootstrap import stop_agent
from deployer.push.facts import DeviceSite
from deployer.release.sign import generate_key
from deployer.transport import LocalTransport
from tests.ports import reserved_port

DEVICES = ("edge-a", "edge-b", "edge-c")

# Fails for the device named in the file `fail-device` next to it; logs every other call to calls.log.
FAILING_HOOK = """#!/bin/sh
fail=$(cat "$(dirname "$0")/fail-device" 2>/dev/null)
[ "$SITS_DEVICE" = "$fail" ] && { echo "check failed on $SITS_DEVICE"; exit 3; }
echo "$SITS_PHASE $SITS_DEVICE $SITS_FROM_VERSION -> $SITS_TO_VERSION" >> "$(dirname "$0")/calls.log"
"""


@dataclass
class Project:
    """A fleet project on disk and helpers to drive it through the real CLI."""

    dir: Path
    models: dict[str, Path]

    @property
    def config_path(self) -> Path:
        return self.dir / "deploy.yaml"

    def device_root(self, name: str) -> Path:
        return self.dir / "devices" / name

    def write(self, version: str = "1.0.0", **overrides: object) -> None:
        """Write deploy.yaml for model `version` (1.0.0 = seed 0, 2.0.0 = seed 1)."""
        doc = yaml.safe_load(self.config_path.read_text())
        doc["model"]["version"] = version
        doc["model"]["source"] = str(self.models[version])
        for key, value in overrides.items():
            doc[key] = value
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))

    def edit_device(self, name: str, **fields: object) -> None:
        """Change inventory fields of device `name` in deploy.yaml (e.g. host, port, known_hosts)."""
        doc = yaml.safe_load(self.config_path.read_text())
        device = next(d for d in doc["fleet"]["devices"] if d["name"] == name)
        device.update(fields)
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))

    def cli(self, *args: str) -> Result:
        return CliRunner().invoke(cli, [*args], catch_exceptions=False)

    def run(self, command: str, *args: str) -> Result:
        return self.cli(command, "-f", str(self.config_path), *args)

    def stop_agents(self) -> None:
        config = load_config(self.config_path)
        for device in config.fleet.devices:
            root = self.device_root(device.name)
            if device.transport == "local" and root.is_dir():
                stop_agent(DeviceSite.of(config, device), LocalTransport(root))


def local_devices(base: Path, names: tuple[str, ...], python: str) -> list[dict]:
    """Inventory entries of local devices under `base/devices/`, agents run with `python`."""
    devices = []
    for name in names:
        (base / "devices" / name).mkdir(parents=True)
        devices.append(
            {
                "name": name,
                "transport": "local",
                "root": f"devices/{name}",
                "python": python,
                "agent_port": reserved_port(),
                "labels": {"ring": "canary" if name == names[0] else "main"},
            }
        )
    return devices


def make_project(base: Path, models: dict[str, Path], devices: list[dict]) -> Project:
    """Write a project (key, hooks, deploy.yaml) for these inventory entries."""
    (base / "keys").mkdir(parents=True)
    generate_key(base / "keys/release.key", base / "keys/release.pub", passphrase=None, unencrypted=True)
    (base / "hooks").mkdir()
    hook = base / "hooks/check.sh"
    hook.write_text(FAILING_HOOK)
    hook.chmod(0o755)
    doc = {
        "apiVersion": "sits.dev/v1",
        "kind": "Deployment",
        "application": "fleet-test",
        "model": {"name": "tiny", "version": "1.0.0", "source": "x", "quantization": {"scheme": "int8"}},
        "signing": {"private_key": "keys/release.key", "trusted_keys": ["keys/release.pub"]},
        "fleet": {"devices": devices},
        "strategy": {"type": "all-at-once", "offline": "skip"},
        "health": {"readiness_timeout": "120s", "latency_budget_ms": 20000, "smoke_prompts": ["Hi"]},
        "hooks": {"post-deploy": "hooks/check.sh"},
        "agent": {"max_tokens": 16},
    }
    (base / "deploy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    project = Project(base, models)
    project.write("1.0.0")
    return project


@pytest.fixture(scope="module")
def project(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_model_dir_b: Path
) -> Project:
    """A fresh 3-device project whose devices run no agent yet; agents are stopped at the end."""
    base = tmp_path_factory.mktemp("fleet")
    models = {"1.0.0": tiny_model_dir, "2.0.0": tiny_model_dir_b}
    project = make_project(base, models, local_devices(base, DEVICES, sys.executable))
    yield project
    project.stop_agents()
    shutil.rmtree(base / "devices", ignore_errors=True)
