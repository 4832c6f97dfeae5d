"""What the fleet should run, made ready to send: the built artifact, signed releases, cached patches.

Everything lives next to deploy.yaml under `.sits/`::

    .sits/store/artifacts/<id>/           artifacts (the build's content-addressed store)
    .sits/patches/<from id>-<to id>.patch patches, made once per (from, to)
    .sits/releases/ledger.json            the highest release counter ever issued, and each release
    .sits/releases/<counter>.json         signed release manifests

A release binds one artifact (and optionally the patch from one base), so each (target, base)
pair gets its own release, issued once with the next counter and reused until it nears expiry.
Counters only grow, also for a fleet rollback: going back to an older artifact is a NEW release with
a higher counter, so the devices' anti-rollback check stays on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, ValidationError

from deployer.build.store import STORE_DIRNAME, Store
from deployer.config.models import Config
from deployer.core.fsutil import atomic_write
from deployer.core.hashing import sha256_file
from deployer.core.manifest import read_manifest
from deployer.core.release import PatchRef, make_release, parse_time
from deployer.errors import ConfigError, KeyFileError, SitsError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

    from deployer.build.progress import BuildProgress
    from deployer.core.adapter_release import AdapterRelease
    from deployer.core.release import Release

__all__ = [
    "SITS_DIRNAME",
    "Desired",
    "LedgerEntry",
    "ReleaseFiles",
    "Releaser",
    "artifact_in_store",
    "build_target",
    "built_target",
]

SITS_DIRNAME = ".sits"
# A cached release is reused only while it stays valid for at least this long.
_MIN_VALIDITY = timedelta(days=1)


class LedgerEntry(BaseModel):
    """One issued release."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    counter: int
    version: str
    artifact_sha256: str
    base_sha256: str | None
    expires: str


class _Ledger(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    counter: int = 0
    releases: tuple[LedgerEntry, ...] = ()


@dataclass(frozen=True)
class ReleaseFiles:
    """A signed release and the payload it goes with (a patch file, or the artifact directory)."""

    manifest: Path
    counter: int
    patch: Path | None
    artifact_dir: Path

    @property
    def payload_bytes(self) -> int:
        """Bytes a device receives for this release."""
        if self.patch is not None:
            return self.patch.stat().st_size
        return sum(p.stat().st_size for p in self.artifact_dir.iterdir() if p.is_file())


@dataclass(frozen=True)
class Desired:
    """The target: its version, artifact id and directory."""

    version: str
    artifact_sha256: str
    artifact_dir: Path

    @property
    def artifact_bytes(self) -> int:
        """Size of the full artifact."""
        return sum(p.stat().st_size for p in self.artifact_dir.iterdir() if p.is_file())


def build_target(config: Config, *, progress: BuildProgress | None = None) -> Desired:
    """Build (or find in the cache) the artifact deploy.yaml names. Raises BuildError."""
    from deployer.build.pipeline import build_artifact
    from deployer.build.request import request_from_config

    result = build_artifact(request_from_config(config), progress=progress)
    return Desired(config.model.version, result.artifact_id, result.artifact_dir)


def built_target(config: Config) -> Desired | None:
    """The artifact deploy.yaml names when it was built before; None when it is not built yet.

    Hashes the source model and looks its inputs up in the store; quantizes and writes nothing.
    """
    from deployer.build.pipeline import find_built
    from deployer.build.request import request_from_config

    found = find_built(request_from_config(config))
    return None if found is None else Desired(config.model.version, found.artifact_id, found.artifact_dir)


def artifact_in_store(config: Config, artifact_sha256: str) -> Desired | None:
    """An artifact this controller built before, by id, or None when the store no longer has it."""
    directory = Store(config.base_dir / STORE_DIRNAME).artifact_dir(artifact_sha256)
    manifest = directory / "sits-manifest.json"
    if not manifest.is_file() or sha256_file(manifest) != artifact_sha256:
        return None
    return Desired(read_manifest(directory).model.version, artifact_sha256, directory)


class Releaser:
    """Issues signed releases and patches for one project (its `.sits/` directory)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.base = config.base_dir / SITS_DIRNAME
        self.releases_dir = self.base / "releases"
        self.patches_dir = self.base / "patches"
        self.ledger_path = self.releases_dir / "ledger.json"

    def history(self) -> tuple[LedgerEntry, ...]:
        """Every release issued so far, oldest first."""
        return self._read_ledger().releases

    def patch(self, base: Desired, target: Desired) -> Path:
        """The patch from `base` to `target`, made once and cached."""
        from deployer.release.delta import create_patch

        path = self.patches_dir / f"{base.artifact_sha256[:16]}-{target.artifact_sha256[:16]}.patch"
        if not path.is_file():
            self.patches_dir.mkdir(parents=True, exist_ok=True)
            create_patch(base.artifact_dir, target.artifact_dir, path)  # written atomically
        return path

    def release(
        self, target: Desired, base: Desired | None, *, floor: int = 0, fresh: bool = False
    ) -> ReleaseFiles:
        """A signed release of `target` (as a patch from `base` when given).

        Reuses an earlier release of the same pair above `floor` unless `fresh`; otherwise issues
        one with a counter above every counter issued so far and above `floor` (the highest counter
        a device reported). Raises KeyFileError (no signing key) and FormatError.
        """
        ledger = self._read_ledger()
        base_sha = base.artifact_sha256 if base else None
        patch = self.patch(base, target) if base else None
        if not fresh:
            for entry in reversed(ledger.releases):
                if (entry.artifact_sha256, entry.base_sha256) == (target.artifact_sha256, base_sha) and (
                    entry.counter > floor and parse_time(entry.expires) - datetime.now(UTC) > _MIN_VALIDITY
                ):
                    return ReleaseFiles(self._path(entry.counter), entry.counter, patch, target.artifact_dir)
        counter = max(ledger.counter, floor) + 1
        manifest = self._issue(target, base, patch, counter)
        entry = LedgerEntry(
            counter=counter,
            version=target.version,
            artifact_sha256=target.artifact_sha256,
            base_sha256=base_sha,
            expires=json.loads(manifest.read_bytes())["signed"]["expires"],
        )
        self._write_ledger(_Ledger(counter=counter, releases=(*ledger.releases, entry)))
        return ReleaseFiles(manifest, counter, patch, target.artifact_dir)

    def _issue(self, target: Desired, base: Desired | None, patch: Path | None, counter: int) -> Path:
        from deployer.release.sign import add_signature, envelope_for

        key = self.signing_key()
        patch_ref = None
        if base is not None and patch is not None:
            patch_ref = PatchRef(
                base_version=base.version,
                base_sha256=base.artifact_sha256,
                sha256=sha256_file(patch),
                size=patch.stat().st_size,
            )
        signing = self.config.signing
        assert signing is not None  # signing_key checked it
        body = self._release_body(target.artifact_dir, counter, signing.expires_in, patch_ref)
        envelope = add_signature(envelope_for(body), key)
        path = self._path(counter)
        self.releases_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, envelope.to_bytes())
        return path

    def _release_body(
        self, artifact_dir: Path, counter: int, expires_in: timedelta, patch: PatchRef | None
    ) -> Release | AdapterRelease:
        """The document `_issue` signs: a model release (an adapter's in AdapterReleaser)."""
        return make_release(artifact_dir, counter=counter, expires_in=expires_in, patch=patch)

    def signing_key(self) -> ec.EllipticCurvePrivateKey:
        """deploy.yaml's release signing key. Raises KeyFileError (none named, unreadable, locked)."""
        from deployer.release.sign import load_signing_key

        signing = self.config.signing
        if signing is None or signing.private_key is None:
            raise KeyFileError(
                "deploy.yaml has no signing.private_key: devices only install signed releases",
                hint="make a key with `sits-deployer keygen -o keys/release` and name it under signing:",
            )
        return load_signing_key(self.config.resolve(signing.private_key), signing.passphrase_env)

    def _path(self, counter: int) -> Path:
        return self.releases_dir / f"{counter}.json"

    def _read_ledger(self) -> _Ledger:
        try:
            return _Ledger.model_validate_json(self.ledger_path.read_bytes())
        except FileNotFoundError:
            return _Ledger()
        except (OSError, ValidationError) as exc:
            raise ConfigError(
                f"{self.ledger_path}: cannot read the release ledger: {exc}",
                hint="restore it from version control; counters must never go down",
            ) from exc

    def _write_ledger(self, ledger: _Ledger) -> None:
        self.releases_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.ledger_path, ledger.model_dump_json(indent=2) + "\n", error=SitsError)
