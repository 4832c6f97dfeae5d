"""`sits-deployer bundle`: everything one device class needs to update with no network, in a
directory or a tar file (for a USB stick). The layout is deployer/core/bundle.py's.

The bundle holds the target's full release and artifact, and a patch release from each of the
last `bases` artifacts this controller released (newest first, the ones still in its store): a
device that runs one of them installs the patch, any other the full artifact. Its releases come from
the ledger with counters above every release of another artifact, so a device that took a fleet
rollback since still accepts them. The index is signed with the release key, which binds the device
class. With `wheels` it also carries the agent's wheels for the devices' platform (a device
installs or upgrades its agent from them with pip, offline, each wheel held to its sha256).
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from packaging.utils import parse_wheel_filename

from deployer.config.models import Config
from deployer.core.bundle import BUNDLE_INDEX, FULL_DIR, PATCH_DIR, REQUIREMENTS, WHEELS_DIR, BundleIndex
from deployer.core.hashing import sha256_file
from deployer.core.release import Envelope, FileHash, format_time
from deployer.errors import ConfigError, SitsError
from deployer.release.desired import Desired, Releaser, artifact_in_store
from deployer.release.sign import add_signature

__all__ = ["REQUIREMENTS", "BundleResult", "bundle_class", "write_bundle"]

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


@dataclass(frozen=True)
class BundleResult:
    """What `write_bundle` wrote."""

    path: Path
    version: str
    device_class: str | None
    counter: int  # the full release's
    patch_bases: tuple[str, ...]  # versions a device can patch from
    bytes: int
    wheels: tuple[str, ...] = ()  # the agent's wheels it carries, by file name


def bundle_class(config: Config, profile: str | None) -> str | None:
    """The device class a bundle is for: `profile` (one of deploy.yaml's), or, when not given, the
    one profile every device has (None: devices without a profile). Raises ConfigError."""
    if profile is not None:
        if profile not in config.profiles:
            known = ", ".join(sorted(config.profiles)) or "none"
            raise ConfigError(f"deploy.yaml has no profile {profile!r} (profiles: {known})")
        return profile
    classes = sorted({d.profile or "" for d in config.fleet.devices})
    if len(classes) != 1:
        named = ", ".join(c or "(no profile)" for c in classes)
        raise ConfigError(
            f"the fleet's devices are of {len(classes)} device classes ({named}); a bundle is for one",
            hint="name the class with --profile",
        )
    return classes[0] or None


def write_bundle(
    config: Config,
    target: Desired,
    out: Path,
    *,
    device_class: str | None,
    bases: int = 3,
    now: datetime | None = None,
    wheels: Sequence[Path] = (),
) -> BundleResult:
    """Write the bundle of `target` for `device_class` to `out`: a tar file when its name ends in
    .tar, .tar.gz or .tgz, else a directory; with `wheels` (the agent's, for the class's platform)
    under wheels/ beside the requirements.txt that installs them. Raises KeyFileError (no signing
    key), ConfigError (`out` is something else than an earlier bundle), FormatError."""
    releaser = Releaser(config)
    key = releaser.signing_key()  # before any work: a locked key fails fast
    # Above every release of another artifact (a fleet rollback's too): the controller cannot ask
    # an air-gapped device for its counter, so this is what keeps the bundle above it.
    floor = max(
        (e.counter for e in releaser.history() if e.artifact_sha256 != target.artifact_sha256), default=0
    )
    full = releaser.release(target, None, floor=floor)
    patches = [
        (base, releaser.release(target, base, floor=floor))
        for base in _bases(config, releaser, target, bases)
    ]
    is_tar = out.name.endswith(TAR_SUFFIXES)
    _check_replaceable(out, is_tar)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        tree = Path(tmp) / "bundle"
        _copy(full.manifest, tree / FULL_DIR / "release.json")
        for path in sorted(target.artifact_dir.iterdir()):
            if path.is_file():
                _copy(path, tree / FULL_DIR / "artifact" / path.name)
        for base, release in patches:
            assert release.patch is not None  # Releaser makes a patch whenever a base is given
            _copy(release.manifest, tree / PATCH_DIR / base.artifact_sha256 / "release.json")
            _copy(release.patch, tree / PATCH_DIR / base.artifact_sha256 / "delta.patch")
        pins = []
        for wheel in wheels:
            _copy(wheel, tree / WHEELS_DIR / wheel.name)
            name, version, _, _ = parse_wheel_filename(wheel.name)
            pins.append(f"{name}=={version} --hash=sha256:{sha256_file(wheel)}\n")
        if pins:  # pip takes find-links in a requirements file relative to the file
            (tree / REQUIREMENTS).write_text("--find-links .\n" + "".join(sorted(pins)))
        files = {
            p.relative_to(tree).as_posix(): FileHash(sha256=sha256_file(p), size=p.stat().st_size)
            for p in sorted(tree.rglob("*"))
            if p.is_file()
        }
        index = BundleIndex(
            application=config.application,
            device_class=device_class,
            version=target.version,
            artifact_sha256=target.artifact_sha256,
            created=format_time(now or datetime.now(UTC)),
            files=files,
        )
        envelope = add_signature(Envelope(signed=index.model_dump(mode="json"), signatures=[]), key)
        (tree / BUNDLE_INDEX).write_bytes(envelope.to_bytes())
        _place(tree, out, is_tar)
    return BundleResult(
        path=out,
        version=target.version,
        device_class=device_class,
        counter=full.counter,
        patch_bases=tuple(base.version for base, _ in patches),
        bytes=sum(f.size for f in files.values()),
        wheels=tuple(sorted(w.name for w in wheels)),
    )


def _bases(config: Config, releaser: Releaser, target: Desired, count: int) -> list[Desired]:
    """The last `count` artifacts released before (newest first) still in the store."""
    seen: list[str] = []
    for entry in reversed(releaser.history()):
        if entry.artifact_sha256 != target.artifact_sha256 and entry.artifact_sha256 not in seen:
            seen.append(entry.artifact_sha256)
    found = (artifact_in_store(config, sha) for sha in seen)
    return [d for d in found if d is not None][:count]


def _check_replaceable(out: Path, is_tar: bool) -> None:
    """Refuse to overwrite anything but an earlier bundle (a file for a tar, a bundle directory)."""
    if not out.exists():
        return
    if is_tar and out.is_file():
        return
    if not is_tar and out.is_dir() and (out / BUNDLE_INDEX).is_file():
        return
    raise ConfigError(
        f"{out} exists and is not an earlier bundle: not overwriting it",
        hint="name a new path (a directory, or a file ending in .tar or .tar.gz)",
    )


def _copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)


def _place(tree: Path, out: Path, is_tar: bool) -> None:
    """Move the finished tree (or a tar of it) to `out` in one rename: never half a bundle there."""
    staged = tree.with_name("out")
    if is_tar:
        compressed = out.name.endswith((".gz", ".tgz"))
        try:
            with tarfile.open(staged, "w:gz") if compressed else tarfile.open(staged, "w") as tar:
                for path in sorted(tree.rglob("*")):
                    if path.is_file():
                        tar.add(path, arcname=path.relative_to(tree).as_posix(), recursive=False)
        except OSError as exc:
            raise SitsError(f"cannot write {out}: {exc.strerror or exc}") from exc
    else:
        tree.rename(staged)
        if out.exists():
            shutil.rmtree(out)  # an earlier bundle (checked above)
    staged.replace(out)
