"""Running the user's deployment hooks on the controller.

A hook is an executable (any language, with a ``#!`` line) named in deploy.yaml under ``hooks:``.
It runs once per device and phase, with the controller's environment plus:

    SITS_PHASE          pre-deploy | post-deploy | pre-rollback | post-rollback
    SITS_DEVICE         the device's name in the inventory
    SITS_HOST           the address the controller reaches it at ('local' for a local device)
    SITS_FROM_VERSION   the model version the device runs now; empty on a fresh device
    SITS_TO_VERSION     the version being deployed (or rolled back to)
    SITS_APPLICATION    deploy.yaml's application
    SITS_NAMESPACE      deploy.yaml's namespace

It starts in the directory of deploy.yaml, with stdin closed, and in a process group of its own.
stdout and stderr are captured together (the last 64 KiB are kept). When it runs past its timeout,
the whole group (the hook and every child it started) gets SIGTERM and, 5 s later, SIGKILL; after
it exits, children it left behind are killed too, so no hook outlives its step. A child that starts
a session of its own (setsid) leaves the group and is out of reach.

Exit status 0 lets the step go on; anything else raises HookError, and the rollout decides what
that aborts (a device, or for pre-deploy the whole rollout before any change).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from deployer.config.models import Config
from deployer.errors import HookError

__all__ = ["PHASES", "HookContext", "HookPhase", "HookResult", "run_hook", "run_phase_hook"]

HookPhase = Literal["pre-deploy", "post-deploy", "pre-rollback", "post-rollback"]
PHASES: tuple[HookPhase, ...] = ("pre-deploy", "post-deploy", "pre-rollback", "post-rollback")
OUTPUT_LIMIT_BYTES = 64 * 1024
TAIL_LINES = 10
KILL_GRACE_S = 5.0
# How long to wait for the output pipe to close once the hook has exited or been killed.
_DRAIN_S = 2.0
_POLL_S = 0.05


@dataclass(frozen=True)
class HookContext:
    """What a hook is told about the step it runs around."""

    phase: HookPhase
    device: str
    host: str
    to_version: str
    from_version: str | None = None
    application: str = ""
    namespace: str = "default"

    def environment(self) -> dict[str, str]:
        """The SITS_* variables, as documented in this module."""
        return {
            "SITS_PHASE": self.phase,
            "SITS_DEVICE": self.device,
            "SITS_HOST": self.host,
            "SITS_FROM_VERSION": self.from_version or "",
            "SITS_TO_VERSION": self.to_version,
            "SITS_APPLICATION": self.application,
            "SITS_NAMESPACE": self.namespace,
        }


@dataclass(frozen=True)
class HookResult:
    """A hook that exited 0."""

    phase: HookPhase
    path: Path
    returncode: int
    output: str
    duration_s: float


def run_phase_hook(config: Config, context: HookContext) -> HookResult | None:
    """Run the hook deploy.yaml names for ``context.phase``, or return None when it names none.

    Raises HookError (see `run_hook`).
    """
    hook = getattr(config.hooks, context.phase.replace("-", "_"))
    if hook is None:
        return None
    return run_hook(
        config.resolve(hook.path), context, timeout_s=hook.timeout.total_seconds(), cwd=config.base_dir
    )


def run_hook(
    path: Path,
    context: HookContext,
    *,
    timeout_s: float,
    cwd: Path | None = None,
    base_env: Mapping[str, str] | None = None,
) -> HookResult:
    """Run one hook to completion and return its result.

    ``base_env`` defaults to the controller's environment; the SITS_* variables override it.
    Raises HookError when the hook is missing, not executable, cannot be started, exits non-zero
    or runs past ``timeout_s`` (then it is killed with its process group).
    """
    _check_runnable(path, context)
    env = {**(os.environ if base_env is None else base_env), **context.environment()}
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            [str(path)],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so a timeout reaches its children
        )
    except OSError as exc:
        raise _error(context, path, f"could not be started: {exc.strerror}", hint=_start_hint(exc)) from exc
    assert process.stdout is not None  # stdout=PIPE above
    tail = _TailReader(process.stdout)
    timed_out = not _exited(process.pid, timeout_s)
    if timed_out:
        _kill_group(process.pid, signal.SIGTERM)
        _exited(process.pid, KILL_GRACE_S)
    # The hook is a zombie or still running, so its pid is still its group's id: nothing else can
    # have taken it. Whatever it left behind goes now; only then is it reaped.
    _kill_group(process.pid, signal.SIGKILL)
    process.wait()
    output = tail.finish(_DRAIN_S)
    code = process.returncode
    if timed_out:
        raise _error(
            context,
            path,
            f"ran past its {timeout_s:g}s timeout and was killed with its child processes",
            returncode=code,
            output=output,
            hint=f"make it finish sooner or raise hooks.{context.phase}.timeout in deploy.yaml",
        )
    if code != 0:
        raise _error(
            context,
            path,
            f"exited with code {code}" if code > 0 else f"was killed by signal {-code}",
            returncode=code,
            output=output,
            hint=f"run it by hand with the same SITS_* variables: {_replay(context, path)}",
        )
    return HookResult(context.phase, path, code, output, time.monotonic() - started)


def _check_runnable(path: Path, context: HookContext) -> None:
    where = f"hooks.{context.phase} in deploy.yaml"
    if not path.exists():
        raise _error(context, path, "does not exist", hint=f"fix {where} (relative to deploy.yaml)")
    if not path.is_file():
        raise _error(context, path, "is not a regular file", hint=f"point {where} at a script")
    if not os.access(path, os.X_OK):
        raise _error(context, path, "is not executable", hint=f"chmod +x {path}")


def _exited(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the process to exit, without reaping it. True if it exited."""
    deadline = time.monotonic() + timeout_s
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already empty
        os.killpg(pgid, sig)


class _TailReader:
    """Reads a pipe in a thread, keeping only the last OUTPUT_LIMIT_BYTES."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._pipe = pipe
        self._data = bytearray()
        self._truncated = False
        self._thread = threading.Thread(target=self._run, name="sits-hook-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fd = self._pipe.fileno()
        while chunk := os.read(fd, 65536):
            self._data += chunk
            if len(self._data) > OUTPUT_LIMIT_BYTES:
                del self._data[: len(self._data) - OUTPUT_LIMIT_BYTES]
                self._truncated = True

    def finish(self, timeout_s: float) -> str:
        """The captured text; gives up waiting for EOF after ``timeout_s`` (a child outside the group)."""
        self._thread.join(timeout_s)
        text = bytes(self._data).decode("utf-8", errors="replace")
        if not self._thread.is_alive():
            self._pipe.close()
        return ("[... earlier output dropped ...]\n" + text) if self._truncated else text


def _error(
    context: HookContext,
    path: Path,
    what: str,
    *,
    returncode: int | None = None,
    output: str = "",
    hint: str | None = None,
) -> HookError:
    message = f"{context.phase} hook {path} for device {context.device} {what}"
    lines = output.rstrip().splitlines()[-TAIL_LINES:]
    if lines:
        message += f"; its last {len(lines)} line(s) of output:\n" + "\n".join(
            f"  | {line}" for line in lines
        )
    return HookError(message, phase=context.phase, path=path, returncode=returncode, output=output, hint=hint)


def _start_hint(exc: OSError) -> str:
    if exc.errno == errno.ENOEXEC:  # a script without a #! line
        return "start the script with an interpreter line such as #!/bin/sh"
    return "check the interpreter named on the script's #! line"


def _replay(context: HookContext, path: Path) -> str:
    assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in context.environment().items())
    return f"{assignments} {shlex.quote(str(path))}"
