"""Bootstrap: a device whose interpreter lacks the agent gets sits-agent and its wheelhouse.

The device's interpreter here is a bare venv: everything the agent imports must come from the
controller's wheelhouse (installed with pip --no-index), and nothing the controller alone needs may.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployer.agent.settings import AgentSettings
from deployer.config import load_config
from deployer.push.bootstrap import agent_settings
from deployer.push.facts import DeviceSite, gather_facts, gather_platform
from deployer.transport import LocalTransport
from tests.fleet.agent_packages import canonical, forbidden, local_run, packages_of
from tests.fleet.conftest import local_devices, make_project


def _bare_venv(path: Path) -> Path:
    """A venv holding nothing but pip."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True)
    return path / "bin/python"


def test_fresh_device_gets_only_the_agent_and_serves(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the device imports only what it installed
    python = _bare_venv(tmp_path / "device-venv")
    base = tmp_path / "project"
    project = make_project(base, {"1.0.0": tiny_model_dir}, local_devices(base, ("fresh",), str(python)))
    config = load_config(project.config_path)
    device_site = DeviceSite.of(config, config.fleet.devices[0])
    transport = LocalTransport(project.device_root("fresh"))
    before = gather_facts(device_site, transport)
    assert before.reachable and before.agent_version is None
    plan = project.run("plan", "--output", "json")
    assert plan.exit_code == 0
    assert plan.stdout.count('"bootstrap"') == 1
    try:
        result = project.run("apply", "--output", "json")
        assert result.exit_code == 0, result.output
        after = gather_facts(device_site, transport)
        assert after.agent_version is not None
        assert after.model_version == "1.0.0" and after.ready  # `serve` ran on the tiny model
        installed = subprocess.run(
            [str(python), "-c", "import deployer, sys; sys.stdout.write(deployer.__file__)"],
            capture_output=True,
            text=True,
            check=True,
            cwd=tmp_path,
        ).stdout
        assert str(tmp_path / "device-venv") in installed  # the wheel's copy, not the source tree
        packages = packages_of(local_run, str(python))
        assert {"torch", "tokenizers", "jinja2", "tuf", "sits-agent"} <= packages.keys()
        assert forbidden(packages, "torch") == set(), sorted(packages)
        # Each wheel is recorded by its hash: a second bootstrap sends none of them again.
        record = json.loads((project.device_root("fresh") / "opt/sits/wheels.json").read_text())
        assert {canonical(name.split("-")[0]) for name in record["wheels"]} <= packages.keys()
        assert gather_platform(device_site, transport).wheels == set(record["wheels"].values())
        assert not (project.device_root("fresh") / "var/lib/sits/incoming/wheels").exists()
        help_text = local_run([str(python), "-m", "deployer.agent.cli", "--help"])
        assert "serve" in help_text and "install" in help_text
    finally:
        project.stop_agents()


def test_managed_files_carry_the_signature_threshold(tmp_path, tiny_model_dir):
    from deployer.push.bootstrap import desired_files
    from deployer.push.facts import KEYS_DIR
    from deployer.release.sign import generate_key

    base = tmp_path / "project"
    project = make_project(base, {"1.0.0": tiny_model_dir}, local_devices(base, ("d",), sys.executable))
    generate_key(base / "keys/second.key", base / "keys/second.pub", passphrase=None, unencrypted=True)
    signing = {
        "private_key": "keys/release.key",
        "trusted_keys": ["keys/release.pub", "keys/second.pub"],
        "threshold": 2,
    }
    project.write("1.0.0", signing=signing)
    config = load_config(project.config_path)
    files = desired_files(config, DeviceSite.of(config, config.fleet.devices[0]), systemd=False)
    assert files[f"{KEYS_DIR}/threshold"] == b"2\n"
    assert files[f"{KEYS_DIR}/second.pub"] == (base / "keys/second.pub").read_bytes()


@pytest.mark.parametrize(("cpu", "threads"), [("2", 2), ("1500m", 1), ("250m", 1), (None, None)])
def test_agent_threads_follow_the_cpu_quota(tmp_path, tiny_model_dir, cpu, threads):
    base = tmp_path / "project"
    project = make_project(base, {"1.0.0": tiny_model_dir}, local_devices(base, ("d",), sys.executable))
    doc = yaml.safe_load(project.config_path.read_text())
    if cpu is not None:
        doc["resources"] = {"cpu": cpu}
    project.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    config = load_config(project.config_path)
    settings = yaml.safe_load(agent_settings(config, DeviceSite.of(config, config.fleet.devices[0])))
    assert settings.get("threads") == threads
    assert AgentSettings(**settings).threads == threads  # the agent accepts what we write


@pytest.mark.parametrize(
    ("agent", "device", "compile_setting"),
    [
        ({}, "auto", "auto"),
        ({"device": "cpu", "compile": "on"}, "cpu", "on"),
        ({"device": "cuda"}, "cuda", "auto"),
    ],
)
def test_agent_device_and_compile_are_written_to_agent_yaml(
    tmp_path, tiny_model_dir, agent, device, compile_setting
):
    base = tmp_path / "project"
    project = make_project(base, {"1.0.0": tiny_model_dir}, local_devices(base, ("d",), sys.executable))
    doc = yaml.safe_load(project.config_path.read_text())
    doc.setdefault("agent", {}).update(agent)
    project.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    config = load_config(project.config_path)
    text = agent_settings(config, DeviceSite.of(config, config.fleet.devices[0]))
    settings = yaml.safe_load(text)
    # Written even when left at the default: agent.yaml's own default (cpu) is not deploy.yaml's (auto).
    assert (settings["device"], settings["compile"]) == (device, compile_setting)
    agent_side = AgentSettings(**settings)  # the agent accepts what we write
    assert (agent_side.device, agent_side.compile) == (device, compile_setting)
