"""Running host commands for the lab: bounded in time, failures raised as LabError with stderr."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path


class LabError(RuntimeError):
    """The device lab could not be built, started, reached or torn down."""


def sh(args: Sequence[str], *, timeout: float = 60, check: bool = True, input_text: str | None = None) -> str:
    """Run a host command and return its stdout; raise LabError on a non-zero exit when `check`."""
    try:
        done = subprocess.run(
            list(args),
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=None if input_text is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"{' '.join(args)} did not finish within {timeout:.0f} s") from exc
    except FileNotFoundError as exc:
        raise LabError(f"{args[0]} is not installed (see tests/lab/README.md for the packages)") from exc
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(args)} failed (rc {done.returncode}): {done.stderr.strip()[-800:]}")
    return done.stdout


def pid_alive(pid: int) -> bool:
    """True while a process exists (zombies included: they still hold their pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def children(pid: int) -> list[int]:
    """Direct children of a process, from /proc (empty when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def comm(pid: int) -> str:
    """The process's short command name, or '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
