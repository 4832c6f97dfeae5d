"""`sits-agent install --from PATH`: an offline bundle (deployer/core/bundle.py) from a directory
or a tar file, for a site with no network (a mounted USB stick).

    index     sits-bundle.json: signed by a threshold of this device's trusted release keys (the
              same keys, and the same check, as a release), for this device's class
              (agent.yaml's device_class)
    choose    the patch from the installed artifact when the bundle has one, else the full artifact
    files     the chosen files only, each the size and sha256 the index lists (a truncated copy or a
              tampered file is refused naming it); from a tar, extracted (regular files, paths
              checked, sizes checked before reading) into var/lib/sits/bundle/, which is emptied
              before and after
    agent     when the bundle carries the agent's wheels (wheels/, `--wheels-arch`) and its sits-agent
              is another version than the one running: the release verified first (below, without
              installing), every wheel and requirements.txt checked against the index and copied
              into the work directory, then `pip install --no-index --require-hashes -r` into the
              running agent's environment (deployer/core/agent_service.py's pip, as bootstrap
              installs an agent)
    install   Updater.install: the release's signatures, expiry, counter (anti-rollback: an older or
              the same bundle again is a replay) and base, staged, promoted, recorded in
              state.json, the running server hot-swapped; what `sits-agent install` does for a push.
              After an agent upgrade the old server is not asked to load it: the agent is restarted
              instead (as bootstrap restarts it), and the new agent loads it on start

Nothing is changed before the release and the files used are verified, so a refused bundle (a
tampered wheel too) leaves the device serving what it served. A stick pulled mid-install fails the
install the same way (nothing promoted).
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from deployer.agent.ota.updater import InstallResult, Updater
from deployer.core.agent_service import pip_install
from deployer.core.bundle import (
    BUNDLE_INDEX,
    FULL_DIR,
    PATCH_DIR,
    REQUIREMENTS,
    BundleIndex,
    parse_bundle_index,
)
from deployer.core.hashing import sha256_file
from deployer.core.patch_format import check_relative_path
from deployer.core.release import MAX_ENVELOPE_BYTES, parse_envelope
from deployer.core.verify import check_signatures
from deployer.errors import AgentError, FormatError, HashMismatchError, IntegrityError

__all__ = ["BundleOutcome", "RunningAgent", "install_bundle"]

WORK_DIR = "bundle"  # under var/lib/sits: where a tar's chosen files are extracted
PIP_TIMEOUT_S = 1800  # torch's wheel from a slow stick


@dataclass(frozen=True)
class RunningAgent:
    """The agent doing an offline install, which the bundle's wheels upgrade."""

    version: str  # the version it runs
    python: str  # its environment's interpreter: pip installs there
    restart: Callable[[], str]  # restarts it as an online upgrade does; says what it did


@dataclass(frozen=True)
class BundleOutcome:
    """What an offline install did."""

    source: str
    device_class: str | None
    payload: Literal["patch", "full"]
    install: InstallResult
    agent_from: str | None = None  # the agent version the bundle's replaced (None: kept)
    agent: str | None = None  # the agent version installed from the bundle
    restarted: str = ""  # how the upgraded agent was restarted


def install_bundle(
    source: Path, updater: Updater, device_class: str | None, running: RunningAgent | None = None
) -> BundleOutcome:
    """Verify the bundle at `source` for a device of `device_class` and install its release; with
    `running`, upgrade that agent from the bundle's wheels first when they hold another version.

    Raises FormatError (not a bundle, truncated), SignatureError (index not signed by trusted
    keys), IntegrityError (another device class), HashMismatchError (a file altered), and what
    Updater.install raises (ExpiredError, ReplayError, ...); AgentError when `source` is unreadable
    or pip fails.
    """
    if not source.exists():
        raise AgentError(
            f"{source}: no such bundle (is the stick mounted?)", hint="give the bundle's directory or file"
        )
    work = updater.store.base / WORK_DIR
    shutil.rmtree(work, ignore_errors=True)  # what an interrupted install left: never resumed from
    upgrading: RunningAgent | None = None  # `running`, when the bundle's wheels upgrade it
    new_agent: str | None = None
    restarted = ""
    try:
        with _opened(source, work) as bundle:
            index = bundle.verified_index(updater)
            if index.device_class != device_class:
                raise IntegrityError(
                    f"{source}: the bundle is for device class {_name(index.device_class)}, this "
                    f"device is {_name(device_class)}; refused, the device keeps its current version",
                    hint="make a bundle for this device's profile: sits-deployer bundle --profile NAME",
                )
            installed = updater.store.read_state().artifact_sha256
            payload: Literal["patch", "full"]
            if installed is not None and installed in index.patch_bases():
                payload = "patch"
                names = [f"{PATCH_DIR}/{installed}/release.json", f"{PATCH_DIR}/{installed}/delta.patch"]
            else:
                payload = "full"
                artifact = sorted(p for p in index.files if p.startswith(f"{FULL_DIR}/artifact/"))
                names = [f"{FULL_DIR}/release.json", *artifact]
            manifest, *rest = bundle.files(index, names)
            new_agent = index.agent_version()
            if running is not None and new_agent not in (None, running.version):
                upgrading = running
                updater.verify(manifest)  # an expired or replayed release changes nothing, pip included
                bundle.files(index, list(index.wheels()), copy=True)  # pip reads the checked copies
                _pip_install(upgrading.python, work / REQUIREMENTS, source)
                # The running server is the old agent: the restarted one loads the release.
                updater = Updater(updater.store, on_step=updater.on_step, clock=updater.clock)
            try:
                if payload == "patch":
                    result = updater.install(manifest, patch=rest[0])
                else:
                    result = updater.install(manifest, artifact=manifest.parent / "artifact")
            finally:
                if upgrading is not None:
                    restarted = upgrading.restart()  # installed or not, the new agent must run
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return BundleOutcome(
        str(source),
        device_class,
        payload,
        result,
        agent_from=upgrading.version if upgrading is not None else None,
        agent=new_agent if upgrading is not None else None,
        restarted=restarted,
    )


def _pip_install(python: str, requirements: Path, source: Path) -> None:
    """Install the bundle's wheels, each held to its sha256, into `python`'s environment."""
    argv = pip_install(python, "--require-hashes", "-r", str(requirements))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AgentError(
            f"{source}: cannot run pip with {python}: {exc}; the device keeps its agent and version",
            hint="run sits-agent from the agent's venv (/opt/sits/venv/bin/sits-agent)",
        ) from exc
    if done.returncode != 0:
        raise AgentError(
            f"{source}: pip could not install the bundle's agent wheels into {python}'s environment: "
            f"{(done.stderr or done.stdout).strip()[-600:]}; the device keeps its model version",
            hint="run it as the user that owns the agent's venv (root), or write the bundle again with "
            "the devices' --wheels-arch, --wheels-python and --wheels-glibc",
        )


class _Bundle:
    """A bundle's files, from a directory in place or extracted from a tar on demand."""

    def __init__(self, source: Path, work: Path, tar: tarfile.TarFile | None) -> None:
        self.source = source
        self.work = work
        self.tar = tar

    def verified_index(self, updater: Updater) -> BundleIndex:
        """The index, once a threshold of the device's trusted keys signed it."""
        where = f"{self.source}: {BUNDLE_INDEX}"
        envelope = parse_envelope(self._read_index(), where)
        check_signatures(envelope, updater.trusted_keys())
        return parse_bundle_index(envelope.signed, where)

    def files(self, index: BundleIndex, names: list[str], *, copy: bool = False) -> list[Path]:
        """Local paths of `names`, each checked against the index's size and sha256; with `copy`,
        under the work directory even from a directory bundle (so what is checked is what is used,
        whatever happens on the stick meanwhile)."""
        paths = []
        for name in names:
            want = index.files.get(name)
            if want is None:
                raise FormatError(f"{self.source}: the bundle's index does not list {name}")
            if self.tar is not None:
                path = self._extract(name, want.size)
            elif copy:
                path = self.work / check_relative_path(name, str(self.source))
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self._in_place(name), path)
            else:
                path = self._in_place(name)
            size = path.stat().st_size
            if size != want.size:
                raise FormatError(
                    f"{self.source}: {name} is {size} bytes, the bundle lists {want.size} (a truncated "
                    "copy?); refused, the device keeps its current version",
                    hint="copy the bundle again and check the copy finished (sync) before unplugging",
                )
            if sha256_file(path) != want.sha256:
                raise HashMismatchError(
                    f"{self.source}: {name} does not match the bundle's signed index (altered or "
                    "corrupted); refused, the device keeps its current version",
                    hint="write the bundle again with sits-deployer bundle",
                )
            paths.append(path)
        return paths

    def _read_index(self) -> bytes:
        if self.tar is None:
            try:
                with (self.source / BUNDLE_INDEX).open("rb") as f:
                    return f.read(MAX_ENVELOPE_BYTES + 1)
            except FileNotFoundError as exc:
                raise FormatError(f"{self.source}: not a bundle (no {BUNDLE_INDEX})") from exc
        member = self._member(BUNDLE_INDEX, None)
        stream = self.tar.extractfile(member)
        assert stream is not None  # _member returns regular files only
        return stream.read(MAX_ENVELOPE_BYTES + 1)

    def _in_place(self, name: str) -> Path:
        path = self.source / check_relative_path(name, str(self.source))
        if path.is_symlink() or not path.is_file():
            raise FormatError(f"{self.source}: {name} is missing or not a regular file")
        return path

    def _extract(self, name: str, size: int) -> Path:
        assert self.tar is not None
        member = self._member(name, size)
        dest = self.work / check_relative_path(name, str(self.source))
        dest.parent.mkdir(parents=True, exist_ok=True)
        stream = self.tar.extractfile(member)
        assert stream is not None
        with stream, dest.open("wb") as out:
            shutil.copyfileobj(stream, out)
        return dest

    def _member(self, name: str, size: int | None) -> tarfile.TarInfo:
        """The tar's regular file `name`; its header's size must be the listed one (so nothing
        larger is ever read)."""
        assert self.tar is not None
        try:
            member = self.tar.getmember(name)
        except KeyError as exc:
            raise FormatError(f"{self.source}: the bundle has no {name}") from exc
        if not member.isfile():
            raise FormatError(f"{self.source}: {name} is not a regular file in the bundle")
        if size is not None and member.size != size:
            raise FormatError(
                f"{self.source}: {name} is {member.size} bytes in the tar, the bundle lists {size}",
                hint="write the bundle again with sits-deployer bundle",
            )
        return member


@contextmanager
def _opened(source: Path, work: Path) -> Iterator[_Bundle]:
    """The bundle at `source`; a tar's damage (truncated, not a tar) and a stick pulled mid-read
    become our errors."""
    try:
        if source.is_dir():
            yield _Bundle(source, work, None)
            return
        with tarfile.open(source, "r:*") as tar:
            yield _Bundle(source, work, tar)
    except (tarfile.TarError, EOFError) as exc:
        raise FormatError(
            f"{source}: not a readable bundle ({type(exc).__name__}: {exc}): truncated or not a tar; "
            "refused, the device keeps its current version",
            hint="copy the bundle again and check the copy finished (sync) before unplugging",
        ) from exc
    except OSError as exc:
        raise AgentError(
            f"{source}: cannot read the bundle: {exc.strerror or exc}; the device keeps its current version",
            hint="check that the stick is mounted and readable, then run the same command again",
        ) from exc


def _name(device_class: str | None) -> str:
    return repr(device_class) if device_class else "(no profile)"
