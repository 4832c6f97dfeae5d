"""Bearer API keys: the file the controller writes (hashes only) and the check of each request.

The key file, `<root>/etc/sits/api-keys`, holds one `sha256:<hex>` line per key (comments with
`#`). Keys are long random tokens, so one SHA-256 is enough to keep a read of the file from
revealing them; a slow password hash would only slow every request. A presented key is hashed and
compared with every stored hash through `hmac.compare_digest`, without stopping at the first
match, so the time taken says nothing about which key (or how much of one) matched.
Nothing here logs a key, a hash or the Authorization header.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from deployer.errors import ConfigError

__all__ = ["KeyRing", "hash_key", "load_keyring"]

_LINE = re.compile(r"^sha256:([0-9a-f]{64})$")
Verdict = Literal["ok", "missing", "invalid"]


def hash_key(key: str) -> str:
    """The line stored for `key`: `sha256:<hex of the UTF-8 bytes>`."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class KeyRing:
    """The accepted keys' digests, and whether a key is required at all."""

    digests: tuple[bytes, ...]
    required: bool

    def check(self, authorization: str | None) -> Verdict:
        """Judge an Authorization header value ("Bearer <key>")."""
        if not self.required:
            return "ok"
        if not authorization:
            return "missing"
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return "missing"
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        matched = False
        for digest in self.digests:
            matched |= hmac.compare_digest(presented, digest)
        return "ok" if matched else "invalid"


def load_keyring(path: Path, *, required: bool) -> KeyRing:
    """Read the key file. Keys are required when `required` (the API listens beyond loopback) or
    when the file lists any. Raises ConfigError for a required but missing or empty file, or a
    malformed line (named by its number, never by its content)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = None
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot read the API keys: {exc.strerror}", hint="check its owner"
        ) from exc
    digests = []
    for number, line in enumerate((text or "").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ConfigError(
                f"{path}:{number}: not a `sha256:<64 hex digits>` line",
                hint="the controller writes this file from deploy.yaml's agent.api_keys; rerun apply",
            )
        digests.append(bytes.fromhex(match.group(1)))
    if required and not digests:
        raise ConfigError(
            f"the agent listens beyond loopback but {path} lists no API key",
            hint="set agent.api_keys in deploy.yaml (keys from an environment variable or a secrets "
            "file), or listen on 127.0.0.1",
        )
    return KeyRing(tuple(digests), required=required or bool(digests))
