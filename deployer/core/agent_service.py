"""How an agent is installed from wheels and (re)started: the commands the controller's bootstrap
runs on a device over its transport and the device's own offline install (`sits-agent install
--from`) runs locally, so that both upgrade an agent the same way.

    pip_install      pip into the agent's environment from given wheels only (no index)
    restart_command  systemd: daemon-reload, enable, restart the unit; otherwise (a device without
                     systemd, the local demo fleet) stop the background agent by its pid file and
                     start `sits-agent serve` again, detached, appending to its log
    stop_command     stop that background agent (no-op when none runs)

Device paths are given as the device's commands see them (under its root prefix).
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Sequence

__all__ = [
    "LOG_FILE",
    "PID_FILE",
    "SERVICE",
    "UNIT_DIR",
    "pip_install",
    "restart_command",
    "stop_command",
]

SERVICE = "sits-agent.service"
UNIT_DIR = "/etc/systemd/system"
LOG_FILE = "/var/log/sits-agent.log"  # the agent's log without systemd
PID_FILE = "/run/sits-agent.pid"  # the background agent's pid without systemd


def pip_install(python: str, *args: str) -> list[str]:
    """argv of pip installing `args` into `python`'s environment with no index: wheels come only
    from where `args` say (find-links, files), so a device never reaches out."""
    return [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index", *args]


def stop_command(pid_file: str) -> str:
    """Shell: stop the background agent whose pid `pid_file` holds (TERM, 10 s, then KILL)."""
    pid = shlex.quote(pid_file)
    return (
        f'if [ -f {pid} ]; then p=$(cat {pid}); kill "$p" 2>/dev/null; '
        f'for i in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done; '
        f'kill -9 "$p" 2>/dev/null; rm -f {pid}; fi; true'
    )


def restart_command(*, systemd: bool, serve: Sequence[str], pid_file: str, log_file: str) -> str:
    """Shell: (re)start the agent, under systemd through its unit, else as `serve` (argv of
    `sits-agent serve`) in the background with `pid_file` and `log_file`."""
    if systemd:
        return f"systemctl daemon-reload && systemctl enable {SERVICE} && systemctl restart {SERVICE}"
    log, pid = shlex.quote(log_file), shlex.quote(pid_file)
    dirs = " ".join(shlex.quote(posixpath.dirname(p)) for p in (log_file, pid_file))
    return (
        f"{stop_command(pid_file)}; mkdir -p {dirs} && "
        f"(setsid {shlex.join(serve)} </dev/null >>{log} 2>&1 & echo $! >{pid})"
    )
