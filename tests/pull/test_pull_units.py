"""The pull-mode units: a oneshot poll in the agent's sandbox, run by a jittered timer."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from deployer.push.units import POLL_TIMER, POLL_UNIT, UnitParams, render_pull_units, write_units


def test_timer_polls_with_jitter_and_service_runs_one_poll() -> None:
    units = render_pull_units(
        UnitParams(poll_interval_s=600, poll_jitter_s=120, config_path="/etc/sits/a.yaml")
    )
    assert set(units) == {POLL_UNIT, POLL_TIMER}
    timer = units[POLL_TIMER].splitlines()
    assert "OnUnitInactiveSec=600s" in timer and "RandomizedDelaySec=120s" in timer
    assert "Unit=sits-poll.service" in timer and "WantedBy=timers.target" in timer
    service = units[POLL_UNIT].splitlines()
    assert "Type=oneshot" in service
    assert "ExecStart=python3 -m deployer.agent.cli poll --config /etc/sits/a.yaml" in service
    assert "ProtectSystem=strict" in service and "ReadWritePaths=/var/lib/sits" in service
    assert (
        render_pull_units(UnitParams(poll_interval_s=600, poll_jitter_s=120, config_path="/etc/sits/a.yaml"))
        == units
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_pull_units(tmp_path: Path) -> None:
    python = shutil.which("python3") or "/usr/bin/python3"
    write_units(render_pull_units(UnitParams(agent_command=(python, "-m", "deployer.agent.cli"))), tmp_path)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / POLL_UNIT), str(tmp_path / POLL_TIMER)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    problems = [line for line in result.stderr.splitlines() if "sits-poll" in line]
    assert result.returncode == 0 and not problems, result.stderr
