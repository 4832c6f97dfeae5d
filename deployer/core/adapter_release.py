"""Adapter artifacts and adapter releases: a LoRA adapter shipped apart from its base (issue #41).

An adapter artifact is a directory (``deployer.core.lora``'s files) plus ``sits-adapter.json``,
its manifest: the adapter's name and version, the id of the base artifact it was made for, every
file's sha256 and size, and its quality figures. The manifest's sha256 is the artifact id, so the
id is content-addressed and binds the base: an adapter for another base has another id.

An adapter release is signed like a model release (`deployer.core.release`'s envelope, RFC 8785
canonical JSON, k-of-n ECDSA signatures) over an `AdapterRelease`: its own ``kind``, so a model
release can never pass for an adapter release or the reverse; a counter per adapter name (the
device's anti-rollback floor for that adapter); an expiry; the base artifact id; optionally the
patch from an earlier version of the adapter. `verify_adapter_release` is the device's check, in
the order of `deployer.core.verify.verify_release`, with the base check added. Pydantic and the
standard library (and `cryptography` through verify): the device imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployer.core.canonical import canonical_json, parse_json
from deployer.core.fsutil import atomic_write
from deployer.core.hashing import sha256_file
from deployer.core.patch_format import FileRef, list_files
from deployer.core.release import (
    SHA256,
    TIMESTAMP,
    ArtifactRef,
    Envelope,
    FileHash,
    ModelRef,
    PatchRef,
    check_artifact_id,
    format_time,
    parse_time,
)
from deployer.core.verify import TrustedKeys, check_signatures
from deployer.errors import (
    BaseMismatchError,
    ExpiredError,
    FormatError,
    HashMismatchError,
    ReplayError,
)

ADAPTER_MANIFEST = "sits-adapter.json"
MAX_ADAPTER_MANIFEST_BYTES = 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AdapterManifest(_Strict):
    """`sits-adapter.json`: what the adapter artifact is and holds. Its sha256 is the artifact id."""

    kind: Literal["sits-adapter-artifact"] = "sits-adapter-artifact"
    format_version: Literal[1] = 1
    adapter: ModelRef
    base_artifact_id: str = Field(pattern=SHA256)
    files: dict[str, FileHash]
    quality: dict[str, Any] | None = None
    builder: dict[str, str]


class AdapterRelease(_Strict):
    """The signed part of an adapter release."""

    kind: Literal["sits-adapter-release"] = "sits-adapter-release"
    # 2: signed over RFC 8785 canonical JSON (deployer.core.release.signed_form), like model releases.
    format_version: Literal[2] = 2
    adapter: ModelRef
    base_artifact_id: str = Field(pattern=SHA256)
    counter: int = Field(ge=1, le=2**53 - 1)
    artifact: ArtifactRef
    patch: PatchRef | None = None
    created: str = Field(pattern=TIMESTAMP)
    expires: str = Field(pattern=TIMESTAMP)
    quality: dict[str, Any] | None = None


def write_adapter_manifest(directory: Path, manifest: AdapterManifest) -> str:
    """Write `sits-adapter.json` (canonical JSON: same manifest, same bytes) and return the
    artifact id, its sha256."""
    atomic_write(directory / ADAPTER_MANIFEST, canonical_json(manifest.model_dump(mode="json")))
    return sha256_file(directory / ADAPTER_MANIFEST)


def hash_files(directory: Path, names: list[str]) -> dict[str, FileHash]:
    """sha256 and size of each named regular file of `directory`. Raises FormatError."""
    out = {}
    for name in names:
        path = directory / name
        if not path.is_file() or path.is_symlink():
            raise FormatError(f"{path}: missing or not a regular file")
        out[name] = FileHash(sha256=sha256_file(path), size=path.stat().st_size)
    return out


def read_adapter_manifest(directory: Path) -> AdapterManifest:
    """Read and validate `<directory>/sits-adapter.json`. Raises FormatError."""
    path = directory / ADAPTER_MANIFEST
    try:
        with path.open("rb") as f:
            data = f.read(MAX_ADAPTER_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the adapter manifest ({exc.strerror or exc})") from exc
    if len(data) > MAX_ADAPTER_MANIFEST_BYTES:
        raise FormatError(f"{path}: larger than {MAX_ADAPTER_MANIFEST_BYTES} bytes")
    try:
        return AdapterManifest.model_validate(parse_json(data, str(path)))
    except ValidationError as exc:
        raise FormatError(f"{path}: invalid adapter manifest: {_first(exc)}", hint="rebuild it") from exc


def make_adapter_release(
    artifact_dir: Path,
    *,
    counter: int,
    expires_in: timedelta,
    now: datetime | None = None,
    patch: PatchRef | None = None,
) -> AdapterRelease:
    """A release of the adapter artifact at `artifact_dir`, its files hashed now (controller side).
    Raises FormatError when a file does not match the manifest."""
    manifest = read_adapter_manifest(artifact_dir)
    files = hash_files(artifact_dir, [ADAPTER_MANIFEST, *sorted(manifest.files)])
    for name, want in manifest.files.items():
        if files[name] != want:
            raise FormatError(
                f"{artifact_dir / name}: does not match its {ADAPTER_MANIFEST} entry",
                hint="the adapter artifact was modified after it was built; rebuild it",
            )
    now = now or datetime.now(UTC)
    return AdapterRelease(
        adapter=manifest.adapter,
        base_artifact_id=manifest.base_artifact_id,
        counter=counter,
        artifact=ArtifactRef(sha256=files[ADAPTER_MANIFEST].sha256, files=files),
        patch=patch,
        created=format_time(now),
        expires=format_time(now + expires_in),
        quality=manifest.quality,
    )


def parse_adapter_release(signed: Mapping[str, Any], where: str) -> AdapterRelease:
    """Validate the (signature-checked) signed part. Raises FormatError, which says so when the
    envelope holds a model release instead."""
    if signed.get("kind") != "sits-adapter-release":
        raise FormatError(
            f"{where}: not an adapter release (kind {signed.get('kind')!r})",
            hint="install a model release with `sits-agent install`, an adapter release with "
            "`sits-agent adapter install`",
        )
    try:
        release = AdapterRelease.model_validate(dict(signed))
    except ValidationError as exc:
        raise FormatError(f"{where}: malformed adapter release: {_first(exc)}") from exc
    parse_time(release.created)
    check_artifact_id(release.artifact, ADAPTER_MANIFEST, where)
    return release


def verify_adapter_release(
    envelope: Envelope,
    trusted: TrustedKeys,
    *,
    now: datetime,
    counter_floor: int,
    base_artifact_id: str | None,
    installed_artifact_id: str | None = None,
) -> AdapterRelease:
    """The adapter release if it may be installed now; raises the first failure.

    SignatureError (below the threshold of trusted keys), FormatError (malformed, or not an adapter
    release), ExpiredError, ReplayError (counter at or below `counter_floor`, the highest counter
    of this adapter installed: a replay or a downgrade), BaseMismatchError (made for another base
    than the device's `base_artifact_id`, or a patch from another adapter version than
    `installed_artifact_id`).
    """
    check_signatures(envelope, trusted)
    release = parse_adapter_release(envelope.signed, "adapter release")
    name, version = release.adapter.name, release.adapter.version
    if now >= parse_time(release.expires):
        raise ExpiredError(
            f"adapter release {name} {version} (counter {release.counter}) expired at {release.expires}",
            hint="ask for a freshly signed adapter release",
        )
    if release.counter <= counter_floor:
        raise ReplayError(
            f"adapter {name}: release counter {release.counter} is not above the installed "
            f"{counter_floor}: a replayed or downgraded adapter release",
            hint="a deliberate rollback is a new release of the old adapter with a higher counter",
        )
    if release.base_artifact_id != base_artifact_id:
        raise BaseMismatchError(
            f"adapter {name} {version} was made for base artifact {release.base_artifact_id[:16]}..., "
            f"but this device serves {(base_artifact_id or 'no model')[:16]}...",
            hint="build the adapter against the base the device runs (sits-deployer build), or "
            "roll the base out first",
        )
    if release.patch is not None and release.patch.base_sha256 != installed_artifact_id:
        raise BaseMismatchError(
            f"adapter {name}: the patch is from version {release.patch.base_version} "
            f"({release.patch.base_sha256[:16]}...), but this device has "
            f"{(installed_artifact_id or 'none')[:16]}...",
            hint="send the full adapter artifact or a patch from the installed version",
        )
    return release


def expected_files(release: AdapterRelease) -> dict[str, FileRef]:
    """The release's files as a patch's expected targets."""
    return {n: FileRef(f.sha256, f.size) for n, f in release.artifact.files.items()}


def check_adapter_dir(directory: Path, release: AdapterRelease) -> None:
    """Every file of the release present in `directory` with its hash, and no others. Raises
    HashMismatchError."""
    actual = {
        rel: FileHash(sha256=sha256_file(p), size=p.stat().st_size)
        for rel, p in list_files(directory).items()
    }
    expected = release.artifact.files
    if set(actual) != set(expected):
        raise HashMismatchError(
            f"{directory}: files differ from adapter release {release.adapter.version}: missing "
            f"{sorted(set(expected) - set(actual))}, unexpected {sorted(set(actual) - set(expected))}",
            hint="send the adapter release again",
        )
    for name, want in sorted(expected.items()):
        if actual[name] != want:
            raise HashMismatchError(
                f"{directory}/{name}: sha256 {actual[name].sha256[:16]}... is not the adapter "
                f"release's {want.sha256[:16]}... (tampered or corrupt)",
                hint="send the adapter release again; nothing was installed",
            )


def _first(exc: ValidationError) -> str:
    first = exc.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc']) or '<root>'}: {first['msg']}"
