"""The release manifest: what a device is asked to install, in a signed envelope.

Envelope (wire form)::

    {"signed": {...release...}, "signatures": [{"keyid": "<16 hex>", "sig": "<base64 DER>"}]}

The signed bytes are the canonical JSON of `envelope["signed"]` exactly as received, so signing
and verifying never depend on how a model re-serializes: RFC 8785 for format_version 2 (what is
signed now), the legacy encoder for format_version 1 (still verified; deployer/core/canonical.py
says where the two differ). The release binds the target artifact's id
(sha256 of its sits-manifest.json) and every file's hash, so weights, tokenizer and chat template
cannot be mixed across releases. Imports pydantic and the standard library only (device side too).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployer.core.canonical import canonical_json, legacy_canonical_json, parse_json
from deployer.core.hashing import sha256_file
from deployer.core.manifest import MANIFEST_NAME, read_manifest
from deployer.errors import FormatError

# Format 1 was signed over the legacy canonical form; it is still accepted and verified over it.
FORMAT_VERSION: Literal[2] = 2
MAX_ENVELOPE_BYTES = 4 * 1024 * 1024
MAX_SIGNATURES = 32
SHA256 = r"^[0-9a-f]{64}$"
KEYID = r"^[0-9a-f]{16}$"
TIMESTAMP = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$"
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileHash(_Strict):
    """A file's sha256 and size."""

    sha256: str = Field(pattern=SHA256)
    size: int = Field(ge=0)


class ModelRef(_Strict):
    """The model and version being released."""

    name: str = Field(min_length=1, max_length=200)
    version: str = Field(min_length=1, max_length=100)


class ArtifactRef(_Strict):
    """The target artifact: its id and every file, sits-manifest.json included."""

    sha256: str = Field(pattern=SHA256)
    files: dict[str, FileHash]


class PatchRef(_Strict):
    """A patch that turns `base_version` (artifact id `base_sha256`) into the target."""

    base_version: str = Field(min_length=1, max_length=100)
    base_sha256: str = Field(pattern=SHA256)
    sha256: str = Field(pattern=SHA256)
    size: int = Field(ge=0)


class Release(_Strict):
    """The signed part of a release manifest."""

    kind: Literal["sits-release"] = "sits-release"
    format_version: Literal[1, 2] = FORMAT_VERSION
    model: ModelRef
    # JSON numbers carry integers exactly up to 2**53 - 1 (RFC 8785 refuses larger ones).
    counter: int = Field(ge=1, le=2**53 - 1)
    artifact: ArtifactRef
    patch: PatchRef | None = None
    created: str = Field(pattern=TIMESTAMP)
    expires: str = Field(pattern=TIMESTAMP)
    quality: dict[str, Any] | None = None

    def expires_at(self) -> datetime:
        """Expiry as an aware UTC datetime."""
        return parse_time(self.expires)

    def canonical(self) -> bytes:
        """The exact bytes that are signed."""
        return signed_form(self.model_dump(mode="json"))


class SignatureEntry(_Strict):
    """One signature: the key id and a base64 DER ECDSA signature."""

    keyid: str = Field(pattern=KEYID)
    sig: str = Field(min_length=1, max_length=512)


class Envelope(_Strict):
    """The wire form. `signed` stays raw JSON until its signatures are checked."""

    signed: dict[str, Any]
    signatures: list[SignatureEntry] = Field(max_length=MAX_SIGNATURES)

    def signed_bytes(self) -> bytes:
        """The canonical bytes of `signed` as received: what the signatures cover."""
        return signed_form(self.signed)

    def to_bytes(self) -> bytes:
        """The envelope as written to disk (canonical JSON)."""
        return canonical_json(self.model_dump(mode="json"))


def signed_form(signed: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the canonical JSON of the format the release claims.

    Choosing by the unverified `format_version` is safe: the field is inside the signed bytes,
    so a changed version changes the bytes and the signatures fail. Raises FormatError.
    """
    version = signed.get("format_version")
    if type(version) is int and version == 1:
        return legacy_canonical_json(signed)
    return canonical_json(signed)


def format_time(moment: datetime) -> str:
    """UTC ISO 8601 to the second, e.g. 2026-01-31T12:00:00Z."""
    return moment.astimezone(UTC).strftime(_TIME_FORMAT)


def parse_time(text: str) -> datetime:
    """Parse format_time's output. Raises FormatError."""
    try:
        return datetime.strptime(text, _TIME_FORMAT).replace(tzinfo=UTC)
    except ValueError as exc:
        raise FormatError(f"timestamp {text!r} is not UTC ISO 8601 ({exc})") from exc


def parse_envelope(data: bytes, where: str) -> Envelope:
    """Parse envelope bytes (bounded). Raises FormatError naming `where`."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise FormatError(f"{where}: release manifest larger than {MAX_ENVELOPE_BYTES} bytes")
    doc = parse_json(data, f"{where}: release manifest")
    try:
        return Envelope.model_validate(doc)
    except ValidationError as exc:
        raise FormatError(f"{where}: malformed release envelope: {_first(exc)}") from exc


def parse_release(signed: dict[str, Any], where: str) -> Release:
    """Validate the (already signature-checked) signed part. Raises FormatError."""
    try:
        release = Release.model_validate(signed)
    except ValidationError as exc:
        raise FormatError(f"{where}: malformed release: {_first(exc)}") from exc
    parse_time(release.created)
    parse_time(release.expires)
    check_artifact_id(release.artifact, MANIFEST_NAME, where)
    return release


def check_artifact_id(artifact: ArtifactRef, manifest_name: str, where: str) -> None:
    """A release's artifact id must be the sha256 of the manifest file it lists (a model's or an
    adapter's). Raises FormatError."""
    listed = artifact.files.get(manifest_name)
    if listed is None or listed.sha256 != artifact.sha256:
        raise FormatError(
            f"{where}: artifact id {artifact.sha256[:16]}... is not the sha256 of its "
            f"{manifest_name} ({listed.sha256[:16] + '...' if listed else 'not listed'})",
            hint="the release was made wrongly; make it again with sits-deployer release",
        )


def read_envelope(path: Path) -> Envelope:
    """Read a release manifest file, refusing anything larger than MAX_ENVELOPE_BYTES."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_ENVELOPE_BYTES + 1)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the release manifest: {exc.strerror or exc}") from exc
    return parse_envelope(data, str(path))


def make_release(
    artifact_dir: Path,
    *,
    counter: int,
    expires_in: timedelta,
    now: datetime | None = None,
    patch: PatchRef | None = None,
) -> Release:
    """A release for the artifact at `artifact_dir`, its files hashed now (controller side).

    Raises FormatError if the artifact manifest is missing or invalid, or a file does not match it.
    """
    manifest = read_manifest(artifact_dir)
    files = {MANIFEST_NAME: _hash(artifact_dir / MANIFEST_NAME)}
    for name, info in manifest.files.items():
        actual = _hash(artifact_dir / name)
        if actual.sha256 != info.sha256:
            raise FormatError(
                f"{artifact_dir / name}: does not match its sits-manifest.json entry",
                hint="the artifact was modified after it was built; rebuild it",
            )
        files[name] = actual
    now = now or datetime.now(UTC)
    quality = manifest.quality.model_dump(mode="json") if manifest.quality else None
    return Release(
        model=ModelRef(name=manifest.model.name, version=manifest.model.version),
        counter=counter,
        artifact=ArtifactRef(sha256=files[MANIFEST_NAME].sha256, files=files),
        patch=patch,
        created=format_time(now),
        expires=format_time(now + expires_in),
        quality=quality,
    )


def _hash(path: Path) -> FileHash:
    if not path.is_file() or path.is_symlink():
        raise FormatError(f"{path}: listed in the artifact but missing or not a regular file")
    return FileHash(sha256=sha256_file(path), size=path.stat().st_size)


def _first(exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<root>"
    return f"{loc}: {first['msg']}"
