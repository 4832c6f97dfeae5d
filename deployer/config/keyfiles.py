"""Checks that the signing keys named in deploy.yaml parse and are EC P-256 PEM keys.

Only checks: loading keys for signing belongs to the signing code. An encrypted private key is
opened with the passphrase from its environment variable, which is never printed or returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from deployer.core.redact import Secret

_CURVE = "secp256r1"


@dataclass(frozen=True)
class KeyProblem:
    """What is wrong with a key file and what to do about it."""

    message: str
    hint: str


def public_key_problem(path: Path, shown: str) -> KeyProblem | None:
    """Why the file at ``path`` (written ``shown`` in the config) is no EC P-256 public key."""
    data, problem = _read(path, shown)
    if data is None:
        return problem
    if b"PRIVATE KEY" in data:
        return KeyProblem(
            f"trusted key {shown} is a private key",
            "trusted_keys take public keys (the .pub file); never hand a private key to devices",
        )
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        return KeyProblem(
            f"trusted key {shown} is not a PEM public key",
            "use the .pub file that `sits-deployer keygen` writes",
        )
    return _curve_problem(key, shown)


def private_key_problem(
    path: Path, shown: str, passphrase_env: str, environ: Mapping[str, str], *, secrets: bool = True
) -> KeyProblem | None:
    """Why the file at ``path`` cannot serve as the EC P-256 signing key, if it cannot.

    With ``secrets`` false (commands that sign nothing), an encrypted key is not opened, so its
    passphrase need not be set.
    """
    data, problem = _read(path, shown)
    if data is None:
        return problem
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # encrypted: only a passphrase opens it
        return _encrypted_key_problem(data, shown, passphrase_env, environ) if secrets else None
    except ValueError:
        return KeyProblem(
            f"private key {shown} is not a PEM private key",
            "use the key file that `sits-deployer keygen` writes (not the .pub file)",
        )
    return _curve_problem(key, shown)


def _encrypted_key_problem(
    data: bytes, shown: str, passphrase_env: str, environ: Mapping[str, str]
) -> KeyProblem | None:
    passphrase = Secret.from_env(passphrase_env, environ)
    if passphrase is None:
        return KeyProblem(
            f"private key {shown} is encrypted and ${passphrase_env} is not set",
            f"export {passphrase_env} with its passphrase, or set signing.passphrase_env",
        )
    try:
        key = serialization.load_pem_private_key(data, password=passphrase.encode())
    except (ValueError, TypeError):
        return KeyProblem(
            f"the passphrase in ${passphrase_env} does not decrypt private key {shown}",
            f"check the value of {passphrase_env}",
        )
    return _curve_problem(key, shown)


def _read(path: Path, shown: str) -> tuple[bytes | None, KeyProblem | None]:
    if not path.is_file():
        return None, KeyProblem(
            f"key file {shown} does not exist",
            f"looked for {path}; create the pair with `sits-deployer keygen -o {_prefix(shown)}`",
        )
    try:
        return path.read_bytes(), None
    except OSError as exc:
        problem = KeyProblem(f"key file {shown} cannot be read: {exc.strerror}", "check its permissions")
        return None, problem


def _prefix(shown: str) -> str:
    """The keygen prefix of a key file name (keys/release.key -> keys/release)."""
    for suffix in (".key", ".pub"):
        if shown.endswith(suffix):
            return shown[: -len(suffix)]
    return shown


def _curve_problem(key: object, shown: str) -> KeyProblem | None:
    if isinstance(key, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey):
        if key.curve.name == _CURVE:
            return None
        kind = f"an EC {key.curve.name} key"
    elif isinstance(key, rsa.RSAPublicKey | rsa.RSAPrivateKey):
        kind = "an RSA key"
    else:
        kind = f"a {type(key).__name__}"
    return KeyProblem(
        f"key {shown} is {kind}; release keys must be EC P-256 (secp256r1)",
        "make a new key pair with `sits-deployer keygen`",
    )
