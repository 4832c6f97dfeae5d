"""deploy.yaml's `fallback:`: validated like the rest (file:line:column), overridden per profile and
device, rendered into each device's agent.yaml, its key kept out of everything but the key file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployer.agent.settings import FallbackSettings
from deployer.config import load_config, validate_file
from deployer.push.bootstrap import agent_settings, desired_files
from deployer.push.facts import FALLBACK_KEY_FILE, DeviceSite
from deployer.push.fallback_files import put_secret
from deployer.transport import LocalTransport

KEY = "sk-cloud-" + "s" * 40
FLEET = """\
fallback:
  upstream:
    base_url: http://10.0.0.5:8080/v1
    model: big
    api_key: {env: UPSTREAM_KEY}
  triggers: {deadline_ms: 250}
"""


def _findings(path: Path, environ: dict | None = None) -> list[str]:
    found = validate_file(path, {"UPSTREAM_KEY": KEY} if environ is None else environ)
    return [str(f) for f in found if f.is_error]  # not the fixture's own warnings (no signing section)


@pytest.mark.parametrize(
    ("triggers", "column", "message"),  # the column of the offending value
    [
        ("{min_confidence: 1.0}", 30, "less than 1"),
        ("{min_confidence: 0}", 30, "greater than 0"),
        ("{min_confidence: 0.6, confidence_tokens: 0}", 54, "greater than or equal to 1"),
    ],
)
def test_the_confidence_trigger_is_range_checked_where_it_is_written(write_config, triggers, column, message):
    path = write_config(FLEET.replace("{deadline_ms: 250}", triggers))
    [finding] = _findings(path)
    assert f"{path}:25:{column}: fallback.triggers." in finding and message in finding


def test_the_confidence_trigger_reaches_the_agent(write_config):
    path = write_config(FLEET.replace("{deadline_ms: 250}", "{min_confidence: 0.6, confidence_tokens: 2}"))
    assert _findings(path) == []
    config = load_config(path, {"UPSTREAM_KEY": KEY})
    site = DeviceSite.of(config, config.fleet.devices[0])
    section = yaml.safe_load(agent_settings(config, site))["fallback"]
    settings = FallbackSettings(**section)  # what the agent reads at start
    assert (settings.min_confidence, settings.confidence_tokens) == (0.6, 2)


def test_a_device_that_falls_back_needs_an_upstream(write_config):
    path = write_config("fallback:\n  policy: always\n")
    findings = _findings(path)
    assert len(findings) == 2  # d1 and d2
    assert all(f"{path}:20:1" in f and "falls back (always) but no upstream is set" in f for f in findings)


def test_the_key_source_must_be_there(write_config):
    path = write_config(FLEET)
    [finding] = _findings(path, environ={})
    assert f"{path}:24:" in finding and "$UPSTREAM_KEY is not set" in finding
    assert KEY not in finding
    missing = write_config(FLEET.replace("{env: UPSTREAM_KEY}", "{file: secrets/up.key}"))
    assert "file secrets/up.key does not exist" in _findings(missing)[0]


def test_profile_and_device_override_the_fields_they_set(write_config, tmp_path, monkeypatch):
    monkeypatch.setenv("UPSTREAM_KEY", KEY)
    path = write_config(
        FLEET,
        replace=(
            (
                '  small: {memory: 4Gi, cpu: "2"}',
                '  small: {memory: 4Gi, cpu: "2", fallback: {policy: always}}',
            ),
            (
                "      labels: {ring: canary}",
                "      labels: {ring: canary}\n      fallback: {policy: off}",
            ),  # bare, as docs/fallback.md writes it (YAML 1.1 reads it as false)
        ),
    )
    config = load_config(path, {"UPSTREAM_KEY": KEY})
    d1, d2 = config.fleet.devices
    assert config.fallback_for(d1).policy == "off"
    effective = config.fallback_for(d2)
    assert effective.policy == "always" and effective.triggers.deadline_ms == 250
    assert effective.upstream.model == "big"
    site = DeviceSite.of(config, d2)
    section = yaml.safe_load(agent_settings(config, site))["fallback"]
    assert section["policy"] == "always" and section["deadline_ms"] == 250
    assert section["api_key_file"] == site.path(FALLBACK_KEY_FILE)
    files = desired_files(config, site, systemd=False)
    assert files[FALLBACK_KEY_FILE] == f"{KEY}\n".encode()
    assert all(KEY.encode() not in data for name, data in files.items() if name != FALLBACK_KEY_FILE)


def test_without_fallback_nothing_changes_on_the_device(write_config):
    config = load_config(write_config(), {})
    site = DeviceSite.of(config, config.fleet.devices[0])
    assert "fallback" not in yaml.safe_load(agent_settings(config, site))
    assert FALLBACK_KEY_FILE not in desired_files(config, site, systemd=False)


def test_the_key_file_is_0600_in_a_0700_directory(tmp_path):
    root = tmp_path / "device"
    root.mkdir()
    local = tmp_path / "key"
    local.write_text(KEY + "\n")
    site = DeviceSite("d", "localhost", str(root), True, 8080, "python3", "python3")
    put_secret(site, LocalTransport(root), local, FALLBACK_KEY_FILE, "sits-nobody-here")
    written = root / FALLBACK_KEY_FILE.lstrip("/")
    assert written.read_text() == KEY + "\n"
    assert written.stat().st_mode & 0o777 == 0o600
    assert written.parent.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("field", ["base_url", "model"])
def test_an_upstream_needs_a_url_and_a_model(write_config, field):
    path = write_config(
        FLEET.replace(
            {"base_url": "    base_url: http://10.0.0.5:8080/v1\n", "model": "    model: big\n"}[field], ""
        )
    )
    assert any(f"fallback.upstream.{field}" in f for f in _findings(path))


def test_the_draft_reaches_the_agent_only_when_on(write_config):
    from deployer.agent.settings import AgentSettings

    for agent, want in (("", None), ("agent:\n  draft: int4\n", "int4")):
        path = write_config(agent)
        assert _findings(path, {}) == []
        config = load_config(path, {})
        text = agent_settings(config, DeviceSite.of(config, config.fleet.devices[0]))
        assert yaml.safe_load(text).get("draft") == want  # an agent.yaml without it stays as it was
        assert AgentSettings(**yaml.safe_load(text)).draft == (want or "off")  # what the agent reads


def test_the_kv_cache_type_reaches_the_agent_only_when_set(write_config):
    from deployer.agent.settings import AgentSettings

    for agent, want in (("", None), ("agent:\n  kv_cache_type: int8\n", "int8")):
        path = write_config(agent)
        assert _findings(path, {}) == []
        config = load_config(path, {})
        text = agent_settings(config, DeviceSite.of(config, config.fleet.devices[0]))
        assert yaml.safe_load(text).get("kv_cache_type") == want  # an agent.yaml without it stays
        assert AgentSettings(**yaml.safe_load(text)).kv_cache_type == (want or "auto")
