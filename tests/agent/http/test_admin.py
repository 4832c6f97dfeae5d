"""The admin surface: a unix socket for the agent's own user, verified versions only, no browsers;
and `sits-agent reload` finding it through the device's agent.yaml."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from deployer.agent.ota.store import DeviceStore
from tests.agent.conftest import version_record

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def device(start_agent, short_dir, tiny_model_dir, tiny_model_dir_b):
    """An agent whose store holds v1 (current, verified) and v2 (verified), plus an unverified v3."""
    store = DeviceStore(short_dir / "device")
    store.ensure_layout()
    for version, source in (("v1", tiny_model_dir), ("v2", tiny_model_dir_b), ("v3", tiny_model_dir_b)):
        shutil.copytree(source, store.version_dir(version))
    state = store.read_state()
    versions = {v: version_record(v) for v in ("v1", "v2")}
    store.write_state(state.model_copy(update={"versions": versions}))
    store.set_pointer("current", "v1")
    agent = start_agent(load=False, root=store.root)
    assert agent.reload(reason="start").ok
    return agent


def test_the_socket_is_private(device):
    mode = device.admin_socket.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(device.admin_socket.parent.stat().st_mode) == 0o700
    assert device.admin_socket.stat().st_uid == os.getuid()


def test_reload_takes_a_verified_version(device, http):
    status, _, body = http(device.admin_socket, "POST", "/admin/reload", {"version": "v2"})
    assert (status, body["ok"], body["active_version"]) == (200, True, "v2")
    status, _, body = http(device.admin_socket, "GET", "/v1/models")
    assert [m["version"] for m in body["data"]] == ["v2", "v1"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"version": "v3"}, 409, "not_verified"),  # on disk, never installed through verification
        ({"version": "9.9.9-unsigned"}, 409, "not_verified"),
        ({"version": "v2", "artifact_dir": "/tmp"}, 400, "invalid_value"),  # never a path
        ({"versoin": "v1"}, 400, "invalid_value"),
    ],
)
def test_reload_refuses_anything_else(device, http, body, status, code):
    answer = http(device.admin_socket, "POST", "/admin/reload", body)
    assert (answer[0], answer[2]["error"]["code"]) == (status, code)
    assert device.manager.active_info().version == "v1"


def test_a_failed_version_is_refused(device, http):
    state = device.store.read_state()
    failed = state.versions["v2"].model_copy(update={"failed": True})
    device.store.write_state(state.model_copy(update={"versions": {**state.versions, "v2": failed}}))
    status, _, body = http(device.admin_socket, "POST", "/admin/reload", {"version": "v2"})
    assert (status, body["error"]["code"]) == (409, "failed_version")


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Origin": "http://evil.example"}, 403),
        ({"Sec-Fetch-Site": "cross-site"}, 403),
        ({"Content-Type": "text/plain"}, 415),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ],
)
def test_browser_shaped_requests_are_refused(device, http, headers, status):
    answer = http(device.admin_socket, "POST", "/admin/reload", {"version": "v2"}, headers=headers)
    assert answer[0] == status
    assert device.manager.active_info().version == "v1"


def test_the_api_port_has_no_admin(device, http):
    status, _, body = http(device.port, "POST", "/admin/reload", {"version": "v2"})
    assert (status, body["error"]["code"]) == (403, "admin_not_here")
    assert device.manager.active_info().version == "v1"


def test_sits_agent_reload_finds_the_socket_from_agent_yaml(device, short_dir):
    config = short_dir / "agent.yaml"
    settings = device.settings
    config.write_text(
        f"port: {device.port}\nroot: {settings.root}\nadmin_socket: {settings.admin_socket_path}\n"
        f"context_length: {settings.context_length}\nmax_prompt_tokens: {settings.max_prompt_tokens}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = ["reload", "--version", "v2", "--output", "json", "--config", str(config)]
    done = subprocess.run(
        [sys.executable, "-m", "deployer.agent.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["active_version"] == "v2"
