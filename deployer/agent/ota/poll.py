"""`sits-agent poll`: fetch the channel's TUF metadata, and install a newer release like a pushed one.

One poll, step by step::

    back off?    after failures, polls before `retry_after` do nothing (exponential, jittered)
    refresh      python-tuf ngclient: root rotation, timestamp, snapshot, targets; signatures,
                 thresholds, versions (no replay), expiry (no freeze), snapshot binding (no mixing)
    compare      the channel's artifact (a signed hint on full/release.json) against state.json:
                 equal -> done (an unchanged channel costs the timestamp and a 404 for the next root)
    download     patch/<installed sha>/{release.json,delta.patch} when published, else the full
                 release and artifact; resumable (HTTP Range), bounded by the signed lengths, a
                 byte budget and a time budget per poll, each file checked against its TUF hash
                 before use
    install      Updater.install: release signature, counter and base checked again, staged,
                 promoted, the running server reloaded (hot swap)

Settings: `<root>/etc/sits/pull.yaml` (PullSettings); trust anchor: the channel's `1.root.json`
provisioned as `<root>/etc/sits/pull-root.json`. Working files: `<root>/var/lib/sits/pull/`.
Every failure is recorded in `pull/poll-state.json` (shown by `sits-agent status`) and raised as a
SitsError; the device keeps serving what it has.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import requests
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tuf.api import exceptions as tuf_errors
from tuf.api.metadata import TargetFile
from tuf.ngclient import Updater as TufUpdater
from tuf.ngclient import UpdaterConfig

from deployer.agent.ota.fetch import PullFetcher
from deployer.agent.ota.store import DeviceStore, utc_now
from deployer.agent.ota.updater import InstallResult, Updater
from deployer.core.fsutil import atomic_write
from deployer.core.patch_format import check_relative_path
from deployer.core.ratelimit import Throttle, TokenBucket
from deployer.core.redact import redact, register
from deployer.core.release import read_envelope
from deployer.errors import (
    AgentError,
    ConfigError,
    ExpiredError,
    FormatError,
    HashMismatchError,
    IntegrityError,
    ReplayError,
    SignatureError,
    SitsError,
    TransportError,
)

__all__ = ["Channel", "PollOutcome", "PollState", "Poller", "PullSettings", "load_pull_settings"]

SETTINGS_FILE = "etc/sits/pull.yaml"
ROOT_FILE = "etc/sits/pull-root.json"
FULL_RELEASE = "full/release.json"


class PullSettings(BaseModel):
    """`etc/sits/pull.yaml`: which channel to poll and how much a poll may cost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https?://", description="the channel, e.g. https://cdn.example/sits/stable/")
    max_bytes_per_poll: int = Field(default=4 * 2**30, ge=64 * 1024)
    timeout_s: float = Field(default=30.0, gt=0, description="idle timeout of each connect and receive")
    max_download_s: float = Field(
        default=1800.0,
        gt=0,
        description="the time a poll may spend downloading; past it the poll stops (what arrived is "
        "kept for the next poll), so a server that sends slowly or never finishes cannot hold it. "
        "Below the poll unit's TimeoutStartSec (3600 s), which leaves time to install.",
    )
    max_resumes: int = Field(default=5, ge=0, description="dropped connections tolerated per file")
    max_rate: float | None = Field(
        default=None, gt=0, description="bytes per second this device downloads at most (None: no cap)"
    )
    metered: bool = Field(
        default=False,
        description="a metered link: with a model installed, only a patch from it is downloaded; "
        "the full release only with allow_full_on_metered",
    )
    allow_full_on_metered: bool = False
    retry_base_s: float = Field(default=60.0, gt=0)
    retry_max_s: float = Field(default=6 * 3600.0, gt=0)


class PollState(BaseModel):
    """`var/lib/sits/pull/poll-state.json`: the last poll and the backoff."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    last_attempt: str | None = None
    last_success: str | None = None
    result: Literal["updated", "up-to-date", "skipped", "failed"] | None = None
    error: str = ""
    failures: int = 0
    retry_after: str | None = None


@dataclass(frozen=True)
class PollOutcome:
    """What one poll did. `result` is 'skipped' while backing off after failures."""

    result: Literal["updated", "up-to-date", "skipped"]
    channel_version: str | None
    payload: Literal["patch", "full"] | None
    requests: int
    bytes_downloaded: int
    install: InstallResult | None = None
    detail: str = ""


def load_pull_settings(root: Path) -> PullSettings:
    """Read `<root>/etc/sits/pull.yaml`. Raises ConfigError (absent, unreadable, invalid)."""
    path = root / SETTINGS_FILE
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        settings = PullSettings.model_validate(data)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{path}: missing, so this device has no channel to poll",
            hint="write `url: https://<server>/<channel>/` there (see docs/pull-mode.md)",
        ) from exc
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise ConfigError(f"{path}: {where}: {first['msg']}", hint="see docs/pull-mode.md") from exc
    # A channel behind basic auth has its password in the URL, which every poll error names.
    if password := urlsplit(settings.url).password:
        register(password, "<password of the channel url>")
    return settings


class Channel:
    """One TUF channel seen from one device: refreshed metadata and hash-checked downloads.

    `metadata_dir` keeps the trusted metadata between polls (what makes replays detectable);
    `downloads` holds finished and partial target files, named by their sha256.
    """

    def __init__(self, url: str, metadata_dir: Path, downloads: Path, fetcher: PullFetcher) -> None:
        self.url = url.rstrip("/")
        self.metadata_dir = metadata_dir
        self.downloads = downloads
        self.fetcher = fetcher
        self._tuf: TufUpdater | None = None

    def refresh(self, anchor: Path) -> None:
        """Run TUF's refresh; `anchor` (the channel's 1.root.json) seeds the first one. Raises
        ExpiredError, ReplayError, SignatureError, IntegrityError, TransportError, ConfigError."""
        self.metadata_dir.mkdir(parents=True, exist_ok=True)
        bootstrap = None
        if not (self.metadata_dir / "root.json").exists():
            try:
                bootstrap = anchor.read_bytes()
            except OSError as exc:
                raise ConfigError(
                    f"{anchor}: the channel's trusted root metadata is missing",
                    hint="provision the channel's metadata/1.root.json there (see docs/pull-mode.md)",
                ) from exc
        with _tuf_errors_as_ours(self.url):
            tuf = TufUpdater(
                metadata_dir=str(self.metadata_dir),
                metadata_base_url=f"{self.url}/metadata/",
                target_base_url=f"{self.url}/targets/",
                target_dir=str(self.downloads),
                fetcher=self.fetcher,
                config=UpdaterConfig(timestamp_max_length=16 * 1024),
                bootstrap=bootstrap,
            )
            tuf.refresh()
        self._tuf = tuf

    def target(self, path: str) -> TargetFile | None:
        """The signed entry for `path`, or None when the channel does not publish it."""
        if self._tuf is None:
            raise AgentError("Channel.target() before refresh()")
        with _tuf_errors_as_ours(path):
            return self._tuf.get_targetinfo(path)

    def latest(self) -> TargetFile:
        """The full release's entry; its signed `custom` names version, artifact and counter."""
        full = self.target(FULL_RELEASE)
        if full is None:
            raise AgentError(f"{self.url}: the channel publishes no release ({FULL_RELEASE})")
        return full

    def patch_from(self, base_sha256: str) -> tuple[TargetFile, TargetFile] | None:
        """(release, patch) entries for a patch from the artifact `base_sha256`, if published."""
        release = self.target(f"patch/{base_sha256}/release.json")
        delta = self.target(f"patch/{base_sha256}/delta.patch")
        return (release, delta) if release is not None and delta is not None else None

    def download(self, info: TargetFile) -> Path:
        """Download one target (resumable) and check its TUF length and hashes; return its path.

        The whole file is hashed, from its first byte, resumed or not. A file that fails is
        deleted, so the next poll starts it afresh instead of resuming a rejected one forever.
        """
        directory, _, name = info.path.rpartition("/")
        digest = info.hashes["sha256"]
        url = f"{self.url}/targets/{directory}/{digest}.{name}"
        done = self.downloads / digest / check_relative_path(name, info.path)
        if done.is_file():
            self._verified(done, info, url)
            return done
        self._verified(self.fetcher.download(url, done.with_name(name + ".part"), info.length), info, url)
        done.with_name(name + ".part").replace(done)
        return done

    @staticmethod
    def _verified(path: Path, info: TargetFile, url: str) -> None:
        """Check `path` against its signed TUF entry; delete it when it does not match."""
        try:
            with path.open("rb") as f, _tuf_errors_as_ours(url):
                info.verify_length_and_hashes(f)
        except SitsError:
            path.unlink(missing_ok=True)
            raise

    def download_artifact(self, manifest: Path) -> Path:
        """The artifact's files, each named by the release and hashed against the TUF targets,
        gathered into one directory for Updater.install (which verifies the release itself)."""
        release = read_envelope(manifest).signed
        files = release.get("artifact", {}).get("files", {})
        if not isinstance(files, dict) or not files:
            raise FormatError(f"{manifest}: the release lists no artifact files")
        directory = self.downloads / "artifact"
        directory.mkdir(parents=True, exist_ok=True)
        for name in sorted(files):
            info = self.target(f"full/artifact/{check_relative_path(name, 'release')}")
            if info is None:
                raise IntegrityError(
                    f"{self.url}: the release names {name}, which the channel's targets lack",
                    hint="the channel was published incompletely or tampered with; re-publish it",
                )
            (directory / name).unlink(missing_ok=True)
            (directory / name).hardlink_to(self.download(info))
        return directory


class Poller:
    """Polls one channel for one device store. `clock` and `rng` are seams for the backoff."""

    def __init__(
        self,
        store: DeviceStore,
        updater: Updater,
        settings: PullSettings,
        *,
        clock: Callable[[], datetime] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.updater = updater
        self.settings = settings
        self.clock = clock or (lambda: datetime.now(UTC))
        self.rng = rng or random.Random()
        self.base = store.base / "pull"
        self.state_path = self.base / "poll-state.json"
        url_id = hashlib.sha256(settings.url.encode()).hexdigest()[:16]
        self.metadata_dir = self.base / "channels" / url_id
        self.downloads = self.base / "downloads"

    def read_state(self) -> PollState:
        """The last poll's record (empty before the first poll or when unreadable)."""
        try:
            return PollState.model_validate_json(self.state_path.read_bytes())
        except (OSError, ValidationError):
            return PollState()

    def poll(self, *, force: bool = False) -> PollOutcome:
        """Poll once (unless backing off and not `force`). Raises the SitsError that failed it."""
        state = self.read_state()
        now = self.clock()
        if not force and state.retry_after and now < datetime.fromisoformat(state.retry_after):
            detail = f"backing off after {state.failures} failure(s) until {state.retry_after}: {state.error}"
            return PollOutcome("skipped", None, None, 0, 0, detail=detail)
        fetcher = PullFetcher(
            timeout_s=self.settings.timeout_s,
            budget=self.settings.max_bytes_per_poll,
            deadline_s=self.settings.max_download_s,
            max_resumes=self.settings.max_resumes,
            throttle=Throttle([TokenBucket(rate)]) if (rate := self.settings.max_rate) else None,
        )
        try:
            outcome = self._poll(fetcher)
        except SitsError as exc:
            self._record_failure(state, exc)
            raise
        finally:
            fetcher.close()
        now_text = utc_now()
        self._write_state(PollState(last_attempt=now_text, last_success=now_text, result=outcome.result))
        return outcome

    def _poll(self, fetcher: PullFetcher) -> PollOutcome:
        channel = Channel(self.settings.url, self.metadata_dir, self.downloads, fetcher)
        channel.refresh(self.store.root / ROOT_FILE)
        full = channel.latest()
        installed = self.store.read_state().artifact_sha256
        version = str(full.custom.get("version", "?"))
        if installed is not None and full.custom.get("artifact_sha256") == installed:
            return PollOutcome("up-to-date", version, None, fetcher.requests, fetcher.bytes)
        patch = channel.patch_from(installed) if installed else None
        if patch is None and installed is not None:
            self._check_full_allowed(installed, version)
        if patch is not None:
            manifest, delta = (channel.download(info) for info in patch)
            result = self.updater.install(manifest, patch=delta)
            payload: Literal["patch", "full"] = "patch"
        else:
            manifest = channel.download(full)
            result = self.updater.install(manifest, artifact=channel.download_artifact(manifest))
            payload = "full"
        shutil.rmtree(self.downloads, ignore_errors=True)
        return PollOutcome("updated", version, payload, fetcher.requests, fetcher.bytes, result)

    def _check_full_allowed(self, installed: str, version: str) -> None:
        """On a metered link, a missing patch is never made up for by the full release unasked."""
        if self.settings.metered and not self.settings.allow_full_on_metered:
            running = self.store.current_version() or installed[:12]
            raise AgentError(
                f"{self.settings.url}: metered link: the channel publishes no patch from {running} to "
                f"{version}, and the full release is not downloaded on a metered link; this device "
                f"keeps serving {running}",
                hint="publish with a patch from that version (publish.patch_bases), or set "
                "bandwidth.allow_full_on_metered for this device in deploy.yaml",
            )

    def _record_failure(self, state: PollState, exc: SitsError) -> None:
        failures = state.failures + 1
        delay = min(self.settings.retry_max_s, self.settings.retry_base_s * 2 ** (failures - 1))
        retry = self.clock() + timedelta(seconds=delay * (0.5 + self.rng.random() / 2))
        self._write_state(
            PollState(
                last_attempt=utc_now(),
                last_success=state.last_success,
                result="failed",
                error=redact(str(exc)),
                failures=failures,
                retry_after=retry.isoformat(timespec="seconds"),
            )
        )

    def _write_state(self, state: PollState) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        atomic_write(self.state_path, state.model_dump_json(indent=2) + "\n", error=AgentError)


@contextlib.contextmanager
def _tuf_errors_as_ours(where: str) -> Iterator[None]:
    """Translate python-tuf's exceptions (and OSError from its metadata cache) into our tree."""
    try:
        yield
    except SitsError:
        raise
    except Exception as exc:
        mapped = _map_tuf_error(where, exc)
        if mapped is None:
            raise
        raise mapped from exc


def _map_tuf_error(where: str, exc: BaseException) -> SitsError | None:
    refused = "refused; the device keeps its current version"
    if isinstance(exc, tuf_errors.ExpiredMetadataError):
        return ExpiredError(
            f"{where}: {exc}: metadata expired (a frozen mirror, or this device's clock is wrong); {refused}",
            hint="check the device clock (timedatectl); the publisher must re-sign the timestamp in time",
        )
    if isinstance(exc, tuf_errors.BadVersionNumberError):
        return ReplayError(f"{where}: {exc}: older or mixed metadata; {refused}")
    if isinstance(exc, tuf_errors.UnsignedMetadataError):
        return SignatureError(
            f"{where}: {exc}: not signed by the keys this device trusts; {refused}",
            hint="check that pull-root.json is this channel's root and that publish used its keys",
        )
    if isinstance(exc, tuf_errors.LengthOrHashMismatchError):
        return HashMismatchError(f"{where}: {exc}: content does not match the signed metadata; {refused}")
    if isinstance(exc, tuf_errors.RepositoryError):
        return IntegrityError(f"{where}: {exc}; {refused}")
    if isinstance(exc, tuf_errors.DownloadHTTPError):
        return TransportError(
            f"{where}: HTTP {exc.status_code} ({exc})",
            hint="403: the bucket or server denies reading; 404: not published there (check pull.yaml url)",
        )
    # requests' errors are OSErrors too: a connection that broke mid-metadata is not a local problem.
    if isinstance(exc, tuf_errors.DownloadError | requests.RequestException):
        cause = exc.__cause__ if isinstance(exc, tuf_errors.DownloadError) and exc.__cause__ else exc
        return TransportError(
            f"{where}: cannot download: {type(cause).__name__}: {cause}",
            hint="the server is unreachable or the connection dropped; the next poll retries",
        )
    if isinstance(exc, OSError):
        return AgentError(f"{where}: local metadata: {exc.strerror or exc}")
    return None
