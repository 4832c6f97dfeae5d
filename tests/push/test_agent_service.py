"""The agent's restart and stop commands (deployer/core/agent_service.py) run by a real shell, as
bootstrap runs them over SSH and an offline bundle's upgrade runs them on the device: a stand-in
`serve` that only sleeps, so that what is checked is the pid file's process being replaced."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from deployer.agent.cli import restart_agent
from deployer.agent.settings import AgentSettings
from deployer.core.agent_service import restart_command, stop_command


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of the setsid'd shell is reaped by init; until then it is a zombie: not alive.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"


def test_restart_replaces_the_background_agent_and_stop_ends_it(tmp_path: Path) -> None:
    pid_file, log_file = tmp_path / "run" / "agent.pid", tmp_path / "log" / "agent.log"
    restart = restart_command(
        systemd=False, serve=["sleep", "300"], pid_file=str(pid_file), log_file=str(log_file)
    )
    subprocess.run(["sh", "-c", restart], check=True, timeout=60)
    first = int(pid_file.read_text())
    assert _alive(first) and log_file.exists()
    subprocess.run(["sh", "-c", restart], check=True, timeout=60)
    second = int(pid_file.read_text())
    assert second != first and _alive(second) and not _alive(first)
    subprocess.run(["sh", "-c", stop_command(str(pid_file))], check=True, timeout=60)
    assert not _alive(second) and not pid_file.exists()
    subprocess.run(["sh", "-c", stop_command(str(pid_file))], check=True, timeout=60)  # none: a no-op


def test_an_upgraded_agent_that_was_not_running_is_left_to_start_later(tmp_path: Path) -> None:
    said = restart_agent(AgentSettings(root=tmp_path))
    assert said.startswith("no agent was running") and not (tmp_path / "run").exists()
