"""Device-side verification of releases: a pure core that takes data and returns or raises.

`verify_release` checks, in this order, and raises the first failure::

    SignatureError     fewer than `threshold` valid signatures from trusted keys
    FormatError        the signed release is malformed
    ExpiredError       now >= expires
    ReplayError        counter <= the installed counter (replay or downgrade)
    BaseMismatchError  a patch release whose base is not the installed artifact

`check_patch` (length, then sha256) and `check_files` (every file of the artifact, so files of two
releases cannot be mixed) finish the job. The functions ending in `_file`/`_dir` are the I/O edges:
they only hash files and hand the results to the pure checks; `apply_verified_patch` runs the whole
sequence for a device. Stdlib, pydantic and `cryptography` only.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from deployer.core.fsutil import read_regular
from deployer.core.hashing import sha256_file
from deployer.core.patch_format import FileRef, PatchHeader, list_files
from deployer.core.release import Envelope, FileHash, Release, parse_release
from deployer.errors import (
    BaseMismatchError,
    ExpiredError,
    FormatError,
    HashMismatchError,
    IntegrityError,
    KeyFileError,
    ReplayError,
    SignatureError,
)

if TYPE_CHECKING:  # patch_apply (numpy) is imported only where a patch is applied
    from deployer.core.patch_apply import AppliedPatch

MAX_KEY_BYTES = 64 * 1024
KEY_HINT = "sign with a trusted key, or install its public key among the trusted keys"


@dataclass(frozen=True)
class TrustedKeys:
    """Public keys a device trusts, by key id, and how many of them must sign (k of n)."""

    keys: Mapping[str, ec.EllipticCurvePublicKey]
    threshold: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.threshold <= max(len(self.keys), 1) or not self.keys:
            raise KeyFileError(
                f"threshold {self.threshold} needs between 1 and {len(self.keys)} trusted keys",
                hint="install more trusted public keys or lower the threshold",
            )


@dataclass(frozen=True)
class Installed:
    """What the device has now: its release counter and artifact id (None when empty)."""

    counter: int = 0
    artifact_sha256: str | None = None


def key_id(public_key: ec.EllipticCurvePublicKey) -> str:
    """First 16 hex digits of the sha256 of the key's DER SubjectPublicKeyInfo."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:16]


def load_public_key(pem: bytes, where: str) -> tuple[str, ec.EllipticCurvePublicKey]:
    """Parse a P-256 public key PEM; return (key id, key). Raises KeyFileError."""
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(
            f"{where}: not a PEM public key ({type(exc).__name__})",
            hint="a trusted key is the .pub file sits-deployer keygen writes; replace or remove this one",
        ) from exc
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise KeyFileError(f"{where}: not an ECDSA P-256 public key", hint="use sits-deployer keygen")
    return key_id(key), key


def read_key_file(path: Path) -> bytes:
    """A key file's bytes: a regular file of at most MAX_KEY_BYTES (no PEM key is longer), never a
    pipe or device that would hang or flood the reader. Raises KeyFileError naming the path."""
    try:
        return read_regular(path, MAX_KEY_BYTES)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the key: {exc.strerror or exc}") from exc


def load_trusted_keys(
    paths: Iterable[Path], threshold: int = 1, *, on_bad: Callable[[KeyFileError], None] | None = None
) -> TrustedKeys:
    """Read public key files into a TrustedKeys. Raises KeyFileError.

    With `on_bad`, a file that is not a usable key is handed to it (its error names the file) and
    left out instead: fewer keys can only make fewer releases valid.
    """
    keys: dict[str, ec.EllipticCurvePublicKey] = {}
    for path in paths:
        try:
            kid, key = load_public_key(read_key_file(path), str(path))
        except KeyFileError as exc:
            if on_bad is None:
                raise
            on_bad(exc)
            continue
        keys[kid] = key
    if not keys:
        raise KeyFileError("none of the trusted key files holds a usable key", hint=KEY_HINT)
    return TrustedKeys(keys, threshold)


def load_usable_keys(
    paths: Iterable[Path], threshold: int, *, where: str, warn: Callable[[str], None]
) -> TrustedKeys:
    """The trusted keys in `paths`, skipping any file that is not a usable key: `warn` gets a
    message naming it. Skipping can only narrow trust (fewer keys make fewer releases valid, and
    the threshold still applies), while refusing would let one stray file stop every update; the
    device and the controller's pre-send check both load keys this way, so they agree.

    Raises KeyFileError when too few usable keys remain, naming every file skipped in `where`.
    """
    skipped: list[str] = []

    def skip(exc: KeyFileError) -> None:
        warn(f"trusted key skipped: {exc.message}")
        skipped.append(exc.message)

    try:
        return load_trusted_keys(paths, threshold, on_bad=skip)
    except KeyFileError as exc:
        if not skipped:
            raise
        raise KeyFileError(
            f"{exc.message}; unusable key files in {where}: {'; '.join(skipped)}",
            hint="replace or remove the unusable .pub files (sits-deployer keygen writes them)",
        ) from exc


def verify_release(
    envelope: Envelope, trusted: TrustedKeys, *, now: datetime, installed: Installed | None = None
) -> Release:
    """Return the release if it may be installed now over `installed`; raise otherwise."""
    check_signatures(envelope, trusted)
    release = parse_release(envelope.signed, "release manifest")
    if now >= release.expires_at():
        raise ExpiredError(
            f"release {release.model.version} (counter {release.counter}) expired at {release.expires}",
            hint="ask for a freshly signed release manifest",
        )
    installed = installed or Installed()
    if release.counter <= installed.counter:
        raise ReplayError(
            f"release counter {release.counter} is not above the installed {installed.counter}: "
            "a replayed or downgraded release",
            hint="a deliberate rollback is a new release naming the old artifact with a higher counter",
        )
    if release.patch is not None and release.patch.base_sha256 != installed.artifact_sha256:
        raise BaseMismatchError(
            f"the patch is for base {release.patch.base_version} "
            f"({release.patch.base_sha256[:16]}...), but this device has "
            f"{(installed.artifact_sha256 or 'nothing')[:16]}...",
            hint="send the full artifact or a patch made from the installed version",
        )
    return release


def check_signatures(envelope: Envelope, trusted: TrustedKeys) -> tuple[str, ...]:
    """Key ids of the valid trusted signatures; raises SignatureError below the threshold."""
    data = envelope.signed_bytes()
    valid: set[str] = set()
    invalid: set[str] = set()
    unknown: set[str] = set()
    for entry in envelope.signatures:
        key = trusted.keys.get(entry.keyid)
        if key is None:
            unknown.add(entry.keyid)
        elif _signature_ok(key, entry.sig, data):
            valid.add(entry.keyid)
        else:
            invalid.add(entry.keyid)
    if len(valid) >= trusted.threshold:
        return tuple(sorted(valid))
    if invalid:
        raise SignatureError(
            f"signature by key {', '.join(sorted(invalid))} does not verify: the release manifest "
            "or its signature was altered, or another key signed under this id",
            hint="do not install; fetch the release again from the controller",
        )
    if not valid and unknown:
        raise SignatureError(
            f"signed only by unknown key id(s) {', '.join(sorted(unknown))}; trusted: "
            f"{', '.join(sorted(trusted.keys))}",
            hint=KEY_HINT,
        )
    if not envelope.signatures:
        raise SignatureError("the release manifest is not signed", hint="run sits-deployer sign")
    raise SignatureError(
        f"{len(valid)} valid signature(s) from trusted keys, {trusted.threshold} required "
        f"({trusted.threshold} of {len(trusted.keys)})",
        hint="have more of the trusted keys sign the release (sits-deployer sign --key ...)",
    )


def _signature_ok(key: ec.EllipticCurvePublicKey, sig: str, data: bytes) -> bool:
    try:
        der = base64.b64decode(sig, validate=True)
        # Only the canonical base64 form counts: unused padding bits must not make a second
        # spelling of the same signature that still verifies.
        if base64.b64encode(der).decode("ascii") != sig:
            return False
        key.verify(der, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


def check_patch(release: Release, size: int, sha256: str, where: str = "patch") -> None:
    """The patch's length, then its sha256, against the release. Raises FormatError/HashMismatch."""
    if release.patch is None:
        raise FormatError(f"{where}: the release carries no patch; install the full artifact")
    if size != release.patch.size:
        raise FormatError(
            f"{where}: is {size} bytes, the release says {release.patch.size} (truncated or padded)",
            hint="download the patch again",
        )
    if sha256 != release.patch.sha256:
        raise HashMismatchError(
            f"{where}: sha256 {sha256[:16]}... is not the release's {release.patch.sha256[:16]}...",
            hint="the patch is corrupt or from another release; download it again",
        )


def check_files(release: Release, actual: Mapping[str, FileHash], where: str = "artifact") -> None:
    """Every file of the release present with its hash, and no others. Raises HashMismatchError."""
    expected = release.artifact.files
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing or extra:
        raise HashMismatchError(
            f"{where}: files differ from release {release.model.version}: missing {missing}, "
            f"unexpected {extra}",
            hint="the directory mixes files of different releases; install the release again",
        )
    for name, want in sorted(expected.items()):
        if actual[name] != want:
            raise HashMismatchError(
                f"{where}/{name}: sha256 {actual[name].sha256[:16]}... is not release "
                f"{release.model.version}'s {want.sha256[:16]}... (files from two releases mixed?)",
                hint="install the release again; nothing was promoted",
            )


def verify_patch_file(path: Path, release: Release) -> None:
    """I/O edge of check_patch: measure the patch, and hash it only when its length is right."""
    size = path.stat().st_size
    right_size = release.patch is not None and size == release.patch.size
    check_patch(release, size, sha256_file(path) if right_size else "", str(path))


def verify_artifact_dir(directory: Path, release: Release) -> None:
    """I/O edge of check_files: hash every regular file under `directory`."""
    actual = {
        rel: FileHash(sha256=sha256_file(p), size=p.stat().st_size)
        for rel, p in list_files(directory).items()
    }
    check_files(release, actual, str(directory))


def apply_release_patch(
    release: Release,
    patch: Path,
    base_dir: Path,
    out_dir: Path,
    *,
    before_write: Callable[[PatchHeader], None] | None = None,
) -> AppliedPatch:
    """Apply the patch of a verified `release`, reading one open file throughout.

    Its length, then its sha256 against the release; its header's target files against the
    release's file list (names, sizes, sha256) and `before_write` (the disk-space check) before
    anything is written; then the patch is applied from the same open file. Raises FormatError,
    HashMismatchError, BaseMismatchError, UnsafePathError, and what `before_write` raises.
    """
    from deployer.core.patch_apply import apply_open_patch, open_patch

    expected = {n: FileRef(f.sha256, f.size) for n, f in release.artifact.files.items()}
    with open_patch(patch) as pf:
        right_size = release.patch is not None and pf.size == release.patch.size
        check_patch(release, pf.size, pf.sha256() if right_size else "", str(patch))
        return apply_open_patch(pf, base_dir, out_dir, expect=expected, before_write=before_write)


def apply_verified_patch(
    envelope: Envelope,
    patch: Path,
    base_dir: Path,
    out_dir: Path,
    trusted: TrustedKeys,
    *,
    now: datetime,
    installed: Installed,
) -> Release:
    """The device's whole check-then-apply, in order; returns the release once `out_dir` holds it.

    Release (signatures, expiry, counter, base) -> patch length and hash -> apply into `out_dir`
    (every output hash) -> every file against the release. On failure the files written are
    removed and the error of the failed check is raised; nothing is promoted here.
    """
    release = verify_release(envelope, trusted, now=now, installed=installed)
    applied = apply_release_patch(release, patch, base_dir, out_dir)
    try:
        verify_artifact_dir(out_dir, release)
    except IntegrityError:
        for f in applied.files:
            (out_dir / f.path).unlink(missing_ok=True)
        raise
    return release
