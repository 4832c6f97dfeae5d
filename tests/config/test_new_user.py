"""Issue 18 (a new user's first hour), the config side: what init writes, and what validate catches.

Each test fails on the code before the issue: init gave both devices port 8080, made no device
roots and left signing commented out; validate accepted colliding ports and roots, passed without
signing, needed the signing passphrase for every command, and hinted `"1.0"` for `version: 1.0`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from click.testing import CliRunner

from deployer.cli.main import cli
from deployer.config import load_config, validate_file
from deployer.core.redact import Secret
from deployer.release.sign import generate_key


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _init(tmp_path: Path) -> Path:
    project = tmp_path / "my-fleet"
    assert run("init", str(project)).exit_code == 0
    return project


def test_init_devices_get_distinct_ports_their_roots_and_this_python(tmp_path):
    project = _init(tmp_path)
    devices = yaml.safe_load((project / "inventory.yaml").read_text())["devices"]
    ports = [d["agent_port"] for d in devices]
    assert len(set(ports)) == len(ports) == 2 and all(p != 8080 for p in ports)
    for device in devices:
        assert (project / device["root"]).is_dir()
        assert device["python"] == sys.executable  # a local device runs the agent from this env


def test_init_configures_signing_and_validates_once_the_key_exists(tmp_path):
    project = _init(tmp_path)
    doc = yaml.safe_load((project / "deploy.yaml").read_text())
    assert doc["signing"]["private_key"] == "keys/release.key"
    generate_key(
        project / "keys/release.key", project / "keys/release.pub", passphrase=Secret("long enough!")
    )
    environ = {"SITS_SIGNING_PASSPHRASE": "long enough!"}
    assert [str(f) for f in validate_file(project / "deploy.yaml", environ=environ)] == []


def _devices(tmp_path: Path, *entries: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "application: demo\nmodel: {name: m, version: 1.0.0, source: builtin:smollm2-135m-instruct}\n"
        "fleet:\n  devices:\n" + "".join(f"    - {e}\n" for e in entries)
    )
    return path


def test_validate_catches_two_local_devices_on_one_port(tmp_path):
    path = _devices(
        tmp_path, "{name: a, transport: local, root: ./a}", "{name: b, transport: local, root: ./b}"
    )
    findings = [f for f in validate_file(path, environ={}) if f.is_error]
    assert [(f.path, f.line) for f in findings] == [("fleet.devices[1].agent_port", 6)]
    assert "same agent_port as 'a' on this machine: 8080" in findings[0].message


def test_validate_catches_two_devices_on_one_root_of_one_host(tmp_path):
    path = _devices(
        tmp_path,
        "{name: a, transport: local, root: ./x, agent_port: 9001}",
        "{name: b, transport: local, root: x/, agent_port: 9002}",
        "{name: c, transport: ssh, host: h1, root: /srv/sits}",
        "{name: d, transport: ssh, host: h1, root: /srv/sits/, agent_port: 9003}",
        "{name: e, transport: ssh, host: h2, root: /srv/sits}",  # another host: fine
    )
    findings = [f for f in validate_file(path, environ={}) if f.is_error]
    assert [f.path for f in findings] == ["fleet.devices[1].root", "fleet.devices[3].root"]
    assert "same root as 'c' on h1" in findings[1].message


def test_validate_warns_that_apply_needs_signing(tmp_path):
    path = _devices(tmp_path, "{name: a, transport: local, root: ./a}")
    result = run("validate", "-f", str(path))
    assert result.exit_code == 0  # build and plan work without it
    assert "warning: no signing section: apply and rollback will refuse" in result.stderr
    assert "sits-deployer keygen -o keys/release" in result.stderr


def test_commands_that_sign_nothing_need_no_passphrase(tmp_path):
    project = _init(tmp_path)
    generate_key(
        project / "keys/release.key", project / "keys/release.pub", passphrase=Secret("long enough!")
    )
    config = load_config(project / "deploy.yaml", environ={}, secrets=False)
    assert config.signing is not None
    # validate (and apply) still prove that the passphrase opens the key.
    messages = [f.message for f in validate_file(project / "deploy.yaml", environ={})]
    assert messages == ["private key keys/release.key is encrypted and $SITS_SIGNING_PASSPHRASE is not set"]


def test_a_number_as_version_gets_a_semver_hint(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "application: demo\nmodel: {name: m, version: 1.0, source: builtin:smollm2-135m-instruct}\n"
    )
    finding = next(f for f in validate_file(path, environ={}) if f.path == "model.version")
    assert finding.hint == "write a semantic version MAJOR.MINOR.PATCH, e.g. 1.0.0"


def test_a_bad_config_prints_its_findings_in_every_command(tmp_path):
    path = _devices(
        tmp_path, "{name: a, transport: local, root: ./a}", "{name: b, transport: local, root: ./b}"
    )
    result = run("status", "-f", str(path))
    assert result.exit_code == 1
    assert "fleet.devices[1].agent_port: device 'b' has the same agent_port" in result.stderr
