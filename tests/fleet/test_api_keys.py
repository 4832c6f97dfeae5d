"""Controller-side API keys: read from an env var or a secrets file, stored hashed, never echoed."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from deployer.config.models import AgentSettings, ApiKeys
from deployer.errors import ConfigError
from deployer.push.api_keys import key_file, read_keys

KEY = "k" * 20 + "-secret-marker"


class _Config:
    """The two things read_keys uses of a Config."""

    def __init__(self, agent, base):
        self.agent = agent
        self._base = base

    def resolve(self, relative):
        return self._base / relative


def test_env_and_file_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("SITS_TEST_KEYS", f"{KEY}, other-key-0123456789")
    agent = AgentSettings(host="0.0.0.0", api_keys=ApiKeys(env="SITS_TEST_KEYS"))
    assert read_keys(_Config(agent, tmp_path)) == (KEY, "other-key-0123456789")
    (tmp_path / "keys.txt").write_text(f"{KEY}\n")
    agent = AgentSettings(api_keys=ApiKeys(file="keys.txt"))
    assert read_keys(_Config(agent, tmp_path)) == (KEY,)


def test_the_device_file_holds_hashes_only():
    data = key_file((KEY,)).decode()
    assert KEY not in data
    assert f"sha256:{hashlib.sha256(KEY.encode()).hexdigest()}" in data.splitlines()


def test_errors_never_show_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SITS_TEST_KEYS", "short-marker")
    agent = AgentSettings(api_keys=ApiKeys(env="SITS_TEST_KEYS"))
    with pytest.raises(ConfigError) as info:
        read_keys(_Config(agent, tmp_path))
    assert "short-marker" not in str(info.value) and "key 1" in info.value.message


def test_beyond_loopback_needs_keys():
    with pytest.raises(ValidationError, match="api_keys"):
        AgentSettings(host="0.0.0.0")
    with pytest.raises(ValidationError, match="exactly one"):
        ApiKeys(env="A", file="b")
