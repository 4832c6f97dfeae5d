"""Fixtures for the device store, updater and sits-agent CLI tests.

`kit` (once per session) builds three real tiny artifacts with the builder, delta patches between
them, and a signing key, and signs releases on demand, like a controller would. `device` is an
empty device root that trusts the kit's key.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from deployer.agent.ota.store import DeviceStore, VersionRecord
from deployer.build.demo_model import make_tiny_checkpoint
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
from deployer.core.canonical import canonical_json
from deployer.core.hashing import sha256_bytes
from deployer.core.release import ArtifactRef, FileHash, ModelRef, PatchRef, Release, make_release
from deployer.release.delta import create_patch
from deployer.release.sign import add_signature, envelope_for, generate_key, load_private_key

VERSIONS = ("1.0.0", "1.1.0", "1.2.0")


@dataclass(frozen=True)
class Kit:
    """Artifacts by version, patches by (from, to), the release key, and where to write releases."""

    artifacts: dict[str, Path]
    patches: dict[tuple[str, str], Path]
    key: ec.EllipticCurvePrivateKey
    public_key: Path
    out: Path

    def release(
        self,
        version: str,
        counter: int,
        *,
        base: str | None = None,
        expires_in: timedelta = timedelta(days=30),
        keys: tuple[ec.EllipticCurvePrivateKey, ...] | None = None,
    ) -> Path:
        """Sign a release of `version` (a patch release from `base` if given); return its path."""
        patch = None
        if base is not None:
            path = self.patches[(base, version)]
            patch = PatchRef(
                base_version=base,
                base_sha256=make_release(
                    self.artifacts[base], counter=1, expires_in=expires_in
                ).artifact.sha256,
                sha256=sha256_bytes(path.read_bytes()),
                size=path.stat().st_size,
            )
        release = make_release(self.artifacts[version], counter=counter, expires_in=expires_in, patch=patch)
        envelope = envelope_for(release)
        for key in keys if keys is not None else (self.key,):
            envelope = add_signature(envelope, key)
        dest = self.out / f"release-{version}-{counter}-{base}-{len(envelope.signatures)}.json"
        dest.write_bytes(envelope.to_bytes())
        return dest


@pytest.fixture(scope="session")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Kit:
    """Three tiny int8 artifacts (seeds 0, 1, 2), patches 1.0.0->1.1.0->1.2.0, one signing key."""
    root = tmp_path_factory.mktemp("kit")
    artifacts = {}
    for seed, version in enumerate(VERSIONS):
        source = make_tiny_checkpoint(root / f"source-{seed}", seed=seed)
        request = BuildRequest(
            source_dir=source,
            name="tiny",
            version=version,
            quant=QuantSpec(scheme="int8"),
            store_dir=root / "store",
        )
        artifacts[version] = build_artifact(request).artifact_dir
    patches = {}
    for base, target in itertools.pairwise(VERSIONS):
        patches[(base, target)] = root / f"{base}-{target}.patch"
        create_patch(artifacts[base], artifacts[target], patches[(base, target)])
    pair = generate_key(root / "release.key", root / "release.pub", passphrase=None, unencrypted=True)
    key = load_private_key(pair.private_path, None)
    return Kit(artifacts, patches, key, pair.public_path, root)


@pytest.fixture
def device(tmp_path: Path, kit: Kit) -> DeviceStore:
    """An empty device root whose etc/sits/keys trusts the kit's release key."""
    store = DeviceStore(tmp_path / "device")
    store.ensure_layout()
    shutil.copyfile(kit.public_key, store.keys_dir / "release.pub")
    return store


@pytest.fixture
def record():
    """Make a VersionRecord naming an artifact id, for store tests that do not verify files."""

    def make(version: str, artifact_id: str, counter: int, installed_at: str) -> VersionRecord:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        release = Release(
            model=ModelRef(name="tiny", version=version),
            counter=counter,
            artifact=ArtifactRef(
                sha256=artifact_id,
                files={"sits-manifest.json": FileHash(sha256=artifact_id, size=1)},
            ),
            created=now,
            expires=now,
        )
        return VersionRecord(release=release, installed_at=installed_at)

    return make


def write_artifact(dest: Path, files: dict[str, bytes], version: str = "1.0.0") -> str:
    """Write a small artifact-like directory (files + manifest); return its id (manifest sha256)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (dest / name).write_bytes(data)
    manifest = {
        "model": {"name": "tiny", "version": version},
        "files": {n: {"sha256": sha256_bytes(d), "size": len(d)} for n, d in sorted(files.items())},
    }
    data = canonical_json(manifest)
    (dest / "sits-manifest.json").write_bytes(data)
    return sha256_bytes(data)


@pytest.fixture
def store(tmp_path: Path) -> DeviceStore:
    """An empty store under a per-test root prefix, layout created."""
    device = DeviceStore(tmp_path / "device")
    device.ensure_layout()
    return device


@pytest.fixture
def add_version(store: DeviceStore):
    """Promote a small artifact-like directory as `version`; returns its artifact id."""

    def add(version: str, payload: bytes | None = None) -> str:
        staged = store.new_staging_dir(f"test-{version}")
        body = payload if payload is not None else f"weights of {version}".encode()
        artifact_id = write_artifact(staged, {"model.safetensors": body, "config.json": b"{}"})
        store.promote(staged, version)
        return artifact_id

    return add
