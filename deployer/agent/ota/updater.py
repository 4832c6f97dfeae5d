"""Install, roll back and self-roll-back model versions on a device, surviving `kill -9` anywhere.

install, step by step (each name is reported to `on_step` after it is done)::

    recovered      staging/ emptied, state.json made to agree with `current` (after a crash)
    verified       release signatures (k of n trusted keys), expiry, counter, base; patch length,
                   hash and header targets (against the signed file list); disk space
    staged         patch applied / artifact copied into staging/, every file hashed against the release
    promoted       staging dir renamed to versions/<v> (fsynced): complete or absent, never partial
    recorded       state.json: the release (its counter becomes the anti-rollback floor), the
                   install in progress (`in_progress`) and the pointer change about to be made
                   (`pending`, a one-entry journal)
    previous-set   `previous` -> the version serving until now
    current-set    `current` -> the new version (one atomic rename of a symlink)
    state-written  state.json says the new version is installed; `pending` cleared
    reloaded       the running server serves it; if it refused, `current` points back

Up to `current-set`, a crash leaves `current` on the old version; from there, on the new one, which
was verified and promoted before. Once `recorded`, the next start (or operation) finishes the
journaled pointer change. A retry after a crash is recognised only as the exact signed release
recorded in progress (same signed bytes) and finishes the job, reloading the server if it is
still on the old version; `in_progress` is cleared once the server serves the version (or refused
it), so any later send of that release, like any release at or below the counter floor, is a
replay and refused. A refused install changes nothing on disk: state.json is not rewritten (the
journal has the reason). A version the server refuses leaves versions/. Rollback goes through the
same switch, only to a recorded version that never failed, after re-hashing its files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from deployer.agent.ota.store import (
    DeviceState,
    DeviceStore,
    HistoryEntry,
    InProgress,
    PointerSwitch,
    RecoveryReport,
    VersionRecord,
    check_version_name,
    utc_now,
)
from deployer.core.hashing import sha256_file
from deployer.core.patch_apply import inside
from deployer.core.patch_format import check_relative_path
from deployer.core.release import Envelope, Release, parse_release, read_envelope
from deployer.core.verify import (
    Installed,
    TrustedKeys,
    apply_release_patch,
    load_usable_keys,
    verify_artifact_dir,
    verify_release,
)
from deployer.errors import AgentError, KeyFileError, ReplayError, SitsError

__all__ = [
    "INSTALL_STEPS",
    "InstallResult",
    "ReloadOutcome",
    "Reloader",
    "RollbackResult",
    "Updater",
]

INSTALL_STEPS = (
    "recovered",
    "verified",
    "staged",
    "promoted",
    "recorded",
    "previous-set",
    "current-set",
    "state-written",
    "reloaded",
)
Action = Literal["install", "rollback", "self-rollback"]
_log = logging.getLogger("sits.agent")


@dataclass(frozen=True)
class ReloadOutcome:
    """What the running server said to a reload. `served` is False when no server answered: the
    version then loads when the agent (re)starts, so that counts as success."""

    ok: bool
    served: bool
    detail: str = ""


# (version, reason) -> outcome; reason is "update" or "rollback", as the server's control API names it.
Reloader = Callable[[str, str], ReloadOutcome]


@dataclass(frozen=True)
class InstallResult:
    """The outcome of a successful install. `changed` is False when it was already installed."""

    version: str
    from_version: str | None
    artifact_sha256: str
    release_counter: int
    changed: bool
    reload: ReloadOutcome | None


@dataclass(frozen=True)
class RollbackResult:
    """The outcome of a successful rollback. `changed` is False when `to` was already current."""

    version: str
    from_version: str | None
    changed: bool
    reload: ReloadOutcome | None


class Updater:
    """Every change to a device's store goes through here, one at a time (the store lock)."""

    def __init__(
        self,
        store: DeviceStore,
        *,
        reloader: Reloader | None = None,
        on_step: Callable[[str], None] | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self.store = store
        self.reloader = reloader
        self.on_step = on_step or (lambda _step: None)
        self.clock = clock or (lambda: datetime.now(UTC))

    def start_up(self) -> RecoveryReport:
        """At agent start: clean up after an interrupted install (staging, temp files, state)."""
        with self.store.locked(), _os_errors_as_agent_errors("start-up recovery"):
            return self.store.recover()

    # -- install -------------------------------------------------------------------------------

    def install(
        self, manifest: Path, *, patch: Path | None = None, artifact: Path | None = None
    ) -> InstallResult:
        """Verify and install the release in `manifest` from a patch or a full artifact directory.

        Raises SignatureError, ExpiredError, ReplayError, BaseMismatchError, FormatError,
        HashMismatchError, UnsafePathError (the update is refused; nothing changed), KeyFileError
        (no usable trusted keys), AgentError (disk full, server refused the version: the device
        stays on, or returns to, the version it had).
        """
        if (patch is None) == (artifact is None):
            raise AgentError("install needs exactly one of a patch or an artifact directory")
        with self.store.locked(), _os_errors_as_agent_errors("install"):
            self.store.recover()
            self.on_step("recovered")
            state = self.store.read_state()
            try:
                envelope = read_envelope(manifest)
                release, retry = self._verified_release(envelope, state)
                version = check_version_name(release.model.version)
                if retry:
                    return self._finish_retry(state, release, version)
                staged = (
                    None
                    if self.store.version_dir(version).exists()
                    else self._stage(release, version, patch, artifact)
                )
            except SitsError as exc:
                # Refused before anything changed: the store stays byte-identical (state.json
                # is not rewritten); the journal has the reason.
                _log.warning("install refused (store unchanged): %s", exc.message)
                raise
            return self._install(state, release, version, staged, _sha256(envelope))

    def verify(self, manifest: Path) -> Release:
        """Check the release in `manifest` as install does (signatures, expiry, counter, base)
        without changing anything: for what must be refused before other changes (an offline
        bundle's agent upgrade). Raises what install raises for a refused release."""
        with self.store.locked(), _os_errors_as_agent_errors("verify"):
            release, _ = self._verified_release(read_envelope(manifest), self.store.read_state())
            return release

    def _install(
        self, state: DeviceState, release: Release, version: str, staged: Path | None, signed_sha256: str
    ) -> InstallResult:
        current = self.store.current_version()
        try:
            if staged is None:
                self._check_on_disk(version, release)  # promoted before a crash: finish that install
            else:
                self.store.promote(staged, version)
            self.on_step("promoted")
        except SitsError as exc:
            self._record_failure("install", version, exc)
            raise
        record = VersionRecord(release=release, installed_at=utc_now())
        state = state.model_copy(
            update={
                "versions": {**state.versions, version: record},
                "release_counter": max(state.release_counter, release.counter),
                "in_progress": InProgress(
                    version=version, counter=release.counter, signed_sha256=signed_sha256
                ),
            }
        )
        outcome = self._activate(state, version, "install", f"release counter {release.counter}")
        self._done(version)
        return InstallResult(version, current, release.artifact.sha256, release.counter, True, outcome)

    def _finish_retry(self, state: DeviceState, release: Release, version: str) -> InstallResult:
        """The install in progress when the agent was interrupted, sent again: finish it."""
        current = self.store.current_version()
        self._check_on_disk(version, release)
        if current == version:
            # The pointers moved; the server may still be on the old version: make sure.
            outcome = self._ensure_served(
                version, "install", back_to=self.store.previous_version(), back_previous=None
            )
        else:
            outcome = self._activate(state, version, "install", f"release counter {release.counter} (retry)")
        self._done(version)
        return InstallResult(
            version, current, release.artifact.sha256, release.counter, current != version, outcome
        )

    def _done(self, version: str) -> None:
        """The install of `version` is complete (served): no retry of it is accepted any more."""
        state = self.store.read_state()
        if state.in_progress is not None and state.in_progress.version == version:
            self.store.write_state(state.model_copy(update={"in_progress": None}))

    def _verified_release(self, envelope: Envelope, state: DeviceState) -> tuple[Release, bool]:
        """The release if it may be installed, and whether it is a crash retry of the one in progress.

        A release at (not above) the counter floor is accepted only as the exact signed release
        recorded in progress: same version, counter and signed bytes. Anything else below or at
        the floor is a replay, refused, however recently it was installed.
        """
        trusted = self.trusted_keys()
        installed = Installed(state.release_counter, state.artifact_sha256)
        try:
            return verify_release(envelope, trusted, now=self.clock(), installed=installed), False
        except ReplayError:
            release = parse_release(envelope.signed, "release manifest")
            progress = state.in_progress
            if progress is not None and (progress.version, progress.counter, progress.signed_sha256) == (
                release.model.version,
                release.counter,
                _sha256(envelope),
            ):
                return release, True
            raise

    def trusted_keys(self) -> TrustedKeys:
        """The device's trusted keys (releases and offline bundles are verified with them); a key
        file that does not parse is skipped with a warning in the journal naming it
        (`load_usable_keys`). Raises KeyFileError when too few remain."""
        files = self.store.trusted_key_files()
        if not files:
            raise KeyFileError(
                f"no trusted release keys in {self.store.keys_dir}",
                hint="install the release public key(s) there as *.pub files",
            )
        threshold = self.store.signature_threshold()
        return load_usable_keys(files, threshold, where=str(self.store.keys_dir), warn=_log.warning)

    def _stage(self, release: Release, version: str, patch: Path | None, artifact: Path | None) -> Path:
        staged = self.store.new_staging_dir(f"install-{version}")
        try:
            if patch is not None:
                base = self.store.current_version_dir()
                if base is None:
                    raise AgentError(
                        "a patch needs an installed base version, and none is installed",
                        hint="install the full artifact (--artifact) first",
                    )
                # The disk-space check runs on the patch header's target sizes, which must
                # equal the signed ones, before anything is written.
                apply_release_patch(
                    release,
                    patch,
                    base,
                    staged,
                    before_write=lambda header: self._check_space(
                        release, sum(t.size for t in header.targets)
                    ),
                )
            else:
                assert artifact is not None
                self._check_space(release, sum(f.size for f in release.artifact.files.values()))
                _copy_release_files(release, artifact, staged)
            verify_artifact_dir(staged, release)
            self.on_step("verified")
            self.on_step("staged")
        except OSError as exc:
            shutil.rmtree(staged, ignore_errors=True)
            raise _disk_error(exc, self.store.staging_dir, version) from exc
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return staged

    def _check_space(self, release: Release, needed: int) -> None:
        free = shutil.disk_usage(self.store.staging_dir).free
        if needed > free:
            raise AgentError(
                f"not enough disk space for {release.model.version}: it needs "
                f"{needed / 1e6:.1f} MB, {free / 1e6:.1f} MB are free under {self.store.staging_dir}",
                hint="remove old versions with `sits-agent gc --keep 2`, then retry",
            )

    # -- rollback ------------------------------------------------------------------------------

    def rollback(self, to: str | None = None) -> RollbackResult:
        """Return to `to` (default: the `previous` version) after re-hashing its files.

        Raises AgentError (no such verified version, or the server refused it: the device stays
        on the version it had) and HashMismatchError (the version on disk was altered).
        """
        with self.store.locked(), _os_errors_as_agent_errors("rollback"):
            self.store.recover()
            target = to or self.store.previous_version()
            if target is None:
                raise AgentError(
                    "there is no previous version to roll back to",
                    hint=f"name one with --to; on disk: {self._on_disk()}",
                )
            return self._roll_to(target, "rollback", "requested")

    def self_rollback(self) -> RollbackResult:
        """systemd's OnFailure= entry: leave the failing current version for the previous one.

        The version left behind is marked failed, so a second failure never swings back to it.
        Raises AgentError when there is no healthy previous version.
        """
        with self.store.locked(), _os_errors_as_agent_errors("self-rollback"):
            self.store.recover()
            state = self.store.read_state()
            current, previous = self.store.current_version(), self.store.previous_version()
            record = state.versions.get(previous) if previous else None
            if previous is None or record is None or previous == current or record.failed:
                raise AgentError(
                    f"version {current} failed and there is no healthy previous version to return to",
                    hint="install a fixed release, or pick one with `sits-agent rollback --to V`",
                )
            if current in state.versions:
                failed = state.versions[current].model_copy(update={"failed": True})
                self.store.write_state(
                    state.model_copy(update={"versions": {**state.versions, current: failed}})
                )
            return self._roll_to(previous, "self-rollback", f"version {current} failed (OnFailure)")

    def _roll_to(self, target: str, action: Action, reason: str) -> RollbackResult:
        current = self.store.current_version()
        if target == current:
            outcome = self._ensure_served(
                target, action, back_to=self.store.previous_version(), back_previous=None
            )
            return RollbackResult(target, current, False, outcome)
        try:
            state = self.store.read_state()
            self._check_on_disk(target, _recorded_release(state, target, self._on_disk()))
            if state.versions[target].failed:
                raise AgentError(
                    f"version {target} failed on this device and is never rolled back to",
                    hint="install a new signed release of it (a higher counter) if it is fixed; "
                    f"healthy versions on disk: {self._healthy(state)}",
                )
            outcome = self._activate(state, target, action, reason)
        except SitsError as exc:
            self._record_failure(action, target, exc)
            raise
        return RollbackResult(target, current, True, outcome)

    # -- shared --------------------------------------------------------------------------------

    def collect_garbage(self, keep: int) -> list[str]:
        """Remove all but the newest `keep` versions (current and previous always stay)."""
        with self.store.locked(), _os_errors_as_agent_errors("gc"):
            self.store.recover()
            return self.store.collect_garbage(keep)

    def _activate(
        self, state: DeviceState, version: str, action: Action, reason: str
    ) -> ReloadOutcome | None:
        """Journal the pointer change, make it, and have the server load `version`; undo on refusal."""
        old, old_previous = self.store.current_version(), self.store.previous_version()
        change = PointerSwitch(
            current=version,
            previous=old if old not in (None, version) else old_previous,
            event=HistoryEntry(
                at=utc_now(), action=action, result="ok", version=version, from_version=old, reason=reason
            ),
        )
        self.store.write_state(state.model_copy(update={"pending": change}))
        self.on_step("recorded")
        self.store.switch(change, self.on_step)
        return self._ensure_served(version, action, back_to=old, back_previous=old_previous)

    def _ensure_served(
        self, version: str, action: Action, *, back_to: str | None, back_previous: str | None
    ) -> ReloadOutcome | None:
        """Have the running server serve `version`; if it refuses, point back to `back_to`."""
        outcome = None
        if self.reloader is not None:
            outcome = self.reloader(version, "update" if action == "install" else "rollback")
        self.on_step("reloaded")
        if outcome is None or outcome.ok:
            return outcome
        change = PointerSwitch(
            current=back_to,
            previous=back_previous,
            event=HistoryEntry(
                at=utc_now(),
                action="rollback",
                result="ok",
                version=back_to,
                from_version=version,
                reason=f"the server refused {version}: {outcome.detail}",
            ),
        )
        self.store.write_state(self.store.read_state().model_copy(update={"pending": change}))
        self.store.switch(change)
        self._unpromote(version)
        raise AgentError(
            f"the server refused version {version}: {outcome.detail}; still serving {back_to}",
            hint=f"`current` points back to {back_to}; see `sits-agent status` and the journal",
        )

    def _unpromote(self, version: str) -> None:
        """A version the server refused leaves versions/: no rollback can pick it, and the install
        in progress ends (a replay of its release is refused). The counter floor stays where the
        release put it (docs/security-model.md says why)."""
        state = self.store.read_state()
        versions = {v: r for v, r in state.versions.items() if v != version}
        self.store.write_state(state.model_copy(update={"versions": versions, "in_progress": None}))
        if version not in (self.store.current_version(), self.store.previous_version()):
            self.store.remove_version(version)

    def _check_on_disk(self, version: str, release: Release) -> None:
        directory = self.store.version_dir(version)
        manifest = directory / "sits-manifest.json"
        if not manifest.is_file() or sha256_file(manifest) != release.artifact.sha256:
            raise AgentError(
                f"{directory}: holds another artifact than release {version} names",
                hint="versions are immutable; publish the change under a new version",
            )
        verify_artifact_dir(directory, release)

    def _record_failure(self, action: Action, version: str | None, exc: SitsError) -> None:
        entry = HistoryEntry(
            at=utc_now(), action=action, result="failed", version=version, reason=exc.message
        )
        try:
            state = self.store.read_state()
            self.store.write_state(state.with_event(entry))
        except SitsError:
            pass  # e.g. the disk is full: the caller's error is the one to report, not this one

    def _healthy(self, state: DeviceState) -> str:
        healthy = [
            v for v in self.store.installed_versions() if v in state.versions and not state.versions[v].failed
        ]
        return ", ".join(healthy) or "none"

    def _on_disk(self) -> str:
        return ", ".join(self.store.installed_versions()) or "none"


def _sha256(envelope: Envelope) -> str:
    """sha256 of the bytes the signatures cover: what "the exact same signed release" means."""
    return hashlib.sha256(envelope.signed_bytes()).hexdigest()


def _recorded_release(state: DeviceState, version: str, on_disk: str) -> Release:
    record = state.versions.get(check_version_name(version))
    if record is None:
        raise AgentError(
            f"version {version} has no verified release recorded on this device (on disk: {on_disk})",
            hint="rollback only goes to versions installed here; install it with `sits-agent install`",
        )
    return record.release


def _copy_release_files(release: Release, source: Path, staged: Path) -> None:
    """Copy the files the release lists (and only those) from `source`; symlinks are refused.
    A missing file is left for verify_artifact_dir to report with the others."""
    for name in sorted(release.artifact.files):
        src = inside(source, check_relative_path(name, str(source)), must_exist=False)
        if not src.exists():
            continue
        dest = staged / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)


@contextlib.contextmanager
def _os_errors_as_agent_errors(operation: str) -> Iterator[None]:
    """The store's own file operations (rename, symlink, fsync) failing is rare; say so clearly."""
    try:
        yield
    except OSError as exc:
        raise AgentError(
            f"{operation} failed: {exc.strerror or exc} ({exc.filename or 'store'})",
            hint="check the disk and permissions under the store root; `current` is unchanged "
            "or points at a fully verified version",
        ) from exc


def _disk_error(exc: OSError, where: Path, version: str) -> AgentError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return AgentError(
            f"disk full while staging {version} under {where}; nothing was installed",
            hint="remove old versions with `sits-agent gc --keep 2`, then retry",
        )
    return AgentError(f"cannot stage {version} under {where}: {exc.strerror or exc}")
