"""Release signing keys (controller side): make them, load them, sign release manifests.

Keys are ECDSA P-256. The private key is written as encrypted PKCS#8 PEM (mode 0600) unless the
caller explicitly asks for an unencrypted one; it is never printed. Key ids are computed as the
device computes them (deployer.core.verify.key_id). Signing an envelope again with another key adds
a signature, so k-of-n releases are signed one key at a time.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from deployer.core.adapter_release import AdapterRelease
from deployer.core.redact import Secret
from deployer.core.release import Envelope, Release, SignatureEntry
from deployer.core.verify import key_id, read_key_file
from deployer.errors import KeyFileError


@dataclass(frozen=True)
class KeyPair:
    """Where keygen wrote a key pair, and its key id."""

    keyid: str
    private_path: Path
    public_path: Path


def generate_key(
    private_path: Path, public_path: Path, *, passphrase: Secret | None, unencrypted: bool = False
) -> KeyPair:
    """Create a P-256 key pair; refuse to overwrite existing files. Raises KeyFileError.

    `passphrase` encrypts the private key; None is allowed only with `unencrypted=True`.
    """
    if passphrase is None and not unencrypted:
        raise KeyFileError(
            "no passphrase for the new private key",
            hint="set the passphrase environment variable, or pass --unencrypted deliberately",
        )
    if passphrase is not None and len(passphrase) < 8:
        raise KeyFileError("the passphrase is shorter than 8 characters", hint="use a longer one")
    key = ec.generate_private_key(ec.SECP256R1())
    encryption = (
        serialization.BestAvailableEncryption(passphrase.encode())
        if passphrase is not None
        else serialization.NoEncryption()
    )
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new(private_path, private_pem, 0o600)
    _write_new(public_path, public_pem, 0o644)
    return KeyPair(key_id(key.public_key()), private_path, public_path)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise KeyFileError(
            f"{path}: already exists; refusing to overwrite a key",
            hint="choose another path, or remove the old key deliberately",
        ) from None
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot create: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def load_private_key(path: Path, passphrase: Secret | None) -> ec.EllipticCurvePrivateKey:
    """Load a P-256 private key PEM. Raises KeyFileError (missing, wrong passphrase, wrong type)."""
    pem = read_key_file(path)
    try:
        key = serialization.load_pem_private_key(pem, password=passphrase.encode() if passphrase else None)
    except TypeError as exc:
        raise KeyFileError(
            f"{path}: the key is encrypted and no passphrase was given",
            hint="set the passphrase environment variable or answer the prompt",
        ) from exc
    except ValueError as exc:
        raise KeyFileError(f"{path}: cannot decrypt or parse the private key (wrong passphrase?)") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise KeyFileError(f"{path}: not an ECDSA P-256 private key", hint="use sits-deployer keygen")
    return key


def is_encrypted(path: Path) -> bool:
    """Whether a private key PEM file is encrypted (so a passphrase is needed to load it)."""
    return b"ENCRYPTED" in read_key_file(path)


def load_signing_key(
    path: Path, passphrase_env: str, environ: Mapping[str, str] | None = None
) -> ec.EllipticCurvePrivateKey:
    """The private key at `path`, opened (when encrypted) with the passphrase in $`passphrase_env`,
    taken as a Secret. Raises KeyFileError (unset variable, wrong passphrase, not a key)."""
    passphrase = None
    if is_encrypted(path):
        passphrase = Secret.from_env(passphrase_env, os.environ if environ is None else environ)
        if passphrase is None:
            raise KeyFileError(
                f"{path} is encrypted and ${passphrase_env} is not set",
                hint=f"export {passphrase_env}=... before running this command",
            )
    return load_private_key(path, passphrase)


def envelope_for(release: Release | AdapterRelease) -> Envelope:
    """An unsigned envelope holding `release`'s (a model's or an adapter's) canonical form."""
    return Envelope(signed=release.model_dump(mode="json"), signatures=[])


def add_signature(envelope: Envelope, key: ec.EllipticCurvePrivateKey) -> Envelope:
    """`envelope` with a signature by `key` added (replacing an older one by the same key)."""
    kid = key_id(key.public_key())
    sig = key.sign(envelope.signed_bytes(), ec.ECDSA(hashes.SHA256()))
    others = [s for s in envelope.signatures if s.keyid != kid]
    entry = SignatureEntry(keyid=kid, sig=base64.b64encode(sig).decode("ascii"))
    return Envelope(signed=envelope.signed, signatures=[*others, entry])
