"""Both ends of pull mode for tests and bench/pull.py: a controller project (deploy.yaml over tiny
seeded checkpoints, an unencrypted release key, `publish` to a directory) and device roots that
trust it and poll a channel."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import yaml

from deployer.agent.ota.poll import Poller, PullSettings
from deployer.agent.ota.store import DeviceStore
from deployer.agent.ota.updater import Updater
from deployer.config import load_config
from deployer.config.models import Config
from deployer.pull.publish import PublishedChannel, publish
from deployer.release.sign import generate_key


@dataclass
class Project:
    """A controller project: deploy.yaml over tiny checkpoints, an unencrypted release key.

    `publish_extra` is merged into deploy.yaml's publish section (roles, base_url), `devices`
    replaces the default one-device fleet and `extra` sets other top-level sections; all take effect
    at the next `write`.
    """

    dir: Path
    sources: dict[str, Path]
    public_key: Path
    publish_extra: dict = field(default_factory=dict)
    devices: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return self.dir / "deploy.yaml"

    def write(self, version: str) -> None:
        doc = {
            "apiVersion": "sits.dev/v1",
            "kind": "Deployment",
            "application": "pulltest",
            "model": {
                "name": "tiny",
                "version": version,
                "source": str(self.sources[version]),
                "quantization": {"scheme": "int8"},
            },
            "signing": {"private_key": "keys/release.key", "trusted_keys": ["keys/release.pub"]},
            "fleet": {
                "devices": self.devices
                or [{"name": "d1", "transport": "local", "root": str(self.dir / "device-root")}]
            },
            "publish": {
                # First match wins: devices labelled ring=canary poll canary, every other one stable.
                "channels": [{"name": "canary", "selector": {"ring": "canary"}}, {"name": "stable"}],
                "timestamp_expires": "1d",
                **self.publish_extra,
            },
            **self.extra,
        }
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))

    def config(self) -> Config:
        return load_config(self.config_path)

    def publish(
        self,
        to: Path | str,
        version: str,
        *,
        channel: str = "stable",
        now: datetime | None = None,
        old_root_keys: tuple[Path, ...] = (),
    ) -> PublishedChannel:
        self.write(version)
        (result,) = publish(self.config(), str(to), channels=(channel,), now=now, old_root_keys=old_root_keys)
        return result

    def root_metadata(self, channel: str = "stable") -> Path:
        return self.dir / ".sits" / "channels" / channel / "metadata" / "1.root.json"

    def keygen(self, name: str) -> str:
        """A new key pair keys/<name>.key + keys/<name>.pub; returns the .pub path as deploy.yaml names it."""
        generate_key(
            self.dir / f"keys/{name}.key", self.dir / f"keys/{name}.pub", passphrase=None, unencrypted=True
        )
        return f"keys/{name}.pub"


def make_project(directory: Path, sources: dict[str, Path], sits_dir: Path | None = None) -> Project:
    """A project in `directory` whose versions build from `sources` (version -> checkpoint dir),
    starting from a copy of the artifact store and patches of `sits_dir` when given (cache hits)."""
    (directory / "keys").mkdir(parents=True)
    if sits_dir is not None:
        for part in ("store", "patches"):
            shutil.copytree(sits_dir / part, directory / ".sits" / part)
    pair = generate_key(
        directory / "keys/release.key", directory / "keys/release.pub", passphrase=None, unencrypted=True
    )
    return Project(directory, sources, pair.public_path)


def make_device(root: Path, project: Project, url: str, **settings: object) -> Poller:
    """A device root trusting the project's release key and channel root, polling `url`.

    Install-only: no server runs, so the updater's reload finds none and the version loads on start.
    """
    store = DeviceStore(root)
    store.ensure_layout()
    shutil.copyfile(project.public_key, store.keys_dir / "release.pub")
    channel = url.rstrip("/").rsplit("/", 1)[-1]
    shutil.copyfile(project.root_metadata(channel), root / "etc/sits/pull-root.json")
    # A long backoff: a test that wants to retry at once says force=True.
    pull = PullSettings.model_validate({"url": url, "timeout_s": 5, "retry_base_s": 300, **settings})
    return Poller(store, Updater(store), pull)
