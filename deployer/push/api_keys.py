"""The agent's bearer API keys on the controller side: read from where deploy.yaml points (an
environment variable or a secrets file), written to devices hashed, sent with the controller's own
requests. No function here returns or raises a message containing a key.
"""

from __future__ import annotations

import os
import re

from deployer.config.models import Config
from deployer.core.hashing import sha256_bytes
from deployer.errors import ConfigError

__all__ = ["API_KEYS_FILE", "controller_key", "key_file", "read_keys"]

API_KEYS_FILE = "/etc/sits/api-keys"
MIN_KEY_LENGTH = 16  # a guessable key is no key
_SPLIT = re.compile(r"[\s,]+")


def read_keys(config: Config) -> tuple[str, ...]:
    """The keys deploy.yaml's agent.api_keys points to (empty when it names none).

    Raises ConfigError when the variable is unset, the file unreadable, or a key too short; the
    message names the source and the key's position, never its value."""
    source = config.agent.api_keys
    if source is None:
        return ()
    if source.env is not None:
        text = os.environ.get(source.env)
        where = f"${source.env}"
        if text is None:
            raise ConfigError(
                f"agent.api_keys: {where} is not set", hint=f"export {source.env}=<key>[,<key>...]"
            )
    else:
        path = config.resolve(source.file or "")
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"agent.api_keys: cannot read {where}: {exc.strerror}") from exc
    keys = tuple(k for k in _SPLIT.split(text) if k)
    if not keys:
        raise ConfigError(f"agent.api_keys: {where} holds no key", hint="one key per line or comma")
    for number, key in enumerate(keys, start=1):
        if len(key) < MIN_KEY_LENGTH:
            raise ConfigError(
                f"agent.api_keys: key {number} in {where} is shorter than {MIN_KEY_LENGTH} characters",
                hint="make keys with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`",
            )
    return keys


def key_file(keys: tuple[str, ...]) -> bytes:
    """The device's api-keys file: one `sha256:<hex>` line per key, sorted (same keys, same bytes)."""
    lines = sorted({"sha256:" + sha256_bytes(key.encode("utf-8")) for key in keys})
    return (
        "# Written by sits-deployer from deploy.yaml's agent.api_keys (hashes only).\n"
        + "\n".join(lines)
        + "\n"
    ).encode()


def controller_key(config: Config) -> str | None:
    """The key the controller's own requests to agents carry (the first one), or None."""
    keys = read_keys(config)
    return keys[0] if keys else None
