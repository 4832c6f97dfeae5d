"""Rendering the agent's systemd units, and checking them with the host's real systemd-analyze."""

from __future__ import annotations

import hashlib
import shutil
import sys

import pytest

from deployer.config.models import Config
from deployer.errors import ConfigError
from deployer.push.units import (
    AGENT_UNIT,
    ROLLBACK_UNIT,
    UnitParams,
    cpu_quota,
    memory_max,
    render_units,
    security_score,
    unit_digests,
    verify_units,
    write_units,
)

# Measured with systemd 252: 1.3 for a CPU-only device, 1.5 with accelerator device nodes.
MAX_EXPOSURE = 2.0

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


def make_config(**overrides: object) -> Config:
    raw = {
        "application": "chat-edge",
        "namespace": "prod",
        "model": {"name": "smollm2", "version": "1.0.0", "source": "builtin:smollm2-135m-instruct"},
        "fleet": {
            "devices": [
                {"name": "cpu-box", "host": "10.0.0.1", "python": sys.executable},
                {"name": "gpu-box", "host": "10.0.0.2", "python": sys.executable, "profile": "orin"},
            ]
        },
        "profiles": {"orin": {"memory": "16Gi", "accelerator": "cuda"}},
        **overrides,
    }
    return Config.model_validate(raw)


def directives(text: str) -> dict[str, list[str]]:
    """Key -> values of every `Key=value` line (comments and sections skipped)."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


@pytest.mark.parametrize(
    ("millicores", "expected"),
    [(4000, "400%"), (1000, "100%"), (1500, "150%"), (250, "25%"), (125, "12.5%"), (10, "1%")],
)
def test_cpu_quota_from_millicores(millicores, expected):
    assert cpu_quota(millicores) == expected


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (8 * 2**30, "8G"),
        (1536 * 2**20, "1536M"),
        (2 * 2**40, "2T"),
        (10**9, "1000000000"),
        (64 * 2**20 + 1024, "65537K"),
    ],
)
def test_memory_max_from_bytes(size, expected):
    assert memory_max(size) == expected


def test_resources_from_kubernetes_notation_reach_the_unit():
    units = render_units(make_config(resources={"cpu": "4000m", "memory": "8Gi"}))
    agent = directives(units[AGENT_UNIT])
    assert agent["CPUQuota"] == ["400%"]
    assert agent["MemoryMax"] == ["8G"]


def test_no_resources_means_no_limits():
    agent = directives(render_units(make_config())[AGENT_UNIT])
    assert "CPUQuota" not in agent
    assert "MemoryMax" not in agent


@pytest.mark.parametrize(
    ("resources", "field"),
    [({"cpu": "5m"}, "resources.cpu"), ({"memory": "16Mi"}, "resources.memory")],
)
def test_resources_systemd_cannot_enforce_are_rejected(resources, field):
    with pytest.raises(ConfigError, match=field) as info:
        render_units(make_config(resources=resources))
    assert info.value.hint


def test_unparseable_resources_never_reach_rendering():
    with pytest.raises(ValueError, match="invalid memory quantity"):
        make_config(resources={"memory": "8 gigs"})


def test_agent_unit_runs_the_device_interpreter_and_reloads_synchronously():
    config = make_config()
    agent = directives(render_units(config, config.fleet.devices[0])[AGENT_UNIT])
    command = f"{sys.executable} -m deployer.agent.cli"
    assert agent["ExecStart"] == [f"{command} serve --config /etc/sits/agent.yaml"]
    assert agent["ExecReload"] == [f"{command} reload --config /etc/sits/agent.yaml"]
    assert agent["Type"] == ["notify"]
    assert agent["OnFailure"] == [ROLLBACK_UNIT]
    assert agent["Restart"] == ["on-failure"]


def test_start_timeout_follows_the_readiness_timeout_and_the_crash_window_covers_the_burst():
    params = UnitParams.from_config(make_config(health={"readiness_timeout": "5m"}))
    agent = directives(render_units(params)[AGENT_UNIT])
    assert agent["TimeoutStartSec"] == [str(300 + 60)]
    burst = int(agent["StartLimitBurst"][0])
    # Every failed start (up to the timeout, then RestartSec) must still fall inside the window.
    assert int(agent["StartLimitIntervalSec"][0]) >= burst * (360 + int(agent["RestartSec"][0]))


def test_accelerator_profile_keeps_device_nodes():
    config = make_config()
    cpu_box, gpu_box = config.fleet.devices
    assert directives(render_units(config, cpu_box)[AGENT_UNIT])["PrivateDevices"] == ["yes"]
    assert "PrivateDevices" not in directives(render_units(config, gpu_box)[AGENT_UNIT])


def test_the_units_the_controller_writes_keep_an_accelerators_device_nodes():
    from deployer.push.bootstrap import desired_files
    from deployer.push.facts import UNIT_DIR, DeviceSite

    config = make_config()
    cpu_box, gpu_box = (
        directives(
            desired_files(config, DeviceSite.of(config, d), systemd=True)[f"{UNIT_DIR}/{AGENT_UNIT}"].decode()
        )
        for d in config.fleet.devices
    )
    assert cpu_box["PrivateDevices"] == ["yes"]
    assert "PrivateDevices" not in gpu_box  # else CUDA sees no GPU and `device: auto` picks the CPU


def test_rollback_unit_is_a_sandboxed_oneshot_that_restarts_the_agent():
    rollback = directives(render_units(make_config())[ROLLBACK_UNIT])
    assert rollback["Type"] == ["oneshot"]
    assert rollback["ExecStart"] == [
        "python3 -m deployer.agent.cli rollback --on-failure --config /etc/sits/agent.yaml"
    ]
    assert rollback["ExecStartPost"] == [
        "+/usr/bin/systemctl reset-failed sits-agent.service",
        "+/usr/bin/systemctl --no-block start sits-agent.service",
    ]
    assert rollback["User"] == ["sits"]
    assert rollback["ProtectSystem"] == ["strict"]
    assert "OnFailure" not in rollback


def test_both_units_share_the_store_and_the_sandbox():
    units = render_units(make_config())
    agent, rollback = directives(units[AGENT_UNIT]), directives(units[ROLLBACK_UNIT])
    for key in ("User", "StateDirectory", "ReadWritePaths", "CapabilityBoundingSet", "SystemCallFilter"):
        assert agent[key] == rollback[key], key
    assert agent["StateDirectory"] == ["sits"]
    assert agent["ReadWritePaths"] == ["/var/lib/sits"]
    assert agent["CapabilityBoundingSet"] == [""]
    assert "MemoryDenyWriteExecute" not in agent  # breaks torch's oneDNN kernels (docs/units.md)


def test_rendering_is_deterministic_and_digests_match_the_written_bytes(tmp_path):
    config = make_config(resources={"cpu": "1500m", "memory": "2Gi"})
    units = render_units(config)
    assert render_units(config) == units
    digests = unit_digests(units)
    for path in write_units(units, tmp_path):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digests[path.name]
    assert unit_digests(render_units(make_config(resources={"cpu": "2"}))) != digests


def test_specifiers_and_spaces_in_the_interpreter_path_are_escaped():
    params = UnitParams(agent_command=("/opt/my venv/100%/python",))
    exec_start = directives(render_units(params)[AGENT_UNIT])["ExecStart"][0]
    assert exec_start.startswith('"/opt/my venv/100%%/python" serve')


def test_a_newline_cannot_inject_a_directive():
    with pytest.raises(ConfigError, match="spans lines"):
        render_units(UnitParams(application="x\nExecStartPre=/bin/rm -rf /"))


@needs_systemd_analyze
@pytest.mark.parametrize(
    "resources",
    [{}, {"cpu": "4000m", "memory": "8Gi"}, {"cpu": "125m", "memory": "1G"}, {"cpu": "0.5"}],
)
@pytest.mark.parametrize("device_index", [0, 1])
def test_systemd_analyze_verify_is_silent(tmp_path, resources, device_index):
    config = make_config(resources=resources)
    write_units(render_units(config, config.fleet.devices[device_index]), tmp_path)
    verify_units(tmp_path)  # raises on any stderr output


@needs_systemd_analyze
def test_verify_with_a_path_that_needs_quoting(tmp_path):
    odd = tmp_path / "my venv" / "100%"
    odd.mkdir(parents=True)
    (odd / "python").symlink_to(sys.executable)
    units_dir = tmp_path / "units"
    params = UnitParams(agent_command=(str(odd / "python"), "-m", "deployer.agent.cli"))
    write_units(render_units(params), units_dir)
    verify_units(units_dir)


@needs_systemd_analyze
def test_verify_fails_when_the_interpreter_is_missing(tmp_path):
    write_units(render_units(UnitParams(agent_command=(str(tmp_path / "no-such-python"),))), tmp_path)
    with pytest.raises(ConfigError, match="no-such-python"):
        verify_units(tmp_path)


@needs_systemd_analyze
def test_verify_treats_a_warning_as_failure(tmp_path):
    units = render_units(UnitParams(agent_command=(sys.executable,)))
    units[AGENT_UNIT] = units[AGENT_UNIT].replace("[Service]\n", "[Service]\nMemoryMaxx=1G\n")
    write_units(units, tmp_path)
    with pytest.raises(ConfigError, match="MemoryMaxx"):
        verify_units(tmp_path)


def test_verify_needs_units(tmp_path):
    with pytest.raises(ConfigError, match=r"no \*\.service files"):
        verify_units(tmp_path)


@needs_systemd_analyze
@pytest.mark.parametrize("device_index", [0, 1])
def test_security_exposure_is_low(tmp_path, device_index):
    config = make_config(resources={"cpu": "2", "memory": "4Gi"})
    paths = write_units(render_units(config, config.fleet.devices[device_index]), tmp_path)
    for path in paths:
        score = security_score(path)
        assert 0 < score <= MAX_EXPOSURE, f"{path.name}: exposure {score}"


@needs_systemd_analyze
def test_security_score_of_an_unhardened_unit_is_high(tmp_path):
    bare = tmp_path / "bare.service"
    bare.write_text(f"[Service]\nExecStart={sys.executable} -c pass\n")
    assert security_score(bare) > 9.0
