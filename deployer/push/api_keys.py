"""The agent's bearer API keys on the controller side: read from where deploy.yaml points (an
environment variable or a secrets file), written to devices hashed, sent with the controller's own
requests. No function here returns or raises a message containing a key.
"""

from __future__ import annotations

import os
import re

from deployer.config.models import ApiKeys, Config, UpstreamKey
from deployer.core.hashing import sha256_bytes
from deployer.errors import ConfigError

__all__ = ["API_KEYS_FILE", "controller_key", "key_file", "read_keys", "read_secret_source"]

API_KEYS_FILE = "/etc/sits/api-keys"
MIN_KEY_LENGTH = 16  # a guessable key is no key
_SPLIT = re.compile(r"[\s,]+")


def read_secret_source(
    config: Config, source: ApiKeys | UpstreamKey, field: str, example: str
) -> tuple[str, str]:
    """(text, where it came from) of a secret deploy.yaml points to: an environment variable or a
    file relative to deploy.yaml. ConfigError naming `field` and the source (never the value) when
    the variable is unset or the file unreadable; `example` is the value shape the hint shows."""
    if source.env is not None:
        text, where = os.environ.get(source.env), f"${source.env}"
        if text is None:
            raise ConfigError(f"{field}: {where} is not set", hint=f"export {source.env}={example}")
        return text, where
    path = config.resolve(source.file or "")
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}") from exc


def read_keys(config: Config) -> tuple[str, ...]:
    """The keys deploy.yaml's agent.api_keys points to (empty when it names none).

    Raises ConfigError when the variable is unset, the file unreadable, or a key too short; the
    message names the source and the key's position, never its value."""
    source = config.agent.api_keys
    if source is None:
        return ()
    text, where = read_secret_source(config, source, "agent.api_keys", "<key>[,<key>...]")
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
