"""The controller's own records in the project's `.sits/`: the fleet lock and the audit log.

.sits/lock.json     held while an apply or rollback runs; created with O_EXCL, so a second one
                    is refused. It names a lock id; `--force-unlock LOCK_ID` removes a lock left
                    by a killed run, and only when given that id.
.sits/audit.jsonl   one JSON line per apply and rollback (also failed, halted or interrupted
                    ones) with every device's result. Append-only: lines are never rewritten.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from deployer.core.redact import redacted_json
from deployer.errors import SitsError

__all__ = ["FleetLock", "LockInfo", "append_audit", "force_unlock", "read_audit", "read_lock"]

LOCK_NAME = "lock.json"
AUDIT_NAME = "audit.jsonl"


class LockInfo(BaseModel):
    """Who holds the fleet lock."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lock_id: str
    command: str
    pid: int
    host: str
    started: str


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def read_lock(sits_dir: Path) -> LockInfo | None:
    """The current lock, or None when the fleet is not locked."""
    path = sits_dir / LOCK_NAME
    try:
        return LockInfo.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        raise SitsError(
            f"{path}: unreadable fleet lock ({exc})",
            hint=f"if no apply is running, remove {path} by hand",
        ) from exc


class FleetLock:
    """Hold the fleet lock for the duration of a `with` block."""

    def __init__(self, sits_dir: Path, command: str) -> None:
        self.sits_dir = sits_dir
        self.command = command
        self.info: LockInfo | None = None

    @contextmanager
    def held(self) -> Iterator[LockInfo]:
        """Take the lock (raise SitsError naming the holder if taken), release it afterwards."""
        info = LockInfo(
            lock_id=uuid.uuid4().hex[:12],
            command=self.command,
            pid=os.getpid(),
            host=socket.gethostname(),
            started=_now(),
        )
        path = self.sits_dir / LOCK_NAME
        self.sits_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = read_lock(self.sits_dir)
            who = (
                f"lock {holder.lock_id} ({holder.command}, pid {holder.pid} on {holder.host}, "
                f"since {holder.started})"
                if holder
                else "a lock"
            )
            raise SitsError(
                f"the fleet is locked by {who}: another apply or rollback is running",
                hint="wait for it to finish; if it was killed, run again with "
                f"--force-unlock {holder.lock_id if holder else 'LOCK_ID'}",
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(info.model_dump_json() + "\n")
        self.info = info
        try:
            yield info
        finally:
            current = read_lock(self.sits_dir)
            if current is not None and current.lock_id == info.lock_id:
                path.unlink(missing_ok=True)


def force_unlock(sits_dir: Path, lock_id: str) -> LockInfo:
    """Remove a lock left behind, given its id. Raises SitsError for another id or no lock."""
    current = read_lock(sits_dir)
    if current is None:
        raise SitsError("the fleet is not locked; nothing to unlock")
    if current.lock_id != lock_id:
        raise SitsError(
            f"--force-unlock {lock_id} does not match the lock held ({current.lock_id})",
            hint="pass the lock id that the refused command printed",
        )
    (sits_dir / LOCK_NAME).unlink(missing_ok=True)
    return current


def append_audit(sits_dir: Path, record: dict[str, Any]) -> None:
    """Append one record (one line, O_APPEND, fsynced) to the audit log, secrets redacted."""
    sits_dir.mkdir(parents=True, exist_ok=True)
    line = redacted_json({"at": _now(), **record}, sort_keys=True) + "\n"
    fd = os.open(sits_dir / AUDIT_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_audit(sits_dir: Path) -> list[dict[str, Any]]:
    """Every audit record, oldest first (for `status` and tests)."""
    path = sits_dir / AUDIT_NAME
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
