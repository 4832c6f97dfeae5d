"""Install and roll back LoRA adapters on a device, each on its own, the base untouched (issue #41).

install, in order; the first failure stops it, and before `installed` nothing is changed::

    verified   the adapter release: signatures (k of n trusted keys), kind, expiry, the adapter's
               own counter floor (replay, downgrade), made for the base artifact this device serves,
               a patch from the adapter version installed
    staged     the full artifact copied, or the patch applied, into a staging dir under the store;
               every file against the release's hashes; the factors read back (deployer.core.lora:
               rank, shapes, finite values) and their adapter.json matching the release
    installed  AdapterStore.install: moved into place, previous <- current, counter recorded
    reloaded   the running agent loads it (admin socket), base and other adapters untouched
    smoked     the agent's smoke prompts through it

A failed reload or smoke rolls the adapter back (AdapterStore.rollback, then a reload of the
version restored, or an unload when there was none) and raises AgentError naming the cause.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from deployer.agent.ota.adapters import AdapterRecord, AdapterStore
from deployer.agent.ota.store import DeviceStore
from deployer.core.adapter_release import (
    AdapterRelease,
    check_adapter_dir,
    expected_files,
    parse_adapter_release,
    verify_adapter_release,
)
from deployer.core.lora import read_adapter
from deployer.core.release import read_envelope
from deployer.core.verify import TrustedKeys, check_signatures, load_usable_keys
from deployer.errors import AgentError, FormatError, IntegrityError

__all__ = [
    "AdapterControl",
    "AdapterInstaller",
    "AdapterOutcome",
    "ControlAnswer",
    "device_base",
    "device_trust",
]


@dataclass(frozen=True)
class ControlAnswer:
    """What the running agent said to a reload or a smoke test. `served` is False when no agent
    answered (the adapter loads at its next start, which counts as success)."""

    ok: bool
    served: bool
    detail: str = ""


@dataclass(frozen=True)
class AdapterControl:
    """The running agent, as the installer reaches it: reload an adapter by name, smoke-test it."""

    reload: Callable[[str], ControlAnswer]
    smoke: Callable[[str], ControlAnswer]


@dataclass(frozen=True)
class AdapterOutcome:
    """What an install or rollback left: the adapter's current version (None: none installed)."""

    name: str
    version: str | None
    artifact_id: str | None
    from_version: str | None
    counter: int
    detail: str = ""


class AdapterInstaller:
    """Verification in front of the device's AdapterStore, and the reload/smoke/rollback after it."""

    def __init__(
        self,
        adapters: AdapterStore,
        control: AdapterControl,
        *,
        trusted: Callable[[], TrustedKeys],
        base_artifact_id: Callable[[], str | None],
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.adapters = adapters
        self.control = control
        self.trusted = trusted
        self.base_artifact_id = base_artifact_id
        self.now = now

    def install(
        self, manifest: Path, *, artifact: Path | None = None, patch: Path | None = None
    ) -> AdapterOutcome:
        """Verify the adapter release at `manifest` with its payload (a full artifact directory or a
        patch from the installed version), install it, load it, smoke-test it. Raises
        IntegrityError subclasses (nothing changed) or AgentError (rolled back)."""
        if (artifact is None) == (patch is None):
            raise AgentError("give exactly one of an adapter artifact directory or a patch")
        release = self.verify(manifest)
        name = release.adapter.name
        before = self.adapters.record(name)
        staging = Path(tempfile.mkdtemp(prefix=f".staging-{name}-", dir=self._staging_root()))
        try:
            self._stage(release, staging, artifact, patch, before)
            record = self.adapters.install(
                name, staging, release.artifact.sha256, release.adapter.version, release.counter
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        problem = self._load_and_smoke(name)
        from_version = before.version if before is not None else None
        if problem is not None:
            self._back(name)
            restored = self.control.reload(name)
            back = before.version if before is not None else "none (unloaded)"
            raise AgentError(
                f"adapter {name} {record.version}: {problem}; rolled back to {back}"
                + ("" if restored.ok else f" (reloading it failed too: {restored.detail})"),
                hint="the base kept serving; fix the adapter and release a new version",
            )
        return AdapterOutcome(name, record.version, record.artifact_id, from_version, release.counter)

    def verify(self, manifest: Path) -> AdapterRelease:
        """The adapter release at `manifest` if this device may install it now; raises the first
        failure (SignatureError, FormatError, ExpiredError, ReplayError, BaseMismatchError)."""
        envelope = read_envelope(manifest)
        trusted = self.trusted()
        check_signatures(envelope, trusted)  # before anything of the signed part is believed
        name = parse_adapter_release(envelope.signed, str(manifest)).adapter.name
        installed = self.adapters.record(name)
        return verify_adapter_release(
            envelope,
            trusted,
            now=self.now(),
            counter_floor=self.adapters.state(name).counter,
            base_artifact_id=self.base_artifact_id(),
            installed_artifact_id=installed.artifact_id if installed is not None else None,
        )

    def rollback(self, name: str) -> AdapterOutcome:
        """Back to the adapter's previous version (or none), and reload it. Raises AgentError when
        there is nothing to roll back to."""
        before = self.adapters.record(name)
        if before is None:
            raise AgentError(f"adapter {name} is not installed", hint="`sits-agent adapter list` shows them")
        record = self._back(name)
        answer = self.control.reload(name)
        version = record.version if record is not None else None
        if not answer.ok:
            raise AgentError(
                f"adapter {name} rolled back to {version or 'none'} on disk, but the agent refused to "
                f"load it: {answer.detail}",
                hint="`sits-agent adapter reload NAME` retries; the base kept serving",
            )
        return AdapterOutcome(
            name,
            version,
            record.artifact_id if record is not None else None,
            before.version,
            self.adapters.state(name).counter,
            answer.detail,
        )

    def _back(self, name: str) -> AdapterRecord | None:
        """The previous version made current, or, when there is none, the adapter removed (its
        counter stays: the release rolled back from is spent)."""
        record = self.adapters.rollback(name)
        if record is None:
            self.adapters.remove(name)
        return record

    def _load_and_smoke(self, name: str) -> str | None:
        """None when the agent loaded the adapter and its smoke prompts passed (or no agent runs)."""
        reload = self.control.reload(name)
        if not reload.ok:
            return f"the agent refused to load it: {reload.detail}"
        if not reload.served:
            return None
        smoke = self.control.smoke(name)
        return None if smoke.ok else f"smoke prompts failed: {smoke.detail}"

    def _stage(
        self,
        release: AdapterRelease,
        staging: Path,
        artifact: Path | None,
        patch: Path | None,
        installed: AdapterRecord | None,
    ) -> None:
        """The release's files in `staging`, every one checked; raises IntegrityError."""
        if patch is not None:
            if release.patch is None or installed is None:
                raise FormatError(
                    f"{patch}: the adapter release carries no patch from an installed version",
                    hint="send the full adapter artifact",
                )
            _apply_patch(release, patch, installed.path, staging)
        else:
            assert artifact is not None  # install() checked
            shutil.copytree(artifact, staging, dirs_exist_ok=True, symlinks=True)
        check_adapter_dir(staging, release)
        adapter = read_adapter(staging)
        if (adapter.name, adapter.version, adapter.base_artifact_id) != (
            release.adapter.name,
            release.adapter.version,
            release.base_artifact_id,
        ):
            raise FormatError(
                f"{staging}: adapter.json says {adapter.name} {adapter.version} for base "
                f"{adapter.base_artifact_id[:16]}..., not what the release signs",
                hint="the adapter release was made wrongly; make it again",
            )

    def _staging_root(self) -> Path:
        self.adapters.dir.mkdir(parents=True, exist_ok=True)
        return self.adapters.dir


def device_trust(device: DeviceStore, warn: Callable[[str], None]) -> Callable[[], TrustedKeys]:
    """The device's trusted keys, loaded as the model updater loads them (unusable files skipped)."""
    return lambda: load_usable_keys(
        device.trusted_key_files(), device.signature_threshold(), where=str(device.root), warn=warn
    )


def device_base(device: DeviceStore) -> Callable[[], str | None]:
    """The id of the base artifact the device has installed as current (None: no model)."""

    def base() -> str | None:
        current = device.current_version()
        record = device.read_state().versions.get(current) if current is not None else None
        return record.release.artifact.sha256 if record is not None else None

    return base


def _apply_patch(release: AdapterRelease, patch: Path, base_dir: Path, out_dir: Path) -> None:
    """Apply the release's patch from the installed adapter dir, checking its length and hash
    against the release first and every output file as it is written."""
    from deployer.core.patch_apply import apply_open_patch, open_patch

    assert release.patch is not None  # the caller checked
    with open_patch(patch) as pf:
        if pf.size != release.patch.size or pf.sha256() != release.patch.sha256:
            raise IntegrityError(
                f"{patch}: is not the patch the adapter release signs (size or sha256 differ)",
                hint="send the patch again",
            )
        apply_open_patch(pf, base_dir, out_dir, expect=expected_files(release))
