"""The device store: verified model versions on disk, atomic pointers, and the state file.

Layout under a root prefix (`/` on a device, a directory per device in tests and the demo)::

    <root>/etc/sits/keys/*.pub          trusted release keys
    <root>/var/lib/sits/versions/<v>/   promoted versions, immutable (files are made read-only)
    <root>/var/lib/sits/current         symlink -> versions/<v>, swapped atomically
    <root>/var/lib/sits/previous        symlink -> versions/<v>, the rollback target
    <root>/var/lib/sits/staging/        work in progress; anything found there at start is debris
    <root>/var/lib/sits/state.json      installed version, artifact sha256, release counter, history

Every change is made so that a `kill -9` at any instant leaves either the old or the new state:
new content is written beside the old and renamed over it (`os.replace`), and the directory is
fsynced so the rename itself survives a power cut. A pointer change is journaled in state.json
(`pending`) before the symlinks move, and `recover()` finishes it after a crash, so the pointers
and state.json always end up agreeing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployer.core.fsutil import TEMP_MARK, atomic_write, fsync_dir, fsync_file, read_regular
from deployer.core.release import Release
from deployer.errors import AgentError, UnsafePathError

__all__ = [
    "HISTORY_LIMIT",
    "DeviceState",
    "DeviceStore",
    "HistoryEntry",
    "InProgress",
    "Pointer",
    "PointerSwitch",
    "RecoveryReport",
    "VersionRecord",
    "check_version_name",
    "utc_now",
]

HISTORY_LIMIT = 200
_THRESHOLD_BYTES = 64  # "2\n" and room to spare: more is no threshold file
Pointer = Literal["current", "previous"]
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


def utc_now() -> str:
    """The current UTC time as ISO 8601 with seconds, the form state.json records."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def check_version_name(version: str) -> str:
    """Return `version` if it is safe as a directory name; raise UnsafePathError otherwise."""
    if not _VERSION_RE.fullmatch(version) or version in {".", ".."}:
        raise UnsafePathError(
            f"version {version!r} cannot name a directory under versions/",
            hint="versions are 1-128 characters of letters, digits, '.', '_', '+', '-'",
        )
    return version


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VersionRecord(_Model):
    """What the store knows about one promoted version: the verified release that brought it.

    Rollback re-hashes the version's files against `release.artifact.files` before using it.
    """

    release: Release
    installed_at: str
    # Left by a self-rollback (OnFailure): rollback never goes to a failed version; only a new
    # signed release of it clears the mark.
    failed: bool = False


class InProgress(_Model):
    """The install under way: accepted (its counter is the floor) but not yet served.

    A crash retry is recognised only by these: the same version, counter and sha256 of the signed
    bytes. Cleared once the server serves it or refused it, so no replay finds it later.
    """

    version: str
    counter: int
    signed_sha256: str


class HistoryEntry(_Model):
    """One install, rollback or recovery, successful or not."""

    at: str
    action: Literal["install", "rollback", "self-rollback", "reload", "gc", "recover"]
    result: Literal["ok", "failed"]
    version: str | None = None
    from_version: str | None = None
    reason: str = ""


class PointerSwitch(_Model):
    """A pointer change, written into state.json before it is made (a one-entry journal), so that
    `recover()` can finish it after a crash: where `current` and `previous` must end up, and the
    history entry to record once they do. Its versions are verified and promoted beforehand."""

    current: str | None
    previous: str | None
    event: HistoryEntry


class DeviceState(_Model):
    """The contents of state.json."""

    format_version: Literal[1] = 1
    installed_version: str | None = None
    artifact_sha256: str | None = None
    # The highest release counter ever accepted; a new release must exceed it (anti-rollback),
    # even after an explicit rollback to an older version.
    release_counter: int = Field(default=0, ge=0)
    versions: dict[str, VersionRecord] = Field(default_factory=dict)
    history: tuple[HistoryEntry, ...] = ()
    pending: PointerSwitch | None = None
    in_progress: InProgress | None = None

    def with_event(self, entry: HistoryEntry) -> DeviceState:
        """A copy with `entry` appended to the history, oldest entries dropped past the limit."""
        return self.model_copy(update={"history": (*self.history, entry)[-HISTORY_LIMIT:]})


@dataclass(frozen=True)
class RecoveryReport:
    """What `DeviceStore.recover()` found and repaired."""

    removed: tuple[str, ...]
    finished: PointerSwitch | None  # the interrupted pointer change it completed, if any


class DeviceStore:
    """The store under one root prefix. Cheap to construct; touches the disk only when asked."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.base = self.root / "var/lib/sits"
        self.versions_dir = self.base / "versions"
        self.staging_dir = self.base / "staging"
        self.state_path = self.base / "state.json"
        self.keys_dir = self.root / "etc/sits/keys"

    # -- reading -------------------------------------------------------------------------------

    def version_dir(self, version: str) -> Path:
        """Where `version` lives once promoted (it may not exist)."""
        return self.versions_dir / check_version_name(version)

    def pointer(self, name: Pointer) -> str | None:
        """The version a pointer names, or None when it is absent or dangling."""
        link = self.base / name
        try:
            target = link.readlink()
        except OSError:  # absent, or not a symlink
            return None
        version = target.name
        return version if (self.versions_dir / version).is_dir() else None

    def current_version(self) -> str | None:
        """The installed version (the `current` pointer), or None before the first install."""
        return self.pointer("current")

    def previous_version(self) -> str | None:
        """The rollback target (the `previous` pointer), or None."""
        return self.pointer("previous")

    def current_version_dir(self) -> Path | None:
        """The directory the server should load, or None before the first install."""
        version = self.current_version()
        return None if version is None else self.versions_dir / version

    def installed_versions(self) -> list[str]:
        """Promoted versions on disk, sorted by name."""
        if not self.versions_dir.is_dir():
            return []
        return sorted(p.name for p in self.versions_dir.iterdir() if p.is_dir())

    def trusted_key_files(self) -> list[Path]:
        """The trusted release keys (`etc/sits/keys/*.pub`), sorted."""
        return sorted(self.keys_dir.glob("*.pub")) if self.keys_dir.is_dir() else []

    def signature_threshold(self) -> int:
        """How many trusted keys must sign a release: `etc/sits/keys/threshold` (absent: 1).

        It lives beside the keys because together they are the device's trust policy, written
        by whoever provisions the device, and never by a release. Raises AgentError if malformed.
        """
        path = self.keys_dir / "threshold"
        try:
            text = read_regular(path, _THRESHOLD_BYTES).decode("ascii").strip()
        except FileNotFoundError:
            return 1
        except OSError as exc:  # a pipe or device is refused, not waited on (under the store lock)
            raise AgentError(
                f"{path}: cannot read the signature threshold: {exc.strerror or exc}",
                hint="write the threshold as a small regular file, e.g. `echo 2 > threshold`",
            ) from exc
        except UnicodeDecodeError as exc:
            raise AgentError(f"{path}: cannot read the signature threshold: {exc}") from exc
        if not text.isdigit() or int(text) < 1:
            raise AgentError(
                f"{path}: the signature threshold must be a whole number of at least 1, got {text!r}",
                hint="write the number of trusted keys that must sign each release, e.g. 2",
            )
        return int(text)

    def read_state(self) -> DeviceState:
        """Parse state.json; an absent file is the empty state. Raises AgentError if corrupt."""
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            return DeviceState()
        except OSError as exc:
            raise AgentError(f"{self.state_path}: cannot read: {exc.strerror or exc}") from exc
        try:
            return DeviceState.model_validate_json(raw)
        except ValidationError as exc:
            raise AgentError(
                f"{self.state_path}: not a valid state file ({exc.error_count()} problems, first: "
                f"{exc.errors()[0]['msg']})",
                hint="restore it from a backup, or move it away and run `sits-agent status`",
            ) from exc

    # -- writing -------------------------------------------------------------------------------

    def ensure_layout(self) -> None:
        """Create the store's directories if they are missing."""
        for path in (self.versions_dir, self.staging_dir, self.keys_dir):
            path.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's exclusive lock; a second concurrent writer is refused, not queued."""
        self.ensure_layout()
        fd = os.open(self.base / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise AgentError(
                    f"{self.base}: another sits-agent operation holds the store lock",
                    hint="wait for the running install or rollback to finish, then retry",
                ) from exc
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def write_state(self, state: DeviceState) -> None:
        """Replace state.json atomically: temp file, fsync, rename, fsync the directory."""
        self.ensure_layout()
        data = state.model_dump_json(indent=2).encode() + b"\n"
        atomic_write(
            self.state_path, data, error=AgentError, hint="free disk space under the store's root, then retry"
        )

    def new_staging_dir(self, label: str) -> Path:
        """A fresh empty directory under staging/ for one operation's output."""
        self.ensure_layout()
        return Path(tempfile.mkdtemp(dir=self.staging_dir, prefix=f"{label}-"))

    def promote(self, staged: Path, version: str) -> Path:
        """Move a fully verified staging directory into versions/<version>, durably.

        The files are made read-only and fsynced first, so what the rename publishes is complete.
        Raises AgentError if the version already exists.
        """
        target = self.version_dir(version)
        if target.exists():
            raise AgentError(
                f"{target}: version {version} is already on disk",
                hint="versions are immutable; publish the change under a new version",
            )
        for path in sorted(staged.rglob("*")):
            if path.is_file():
                path.chmod(0o444)
                fsync_file(path)
        fsync_dir(staged)
        staged.rename(target)
        fsync_dir(self.versions_dir)
        fsync_dir(self.staging_dir)
        return target

    def set_pointer(self, name: Pointer, version: str | None) -> None:
        """Point `name` at versions/<version> (relative link), or remove it for None. Atomic."""
        link = self.base / name
        if version is None:
            link.unlink(missing_ok=True)
        else:
            if not self.version_dir(version).is_dir():
                raise AgentError(f"{self.version_dir(version)}: no such version to point {name} at")
            tmp = self.base / f".{name}{TEMP_MARK}{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(f"versions/{version}")
            tmp.replace(link)
        fsync_dir(self.base)

    def remove_version(self, version: str) -> None:
        """Delete a version that no pointer names. It leaves versions/ in one atomic rename, so
        a crash mid-delete leaves debris in staging/, never half a version."""
        if version in {self.current_version(), self.previous_version()}:
            raise AgentError(
                f"version {version} is in use (current or previous) and cannot be removed",
                hint="roll forward or back first; gc never removes current or previous",
            )
        trash = self.new_staging_dir(f"trash-{version}")
        self.version_dir(version).rename(trash / version)
        fsync_dir(self.versions_dir)
        _remove_tree(trash)

    def collect_garbage(self, keep: int) -> list[str]:
        """Remove the oldest versions until at most `keep` remain (caller holds `locked()`).

        `current` and `previous` always stay, even if that keeps more than `keep`. Age is the
        install time recorded in state.json; directories it does not know count as oldest.
        Returns the removed versions, oldest first.
        """
        if keep < 1:
            raise AgentError(f"gc --keep {keep}: must keep at least 1 version")
        state = self.read_state()
        pinned = {v for v in (self.current_version(), self.previous_version()) if v}
        newest_first = sorted(
            self.installed_versions(),
            key=lambda v: (state.versions[v].installed_at if v in state.versions else "", v),
            reverse=True,
        )
        kept = set(pinned)
        for version in newest_first:
            if len(kept) >= keep:
                break
            kept.add(version)
        removed = [v for v in reversed(newest_first) if v not in kept]
        for version in removed:
            self.remove_version(version)
        if removed:
            versions = {v: r for v, r in state.versions.items() if v not in removed}
            self.write_state(
                state.model_copy(update={"versions": versions}).with_event(
                    HistoryEntry(
                        at=utc_now(),
                        action="gc",
                        result="ok",
                        reason=f"kept {len(kept)}, removed {', '.join(removed)}",
                    )
                )
            )
        return removed

    def switch(self, change: PointerSwitch, on_step: Callable[[str], None] | None = None) -> None:
        """Make the pointers what `change` says, then record it (caller holds `locked()` and has
        written `change` into state.json as `pending` first). Reports each step to `on_step`."""
        step = on_step or (lambda _name: None)
        self.set_pointer("previous", change.previous)
        step("previous-set")
        self.set_pointer("current", change.current)
        step("current-set")
        state = self.read_state()
        record = state.versions.get(change.current) if change.current else None
        update = {
            "installed_version": change.current,
            "artifact_sha256": record.release.artifact.sha256 if record else None,
            "pending": None,
        }
        self.write_state(state.model_copy(update=update).with_event(change.event))
        step("state-written")

    def recover(self) -> RecoveryReport:
        """Clean up after a crash: empty staging/, drop temp files, finish a pending pointer change.

        Call it at start and before every change, holding `locked()`.
        """
        self.ensure_layout()
        removed = [entry.name for entry in self.staging_dir.iterdir()]
        for entry in self.staging_dir.iterdir():
            _remove_tree(entry)
        for entry in self.base.iterdir():
            if TEMP_MARK in entry.name:
                entry.unlink(missing_ok=True)
                removed.append(entry.name)
        return RecoveryReport(tuple(sorted(removed)), self._finish_pending())

    def _finish_pending(self) -> PointerSwitch | None:
        state = self.read_state()
        change = state.pending
        if change is None:
            return None
        targets = [v for v in (change.current, change.previous) if v is not None]
        if not all(self.version_dir(v).is_dir() for v in targets):
            # Someone removed a version by hand since: forget the change rather than fail forever.
            self.write_state(state.model_copy(update={"pending": None}))
            return None
        note = f"{change.event.reason} (finished by recovery after an interruption)".strip()
        self.switch(change.model_copy(update={"event": change.event.model_copy(update={"reason": note})}))
        return change


def _remove_tree(path: Path) -> None:
    """Remove a file, link or directory tree. Read-only files go too: only the directories'
    write bits matter for unlinking, and the store never clears those."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)
