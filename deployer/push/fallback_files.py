"""The device side of deploy.yaml's `fallback:`: the section of agent.yaml it becomes, and the
upstream's API key, which travels as its own file and is kept like a secret.

The key is read where deploy.yaml points (an environment variable or a secrets file) and written to
FALLBACK_KEY_FILE in a directory only the agent's user may enter, the file itself mode 0600; the
agent reads it at start. No function here returns or raises a message containing the key.
"""

from __future__ import annotations

import posixpath
import shlex
from pathlib import Path
from typing import Any

from deployer.config.models import Config, Device, Fallback
from deployer.errors import ConfigError
from deployer.push.api_keys import read_secret_source
from deployer.push.facts import FALLBACK_KEY_FILE, DeviceSite
from deployer.transport import Transport

__all__ = ["FALLBACK_KEY_FILE", "SECRET_FILES", "fallback_files", "fallback_settings", "put_secret"]

SECRET_FILES = frozenset({FALLBACK_KEY_FILE})


def fallback_settings(config: Config, device: Device, site: DeviceSite) -> dict[str, Any] | None:
    """agent.yaml's `fallback:` for this device, or None when it has no fallback."""
    fallback = _active(config, device)
    if fallback is None or fallback.upstream is None:
        return None
    upstream, triggers = fallback.upstream, fallback.triggers
    section: dict[str, Any] = {
        "base_url": upstream.base_url,
        "model": upstream.model,
        "policy": fallback.policy,
        "deadline_ms": triggers.deadline_ms,
        "min_confidence": triggers.min_confidence,
        "confidence_tokens": triggers.confidence_tokens,
        "not_ready": triggers.not_ready,
        "overloaded": triggers.overloaded,
        "first_token_timeout_s": upstream.first_token_timeout.total_seconds(),
    }
    if upstream.api_key is not None:
        section["api_key_file"] = site.path(FALLBACK_KEY_FILE)
    return section


def fallback_files(config: Config, device: Device) -> dict[str, bytes]:
    """{FALLBACK_KEY_FILE: the key} when this device falls back to an upstream that needs one."""
    fallback = _active(config, device)
    key = _read_key(config, fallback) if fallback is not None else None
    return {FALLBACK_KEY_FILE: (key + "\n").encode()} if key is not None else {}


def _active(config: Config, device: Device) -> Fallback | None:
    """The device's fallback, unless its policy is off (then the agent has none, nor the key)."""
    fallback = config.fallback_for(device)
    return None if fallback is None or fallback.policy == "off" else fallback


def _read_key(config: Config, fallback: Fallback) -> str | None:
    source = fallback.upstream.api_key if fallback.upstream else None
    if source is None:
        return None
    text, where = read_secret_source(config, source, "fallback.upstream.api_key", "<key>")
    lines = text.strip().splitlines()
    if not lines or not lines[0].strip():
        raise ConfigError(
            f"fallback.upstream.api_key: {where} holds no key", hint="put the key on its first line"
        )
    return lines[0].strip()


def put_secret(site: DeviceSite, transport: Transport, local: Path, device_path: str, owner: str) -> int:
    """Upload a secret file: into a directory that is 0700 before the first byte arrives, then the
    file 0600, both handed to `owner` (the agent's user) where that user exists. Returns the bytes
    sent."""
    folder = shlex.quote(site.path(posixpath.dirname(device_path)))
    target = shlex.quote(site.path(device_path))
    transport.run(f"umask 077 && mkdir -p {folder} && chmod 700 {folder}", timeout=30).check(
        f"{site.name}: preparing {posixpath.dirname(device_path)}"
    )
    sent = transport.put(local, site.file(device_path)).bytes_sent
    own = f"id -u {owner} >/dev/null 2>&1 && [ $(id -u) = 0 ] && chown -R {owner} {folder}"
    transport.run(f"chmod 600 {target} && {{ {own} || true; }}", timeout=30).check(
        f"{site.name}: securing {device_path}"
    )
    return sent
