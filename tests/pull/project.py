"""Both ends of pull mode for tests and bench/pull.py: a controller project (deploy.yaml over tiny
seeded checkpoints, an unencrypted release key, `publish` to a directory) and device roots that
trust it and poll a channel."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from deployer.agent.poll import Poller, PullSettings
from deployer.agent.store import DeviceStore
from deployer.agent.updater import Updater
from deployer.config import load_config
from deployer.publish import PublishedChannel, publish
from deployer.sign import generate_key


@dataclass
class Project:
    """A controller project: deploy.yaml over tiny checkpoints, an unencrypted release key."""

    dir: Path
    sources: dict[str, Path]
    public_key: Path

    def write(self, version: str, *, key: str = "keys/release.key") -> None:
        (self.dir / "deploy.yaml").write_text(
            f"""apiVersion: sits.dev/v1
kind: Deployment
application: pulltest
model:
  name: tiny
  version: {version}
  source: {self.sources[version]}
  quantization: {{scheme: int8}}
signing:
  private_key: {key}
  trusted_keys: [keys/release.pub]
fleet:
  devices: [{{name: d1, transport: local, root: {self.dir / "device-root"}}}]
publish:
  channels: [{{name: stable}}, {{name: canary, selector: {{ring: canary}}}}]
  timestamp_expires: 1d
"""
        )

    def publish(
        self, to: Path | str, version: str, *, channel: str = "stable", now: datetime | None = None
    ) -> PublishedChannel:
        self.write(version)
        (result,) = publish(load_config(self.dir / "deploy.yaml"), str(to), channels=(channel,), now=now)
        return result

    def root_metadata(self, channel: str = "stable") -> Path:
        return self.dir / ".sits" / "channels" / channel / "metadata" / "1.root.json"


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
