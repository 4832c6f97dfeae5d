"""Offline bundles, end to end on a directory device: `sits-deployer bundle` writes one (the real
controller code: ledger, releases, patches, signed index), `sits-agent install --from` verifies and
installs it. Tampered, truncated, expired, wrong-class and replayed bundles are refused with a clear
message and the device keeps the version it had."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from deployer import __version__
from deployer.agent.cli import cli as agent_cli
from deployer.agent.ota.bundle import RunningAgent, install_bundle
from deployer.agent.ota.store import DeviceStore
from deployer.agent.ota.updater import Updater
from deployer.cli.main import cli as deployer_cli
from deployer.config import load_config
from deployer.config.models import Config
from deployer.core.bundle import BUNDLE_INDEX
from deployer.errors import (
    ExpiredError,
    FormatError,
    HashMismatchError,
    IntegrityError,
    ReplayError,
    SignatureError,
)
from deployer.release.bundle import REQUIREMENTS, write_bundle
from deployer.release.desired import Desired, Releaser, artifact_in_store
from tests.agent.ota.conftest import Kit
from tests.push.wheels import fake_wheel


@dataclass
class Site:
    """A controller project holding the kit's artifacts, and a device of class `kiosk` on 1.0.0."""

    config: Config
    v1: Desired
    v2: Desired
    device: DeviceStore

    def bundle(self, out: Path, target: Desired | None = None, device_class: str | None = "kiosk") -> Path:
        write_bundle(self.config, target or self.v2, out, device_class=device_class)
        return out

    def install(self, source: Path, device_class: str | None = "kiosk", **updater: object):
        return install_bundle(source, Updater(self.device, **updater), device_class)  # type: ignore[arg-type]

    def current(self) -> str | None:
        return self.device.current_version()


def _artifact(config: Config, kit: Kit, version: str) -> Desired:
    sha = json.loads(kit.release(version, 1).read_bytes())["signed"]["artifact"]["sha256"]
    found = artifact_in_store(config, sha)
    assert found is not None
    return found


@pytest.fixture
def site(tmp_path: Path, kit: Kit, device: DeviceStore) -> Site:
    project = tmp_path / "project"
    shutil.copytree(kit.out / "store", project / ".sits" / "store")
    (project / "keys").mkdir()
    shutil.copyfile(kit.out / "release.key", project / "keys/release.key")
    shutil.copyfile(kit.public_key, project / "keys/release.pub")
    doc = {
        "application": "kiosks",
        "model": {"name": "tiny", "version": "1.1.0", "source": "builtin:smollm2-135m-instruct"},
        "signing": {"private_key": "keys/release.key", "trusted_keys": ["keys/release.pub"]},
        "profiles": {"kiosk": {"memory": "4Gi"}, "gateway": {"memory": "8Gi"}},
        "fleet": {"devices": [{"name": "k1", "transport": "local", "root": "k1", "profile": "kiosk"}]},
    }
    (project / "deploy.yaml").write_text(yaml.safe_dump(doc))
    config = load_config(project / "deploy.yaml")
    v1, v2 = _artifact(config, kit, "1.0.0"), _artifact(config, kit, "1.1.0")
    # The controller released 1.0.0 before (so the bundle carries a patch from it), and the device runs it.
    first = Releaser(config).release(v1, None)
    Updater(device).install(first.manifest, artifact=v1.artifact_dir)
    return Site(config, v1, v2, device)


def test_a_directory_bundle_patches_from_the_installed_version_and_records_it(
    tmp_path: Path, site: Site
) -> None:
    outcome = site.install(site.bundle(tmp_path / "usb" / "bundle"))
    assert (outcome.payload, outcome.install.version, outcome.install.from_version) == (
        "patch",
        "1.1.0",
        "1.0.0",
    )
    state = site.device.read_state()
    assert site.current() == "1.1.0" and state.artifact_sha256 == site.v2.artifact_sha256
    assert state.history[-1].action == "install" and state.history[-1].version == "1.1.0"
    assert not (site.device.base / "bundle").exists()


@pytest.mark.parametrize("name", ["bundle.tar", "bundle.tar.gz"])
def test_a_tar_bundle_installs_the_full_artifact_on_a_device_without_its_base(
    tmp_path: Path, site: Site, kit: Kit, name: str
) -> None:
    fresh = DeviceStore(tmp_path / "fresh")
    fresh.ensure_layout()
    shutil.copyfile(kit.public_key, fresh.keys_dir / "release.pub")
    outcome = install_bundle(site.bundle(tmp_path / name), Updater(fresh), "kiosk")
    assert (outcome.payload, fresh.current_version()) == ("full", "1.1.0")
    assert not (fresh.base / "bundle").exists()  # the extracted files are gone


def test_a_tampered_patch_is_refused_naming_it(tmp_path: Path, site: Site) -> None:
    bundle = site.bundle(tmp_path / "bundle")
    (patch,) = bundle.glob("patch/*/delta.patch")
    data = bytearray(patch.read_bytes())
    data[len(data) // 2] ^= 0xFF
    patch.write_bytes(bytes(data))
    with pytest.raises(HashMismatchError, match=r"delta\.patch does not match the bundle's signed index"):
        site.install(bundle)
    assert site.current() == "1.0.0"


def test_a_relabelled_index_is_refused_by_its_signature(tmp_path: Path, site: Site) -> None:
    bundle = site.bundle(tmp_path / "bundle", device_class="gateway")
    index = json.loads((bundle / BUNDLE_INDEX).read_bytes())
    index["signed"]["device_class"] = "kiosk"
    (bundle / BUNDLE_INDEX).write_text(json.dumps(index))
    with pytest.raises(SignatureError, match="does not verify"):
        site.install(bundle)
    assert site.current() == "1.0.0"


def test_a_bundle_for_another_class_is_refused(tmp_path: Path, site: Site) -> None:
    bundle = site.bundle(tmp_path / "bundle", device_class="gateway")
    with pytest.raises(IntegrityError, match="for device class 'gateway', this device is 'kiosk'"):
        site.install(bundle)
    assert site.current() == "1.0.0"


def test_a_truncated_tar_is_refused(tmp_path: Path, site: Site) -> None:
    bundle = site.bundle(tmp_path / "bundle.tar")
    data = bundle.read_bytes()
    bundle.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(FormatError, match="truncated"):
        site.install(bundle)
    assert site.current() == "1.0.0"


def test_a_truncated_copy_of_a_file_is_refused(tmp_path: Path, site: Site) -> None:
    bundle = site.bundle(tmp_path / "bundle")
    (patch,) = bundle.glob("patch/*/delta.patch")
    patch.write_bytes(patch.read_bytes()[:-100])
    with pytest.raises(
        FormatError, match=r"delta\.patch is \d+ bytes, the bundle lists \d+ \(a truncated copy\?\)"
    ):
        site.install(bundle)
    assert site.current() == "1.0.0"


def test_an_expired_bundle_is_refused(tmp_path: Path, site: Site) -> None:
    bundle = site.bundle(tmp_path / "bundle")
    later = datetime.now(UTC) + timedelta(days=400)  # past signing.expires_in (30 days)
    with pytest.raises(ExpiredError, match="expired at"):
        site.install(bundle, clock=lambda: later)
    assert site.current() == "1.0.0"


def test_a_replayed_or_older_bundle_is_refused(tmp_path: Path, site: Site) -> None:
    older = site.bundle(tmp_path / "v1", target=site.v1)  # 1.0.0, signed before 1.1.0's
    bundle = site.bundle(tmp_path / "v2")
    site.install(bundle)
    with pytest.raises(ReplayError, match="replayed or downgraded"):
        site.install(bundle)
    # 1.0.0's bundle was signed with a lower counter than the 1.1.0 now installed: a downgrade.
    with pytest.raises(ReplayError):
        site.install(older)
    assert site.current() == "1.1.0"


def _agent(site: Site, *args: str) -> tuple[int, str]:
    config = site.device.root / "etc/sits/agent.yaml"
    config.write_text("device_class: kiosk\n")
    result = CliRunner().invoke(
        agent_cli, ["install", "--root", str(site.device.root), "--config", str(config), *args]
    )
    return result.exit_code, result.stderr


def test_the_commands_write_and_install_a_bundle(
    tmp_path: Path, site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(site.config.base_dir)
    monkeypatch.setattr("deployer.release.desired.build_target", lambda config: site.v2)
    out = tmp_path / "usb" / "sits-bundle.tar.gz"
    made = CliRunner().invoke(
        deployer_cli, ["bundle", "-f", "deploy.yaml", "-o", str(out), "--output", "json"]
    )
    assert made.exit_code == 0, made.output
    written = json.loads(made.stdout)
    assert (written["version"], written["device_class"], written["patch_bases"]) == (
        "1.1.0",
        "kiosk",
        ["1.0.0"],
    )
    with tarfile.open(out) as tar:
        assert BUNDLE_INDEX in tar.getnames()
    assert _agent(site, "--from", str(tmp_path / "nothing-mounted")) == (
        1,
        f"error: {tmp_path / 'nothing-mounted'}: no such bundle (is the stick mounted?)\n"
        "hint: give the bundle's directory or file\n",
    )
    code, stderr = _agent(site, "--from", str(out))
    assert code == 0 and "installed 1.1.0" in stderr and site.current() == "1.1.0"
    code, stderr = _agent(site, "--from", str(out), "--manifest", str(out))
    assert code == 2 and "--from installs a whole bundle" in stderr


def test_bundle_needs_one_device_class(tmp_path: Path, site: Site) -> None:
    doc = yaml.safe_load(site.config.base_dir.joinpath("deploy.yaml").read_text())
    doc["fleet"]["devices"].append(
        {"name": "g1", "transport": "local", "root": "g1", "profile": "gateway", "agent_port": 8099}
    )
    site.config.base_dir.joinpath("deploy.yaml").write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(
        deployer_cli, ["bundle", "-f", str(site.config.base_dir / "deploy.yaml"), "-o", str(tmp_path / "b")]
    )
    assert result.exit_code == 1
    assert "2 device classes (gateway, kiosk); a bundle is for one" in result.stderr
    assert "--profile" in result.stderr and not (tmp_path / "b").exists()


def test_a_bundle_after_a_fleet_rollback_is_above_the_rollback(tmp_path: Path, site: Site) -> None:
    site.install(site.bundle(tmp_path / "v2"))
    # A fleet rollback to 1.0.0: a new release of the older artifact, with a higher counter.
    releaser = Releaser(site.config)
    back = releaser.release(site.v1, None, fresh=True)
    Updater(site.device).install(back.manifest, artifact=site.v1.artifact_dir)
    again = site.install(site.bundle(tmp_path / "v2-again"))
    assert again.install.version == "1.1.0" and again.install.release_counter > back.counter


def test_apply_tells_each_device_its_class(site: Site) -> None:
    from deployer.agent.settings import AgentSettings
    from deployer.push.bootstrap import agent_settings
    from deployer.push.facts import DeviceSite

    (device,) = site.config.fleet.devices
    written = yaml.safe_load(agent_settings(site.config, DeviceSite.of(site.config, device)))
    assert AgentSettings.model_validate(written).device_class == "kiosk"
    plain = site.config.model_copy(
        update={
            "fleet": site.config.fleet.model_copy(
                update={"devices": [device.model_copy(update={"profile": None})]}
            )
        }
    )
    plain._path = site.config._path
    assert "device_class" not in agent_settings(plain, DeviceSite.of(plain, plain.fleet.devices[0]))


def test_a_bundle_carries_the_agents_wheels_that_pip_installs_offline_held_to_their_hashes(
    tmp_path: Path, site: Site
) -> None:
    made = tmp_path / "made"
    made.mkdir()
    wheels = [
        fake_wheel(made, "alpha", "1.0", "py3-none-any"),
        fake_wheel(made, "beta", "2.0", "py3-none-any"),
    ]
    out = tmp_path / "usb" / "bundle"
    result = write_bundle(site.config, site.v2, out, device_class="kiosk", wheels=wheels)
    assert result.wheels == ("alpha-1.0-py3-none-any.whl", "beta-2.0-py3-none-any.whl")
    signed = json.loads((out / BUNDLE_INDEX).read_bytes())["signed"]["files"]
    assert {"wheels/alpha-1.0-py3-none-any.whl", REQUIREMENTS} <= set(signed)

    def pip_install(target: Path) -> subprocess.CompletedProcess[str]:
        argv = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--require-hashes",
            "-r",
            str(out / REQUIREMENTS),
        ]
        env = {**os.environ, "PIP_CONFIG_FILE": "/dev/null"}
        return subprocess.run(
            [*argv, "--target", str(target)], capture_output=True, text=True, env=env, check=False
        )

    done = pip_install(tmp_path / "site-packages")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site-packages" / "beta-2.0.dist-info").is_dir()
    fake_wheel(out / "wheels", "beta", "2.0", "py3-none-any", "x86_64")  # the same name, other bytes
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in pip_install(tmp_path / "other").stderr
    assert site.install(out).payload == "patch"  # the device's own install ignores them


# The agent's wheels of a bundle (`--wheels-arch`): a sits-agent of another version than the one
# running is installed with pip into the running agent's environment, then the agent restarted.
# Stand-ins: a sits-agent wheel that requires one more wheel, and a recording restart.
AGENT_METADATA = "Requires-Dist: bundledep\nProvides-Extra: torch\nProvides-Extra: llamacpp\n"


def _agent_wheels(folder: Path, version: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [
        fake_wheel(folder, "sits_agent", version, "py3-none-any", requires=AGENT_METADATA),
        fake_wheel(folder, "bundledep", "1.0", "py3-none-any"),
    ]


@dataclass
class Running:
    """A RunningAgent whose restarts are counted; its python is never run unless a test makes one."""

    python: str = "/nonexistent/python"  # pip through it would fail: proves pip was not reached
    restarts: int = 0

    def agent(self) -> RunningAgent:
        def restart() -> str:
            self.restarts += 1
            return "restarted (test)"

        return RunningAgent(__version__, self.python, restart)


def test_a_tampered_agent_wheel_is_refused_before_anything_changes(tmp_path: Path, site: Site) -> None:
    out = tmp_path / "bundle"
    write_bundle(
        site.config, site.v2, out, device_class="kiosk", wheels=_agent_wheels(tmp_path / "w", "99.0")
    )
    wheel = out / "wheels" / "bundledep-1.0-py3-none-any.whl"
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 0xFF
    wheel.write_bytes(bytes(data))
    running = Running()
    with pytest.raises(HashMismatchError, match=r"wheels/bundledep-1\.0-py3-none-any\.whl does not match"):
        install_bundle(out, Updater(site.device), "kiosk", running.agent())
    assert (site.current(), running.restarts) == ("1.0.0", 0)
    assert not (site.device.base / "bundle").exists()


def test_an_expired_bundle_with_a_new_agent_is_refused_before_pip_runs(tmp_path: Path, site: Site) -> None:
    out = tmp_path / "bundle"
    write_bundle(
        site.config, site.v2, out, device_class="kiosk", wheels=_agent_wheels(tmp_path / "w", "99.0")
    )
    later = datetime.now(UTC) + timedelta(days=400)
    running = Running()
    with pytest.raises(ExpiredError, match="expired at"):  # not pip's failure: it never ran
        install_bundle(out, Updater(site.device, clock=lambda: later), "kiosk", running.agent())
    assert (site.current(), running.restarts) == ("1.0.0", 0)


def test_wheels_of_the_running_agents_version_are_left_alone(tmp_path: Path, site: Site) -> None:
    out = tmp_path / "bundle"
    write_bundle(
        site.config, site.v2, out, device_class="kiosk", wheels=_agent_wheels(tmp_path / "w", __version__)
    )
    running = Running()
    outcome = install_bundle(out, Updater(site.device), "kiosk", running.agent())
    assert (outcome.agent, outcome.payload, site.current(), running.restarts) == (None, "patch", "1.1.0", 0)


def test_the_bundle_command_carries_the_agents_wheels_and_install_from_upgrades_the_agent(
    tmp_path: Path, site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pip's only source: this folder (no index, no user configuration, a wheelhouse cache of our own).
    links = tmp_path / "links"
    agent, dep = _agent_wheels(links, "99.0")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("deployer.push.bootstrap.build_agent_wheel", lambda project, out: agent)
    monkeypatch.setattr("deployer.release.desired.build_target", lambda config: site.v2)
    monkeypatch.chdir(site.config.base_dir)
    out = tmp_path / "usb" / "sits-bundle.tar.gz"
    made = CliRunner().invoke(
        deployer_cli,
        ["bundle", "-f", "deploy.yaml", "-o", str(out), "--wheels-arch", "x86_64", "--output", "json"],
    )
    assert made.exit_code == 0, made.output
    assert json.loads(made.stdout)["wheels"] == [dep.name, agent.name]
    with tarfile.open(out) as tar:
        signed = json.loads(tar.extractfile(BUNDLE_INDEX).read())["signed"]["files"]  # type: ignore[union-attr]
        pins = tar.extractfile(REQUIREMENTS).read().decode()  # type: ignore[union-attr]
    assert {f"wheels/{agent.name}", f"wheels/{dep.name}", REQUIREMENTS} <= set(signed)
    assert "sits-agent==99.0 --hash=sha256:" in pins and "bundledep==1.0 --hash=sha256:" in pins

    # On the device: an agent in a venv of its own (made with pip) runs the controller's version.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    running = Running(python=str(venv / "bin" / "python"))
    monkeypatch.setattr("deployer.agent.cli.running_agent", lambda settings: running.agent())
    code, stderr = _agent(site, "--from", str(out))
    assert code == 0, stderr
    assert f"agent 99.0 installed from the bundle's wheels, was {__version__}" in stderr
    assert "restarted (test)" in stderr and "installed 1.1.0" in stderr
    assert (site.current(), running.restarts) == ("1.1.0", 1)
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    assert (site_packages / "sits_agent-99.0.dist-info").is_dir()
    assert (site_packages / "bundledep-1.0.dist-info").is_dir()
    assert not (site.device.base / "bundle").exists()
