"""Signed adapter releases, one counter line per adapter (issue #41).

An adapter release is issued like a model release (`deployer.release.desired.Releaser`: reused
while valid, counters that only grow, a fleet rollback is a NEW release of the old artifact with a
higher counter, patches made once per pair and cached) but in a ledger of its own per adapter name,
so rolling one adapter back or forward never moves another's counter or the base's::

    .sits/releases/adapters/<name>/ledger.json     the highest counter issued for <name>, and each
    .sits/releases/adapters/<name>/<counter>.json  signed adapter release manifests
    .sits/patches/adapters/<from id>-<to id>.patch patches between two versions of an adapter
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from deployer.build.adapter import ADAPTERS_DIRNAME, AdapterBuild
from deployer.build.store import STORE_DIRNAME, Store
from deployer.config.models import Config
from deployer.core.adapter_release import (
    ADAPTER_MANIFEST,
    AdapterRelease,
    make_adapter_release,
    read_adapter_manifest,
)
from deployer.core.hashing import sha256_file
from deployer.core.release import PatchRef
from deployer.release.desired import Desired, Releaser

__all__ = ["AdapterReleaser", "adapter_in_store", "as_desired", "built_adapters"]


def as_desired(build: AdapterBuild) -> Desired:
    """An adapter build as the releaser's target (version, id, directory)."""
    return Desired(build.version, build.artifact_id, build.artifact_dir)


def _store(config: Config) -> Store:
    return Store(config.base_dir / STORE_DIRNAME / ADAPTERS_DIRNAME)


def adapter_in_store(config: Config, artifact_id: str) -> Desired | None:
    """An adapter artifact this controller built, by id, or None when the store does not have it."""
    directory = _store(config).artifact_dir(artifact_id)
    manifest = directory / ADAPTER_MANIFEST
    if not manifest.is_file() or sha256_file(manifest) != artifact_id:
        return None
    return Desired(read_adapter_manifest(directory).adapter.version, artifact_id, directory)


def built_adapters(config: Config, base_artifact_id: str) -> dict[str, Desired | None]:
    """deploy.yaml's model.adapters by name: the artifact built of each for this base, or None when
    `sits-deployer build` has not built that version for it."""
    found: dict[tuple[str, str], Desired] = {}
    artifacts = _store(config).artifacts
    for directory in sorted(artifacts.iterdir()) if artifacts.is_dir() else ():
        manifest = directory / ADAPTER_MANIFEST
        if not manifest.is_file():
            continue
        meta = read_adapter_manifest(directory)
        if meta.base_artifact_id == base_artifact_id:
            key = (meta.adapter.name, meta.adapter.version)
            found[key] = Desired(meta.adapter.version, sha256_file(manifest), directory)
    return {spec.name: found.get((spec.name, spec.version)) for spec in config.model.adapters}


class AdapterReleaser(Releaser):
    """Issues signed releases and patches for one adapter of a project."""

    def __init__(self, config: Config, name: str) -> None:
        super().__init__(config)
        self.name = name
        self.releases_dir = self.base / "releases" / "adapters" / name
        self.patches_dir = self.base / "patches" / "adapters"
        self.ledger_path = self.releases_dir / "ledger.json"

    def _release_body(
        self, artifact_dir: Path, counter: int, expires_in: timedelta, patch: PatchRef | None
    ) -> AdapterRelease:
        return make_adapter_release(artifact_dir, counter=counter, expires_in=expires_in, patch=patch)
