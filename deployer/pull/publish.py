"""Pull mode, controller side: signed releases published as TUF channels on static HTTP or S3.

One channel per ring (deploy.yaml `publish.channels`), kept locally under `.sits/channels/<name>/`
and copied to the destination (`DIR/<name>/` or `s3://bucket/prefix/<name>/`)::

    metadata/1.root.json             trust anchor (devices are provisioned with it), rotated by version
    metadata/<n>.targets.json        the files of the release, by path, with sha256 and length
    metadata/<n>.snapshot.json       binds the targets version (no mixing of two releases' files)
    metadata/timestamp.json          the only short-lived, mutable file: names the snapshot version
    targets/<dir>/<sha256>.<name>    content-addressed (consistent snapshots): cache forever

Target paths, each the signed release manifest plus its payload::

    full/release.json, full/artifact/<file>             the whole artifact
    patch/<base sha256>/release.json, .../delta.patch   a patch from each recent base

The channel's own history picks the patch bases (the artifacts it published before), and its
highest counter is the floor for new releases, so a fleet rollback is a release with a higher counter.
Files reach the destination targets first and timestamp.json last, so a poller never sees a
timestamp that names files not yet there.

Keys per role (deployer.pull.role_keys): each role is signed only when it must change, so routine
re-signing of the timestamp needs only the online keys. When deploy.yaml's role keys or thresholds
differ from the channel's root, the root is rotated: `<n+1>.root.json` lists the new keys and is
signed by a threshold of the old root's keys and of the new ones, which lets devices that trust
root n follow the chain. Raises KeyFileError, ConfigError, BuildError, TransportError.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from securesystemslib.signer import Signer
from tuf.api.exceptions import UnsignedMetadataError
from tuf.api.metadata import (
    Metadata,
    MetaFile,
    Root,
    Snapshot,
    TargetFile,
    Targets,
    Timestamp,
)
from tuf.api.serialization.json import JSONSerializer

from deployer.config.models import Config, Publish
from deployer.core.fsutil import atomic_write
from deployer.errors import ConfigError, KeyFileError, SitsError
from deployer.pull.role_keys import ROLES, KeyRing
from deployer.pull.upload import upload
from deployer.release.desired import (
    SITS_DIRNAME,
    Desired,
    ReleaseFiles,
    Releaser,
    artifact_in_store,
    build_target,
)

__all__ = [
    "ChannelTarget",
    "PublishedChannel",
    "SignedChannel",
    "channel_dir",
    "channel_root",
    "channel_targets",
    "publish",
    "published_artifact",
    "sign_channel",
]

FULL_RELEASE = "full/release.json"
# A root is re-signed under a new version once it has less than this left.
_ROOT_RENEW = timedelta(days=30)
_SERIALIZER = JSONSerializer(compact=False)


@dataclass(frozen=True)
class ChannelTarget:
    """One file of a channel: its TUF target path, where it is locally, and signed hints for pollers."""

    path: str
    source: Path
    custom: dict


@dataclass(frozen=True)
class PublishedChannel:
    """What `publish` did to one channel. `root_change` is "created", "renewed" or "rotated" when the
    channel's root got a new version; `warnings` name roles left unrenewed for want of offline keys."""

    channel: str
    version: str
    counter: int
    artifact_sha256: str
    patch_bases: tuple[str, ...]
    targets_version: int
    timestamp_version: int
    changed: bool
    local_dir: Path
    destination: str
    uploaded: int
    root_version: int
    root_change: str | None
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class SignedChannel:
    """The metadata versions `sign_channel` wrote; `changed` is False when the release files were not."""

    targets_version: int
    timestamp_version: int
    changed: bool
    root_version: int
    root_change: str | None
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class _Current:
    """The channel's latest signed metadata on disk (None before its first publish)."""

    root: Metadata[Root] | None
    targets: Metadata[Targets] | None
    snapshot: Metadata[Snapshot] | None
    timestamp: Metadata[Timestamp] | None


def channel_dir(config: Config, name: str) -> Path:
    """Where the controller keeps channel `name` (what `publish` copies to its destination)."""
    return config.base_dir / SITS_DIRNAME / "channels" / name


def publish(
    config: Config,
    to: str,
    *,
    channels: tuple[str, ...] = (),
    target: Desired | None = None,
    old_root_keys: tuple[Path, ...] = (),
    now: datetime | None = None,
) -> list[PublishedChannel]:
    """Sign releases of `target` (default: build deploy.yaml's model) and TUF metadata, and upload
    each chosen channel (default: all). `old_root_keys` are private keys of the channels' current
    root, needed when deploy.yaml's role keys changed and the root rotates."""
    settings = config.publish or Publish()
    chosen = _chosen_channels(settings, channels)
    keys = KeyRing(config, settings, old_root_keys)
    target = target or build_target(config)
    releaser = Releaser(config)
    results = []
    for name in chosen:
        local = channel_dir(config, name)
        history = _history(_read_current(local))
        bases = [
            d
            for sha in history.artifacts
            if sha != target.artifact_sha256 and (d := artifact_in_store(config, sha)) is not None
        ][: settings.patch_bases]
        floor = history.floor(target.artifact_sha256)
        full = releaser.release(target, None, floor=floor)
        patches = [(b, releaser.release(target, b, floor=floor)) for b in bases]
        files = channel_targets(target, full, patches)
        outcome = sign_channel(local, files, keys, settings, config, now=now or datetime.now(UTC))
        destination = f"{to.rstrip('/')}/{name}"
        uploaded = upload(local, destination)
        results.append(
            PublishedChannel(
                channel=name,
                version=target.version,
                counter=full.counter,
                artifact_sha256=target.artifact_sha256,
                patch_bases=tuple(b.version for b in bases),
                targets_version=outcome.targets_version,
                timestamp_version=outcome.timestamp_version,
                changed=outcome.changed,
                local_dir=local,
                destination=destination,
                uploaded=uploaded,
                root_version=outcome.root_version,
                root_change=outcome.root_change,
                warnings=outcome.warnings,
            )
        )
    return results


def published_artifact(config: Config, name: str) -> Desired:
    """The artifact channel `name` publishes now, from this controller's store. Raises SitsError
    when the channel was never published here or the store no longer has its artifact."""
    targets = _read_current(channel_dir(config, name)).targets
    full = targets.signed.targets.get(FULL_RELEASE) if targets else None
    if full is None:
        raise SitsError(
            f"channel {name} was never published from this project",
            hint=f"run `sits-deployer publish --channel {name} --to ...` first",
        )
    sha = str((full.unrecognized_fields.get("custom") or {}).get("artifact_sha256", ""))
    found = artifact_in_store(config, sha)
    if found is None:
        raise SitsError(
            f"channel {name} publishes artifact {sha[:12]}, which this project's store no longer has",
            hint="publish the channel again from the deploy.yaml that built it",
        )
    return found


def channel_root(config: Config, name: str) -> bytes:
    """The newest root metadata of channel `name`: the trust anchor devices are provisioned with.
    Raises ConfigError when the channel was never published here."""
    meta = channel_dir(config, name) / "metadata"
    versions = _root_versions(meta)
    if not versions:
        raise ConfigError(
            f"channel {name} has no root metadata yet ({meta}), so devices cannot be provisioned to poll it",
            hint=f"run `sits-deployer publish --channel {name} --to ...` first, then plan/apply",
        )
    return (meta / f"{versions[-1]}.root.json").read_bytes()


def channel_targets(
    target: Desired, full: ReleaseFiles, patches: list[tuple[Desired, ReleaseFiles]]
) -> list[ChannelTarget]:
    """The channel's files: the full release and artifact, and each patch release from a base."""
    hint = {"version": target.version, "artifact_sha256": target.artifact_sha256, "counter": full.counter}
    files = [ChannelTarget(FULL_RELEASE, full.manifest, hint)]
    for path in sorted(target.artifact_dir.iterdir()):
        if path.is_file():
            files.append(ChannelTarget(f"full/artifact/{path.name}", path, {}))
    for base, release in patches:
        assert release.patch is not None  # Releaser makes a patch whenever a base is given
        base_hint = {**hint, "counter": release.counter, "base_version": base.version}
        files.append(ChannelTarget(f"patch/{base.artifact_sha256}/release.json", release.manifest, base_hint))
        files.append(ChannelTarget(f"patch/{base.artifact_sha256}/delta.patch", release.patch, {}))
    return files


@dataclass(frozen=True)
class _History:
    artifacts: tuple[str, ...]  # newest first
    counters: dict[str, int]  # artifact id -> highest counter the channel published for it

    def floor(self, artifact_sha256: str) -> int:
        """The counter a release of this artifact must exceed: the highest of any OTHER artifact the
        channel served. Re-publishing the same artifact reuses its release; going back to an older
        one (a fleet rollback) gets a new, higher counter."""
        return max((c for sha, c in self.counters.items() if sha != artifact_sha256), default=0)


def _history(current: _Current) -> _History:
    """Artifacts this channel published before (newest first) and their highest release counters."""
    if current.targets is None:
        return _History((), {})
    shas: list[str] = []
    counters: dict[str, int] = {}
    full = current.targets.signed.targets.get(FULL_RELEASE)
    for info in ([full] if full else []) + list(current.targets.signed.targets.values()):
        custom = info.unrecognized_fields.get("custom") or {}
        if "counter" in custom:
            sha = str(custom["artifact_sha256"])
            counters[sha] = max(counters.get(sha, 0), int(custom["counter"]))
        if info.path == FULL_RELEASE and custom.get("artifact_sha256") not in shas:
            shas.append(custom["artifact_sha256"])
        elif info.path.startswith("patch/") and info.path.endswith("/release.json"):
            base = info.path.split("/")[1]
            if base not in shas:
                shas.append(base)
    return _History(tuple(shas), counters)


def sign_channel(
    local: Path,
    files: list[ChannelTarget],
    keys: KeyRing,
    settings: Publish,
    config: Config,
    *,
    now: datetime,
) -> SignedChannel:
    """Write the channel's target files and new metadata under `local`.

    Each role gets a new version only when it must (new files, a rotated root that no longer
    accepts its signatures, its parent changed) or when it passed half its validity; the timestamp
    always does. A renewal that lacks offline keys is skipped with a warning; anything else raises.
    """
    now = now.replace(microsecond=0)
    warnings: list[str] = []
    current = _read_current(local)
    root, root_change = _root(local, current, keys, settings, now, warnings)
    long_lived = now + (config.signing.expires_in if config.signing else timedelta(days=30))
    entries = {f.path: _target_file(f) for f in files}
    old_targets, old_snapshot = current.targets, current.snapshot
    changed = old_targets is None or _fingerprint(old_targets.signed.targets) != _fingerprint(entries)

    targets = old_targets
    must = changed or not _valid(root, Targets.type, old_targets)
    signers = _signers_if(keys, Targets.type, must, _due(old_targets, now, long_lived), old_targets, warnings)
    if signers:
        for f in files:
            _place_target(local, f, entries[f.path])
        version = old_targets.signed.version + 1 if old_targets else 1
        targets = Metadata(Targets(version=version, expires=long_lived, targets=entries))
        _write_signed(local / "metadata" / f"{version}.targets.json", targets, signers)

    snapshot = old_snapshot
    must = targets is not old_targets or not _valid(root, Snapshot.type, old_snapshot)
    signers = _signers_if(
        keys, Snapshot.type, must, _due(old_snapshot, now, long_lived), old_snapshot, warnings
    )
    if signers:
        assert targets is not None
        version = old_snapshot.signed.version + 1 if old_snapshot else 1
        meta = {"targets.json": MetaFile(targets.signed.version)}
        snapshot = Metadata(Snapshot(version=version, expires=long_lived, meta=meta))
        _write_signed(local / "metadata" / f"{version}.snapshot.json", snapshot, signers)

    assert snapshot is not None and targets is not None
    ts_version = current.timestamp.signed.version + 1 if current.timestamp else 1
    timestamp = Metadata(
        Timestamp(
            version=ts_version,
            expires=now + settings.timestamp_expires,
            snapshot_meta=MetaFile(snapshot.signed.version),
        )
    )
    _write_signed(local / "metadata" / "timestamp.json", timestamp, keys.signers(Timestamp.type))
    return SignedChannel(
        targets.signed.version, ts_version, changed, root.signed.version, root_change, tuple(warnings)
    )


def _root(
    local: Path, current: _Current, keys: KeyRing, settings: Publish, now: datetime, warnings: list[str]
) -> tuple[Metadata[Root], str | None]:
    """The channel's root and what happened to it: made at first publish ("created"), a new version
    listing deploy.yaml's role keys when they differ ("rotated"), or re-signed before it expires
    ("renewed"); None when it stays."""
    root = current.root
    if root is None:
        change = "created"
    elif not _same_roles(root.signed, keys):
        change = "rotated"
    elif root.signed.expires - now <= _ROOT_RENEW:
        change = "renewed"
    else:
        return root, None
    signers = _signers_if(keys, Root.type, change != "renewed", True, root, warnings)
    if not signers:
        assert root is not None  # only a renewal is optional
        return root, None
    if root is not None:
        old = root.signed.roles[Root.type]
        signers += keys.signers_among(
            old.keyids,
            old.threshold,
            f"{change} root v{root.signed.version + 1} of {local.name}: the old root",
        )
    fresh = Root(
        version=root.signed.version + 1 if root else 1,
        expires=now + settings.root_expires,
        consistent_snapshot=True,
    )
    for role in ROLES:
        spec = keys.spec(role)
        for key in spec.keys:
            fresh.add_key(key.public, role)
        fresh.roles[role].threshold = spec.threshold
    metadata = Metadata(fresh)
    _write_signed(local / "metadata" / f"{fresh.version}.root.json", metadata, signers)
    return metadata, change


def _same_roles(root: Root, keys: KeyRing) -> bool:
    """Whether `root` lists exactly deploy.yaml's keys and thresholds for every role."""
    return all(
        set(root.roles[role].keyids) == keys.spec(role).keyids
        and root.roles[role].threshold == keys.spec(role).threshold
        for role in ROLES
    )


def _valid(root: Metadata[Root], role: str, metadata: Metadata | None) -> bool:
    """Whether `metadata` (of a top-level `role`) carries enough signatures of the keys `root` lists."""
    if metadata is None:
        return False
    try:
        root.verify_delegate(role, metadata)
    except UnsignedMetadataError:
        return False
    return True


def _due(metadata: Metadata | None, now: datetime, expires: datetime) -> bool:
    """Whether `metadata` passed half the validity a new version would get."""
    return metadata is None or metadata.signed.expires - now < (expires - now) / 2


def _signers_if(
    keys: KeyRing, role: str, must: bool, due: bool, current: Metadata | None, warnings: list[str]
) -> list[Signer]:
    """The role's signers when it must be re-signed, or is due and its keys are here; else []
    (with a warning for a renewal that lacks offline keys)."""
    if not must and not due:
        return []
    try:
        return keys.signers(role)
    except KeyFileError as exc:
        if must or current is None:
            raise
        warnings.append(
            f"{role} v{current.signed.version} expires {current.signed.expires:%Y-%m-%d} and was not "
            f"renewed: {exc.message}"
        )
        return []


def _root_versions(meta: Path) -> list[int]:
    return sorted(int(n) for p in meta.glob("*.root.json") if (n := p.name.split(".")[0]).isdigit())


def _read_current(local: Path) -> _Current:
    """Load the newest root and the chain timestamp -> snapshot -> targets from `local/metadata`."""
    meta = local / "metadata"
    roots = _root_versions(meta)
    if not roots:
        return _Current(None, None, None, None)
    root = Metadata[Root].from_file(str(meta / f"{roots[-1]}.root.json"))
    ts_path = meta / "timestamp.json"
    if not ts_path.is_file():
        return _Current(root, None, None, None)
    timestamp = Metadata[Timestamp].from_file(str(ts_path))
    snapshot = Metadata[Snapshot].from_file(
        str(meta / f"{timestamp.signed.snapshot_meta.version}.snapshot.json")
    )
    targets_version = snapshot.signed.meta["targets.json"].version
    targets = Metadata[Targets].from_file(str(meta / f"{targets_version}.targets.json"))
    return _Current(root, targets, snapshot, timestamp)


def _target_file(item: ChannelTarget) -> TargetFile:
    info = TargetFile.from_file(item.path, str(item.source), ["sha256"])
    if item.custom:
        info.unrecognized_fields["custom"] = dict(item.custom)
    return info


def _fingerprint(targets: dict[str, TargetFile]) -> dict[str, tuple[str, int]]:
    return {path: (info.hashes["sha256"], info.length) for path, info in targets.items()}


def _place_target(local: Path, item: ChannelTarget, info: TargetFile) -> None:
    """Put the file at its content-addressed name (a hard link when possible: artifacts are big)."""
    directory, _, name = item.path.rpartition("/")
    dest = local / "targets" / directory / f"{info.hashes['sha256']}.{name}"
    if dest.is_file() and dest.stat().st_size == info.length:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(item.source, tmp)
    except OSError:
        shutil.copyfile(item.source, tmp)
    tmp.replace(dest)


def _write_signed(path: Path, metadata: Metadata, signers: list[Signer]) -> None:
    metadata.signatures.clear()
    for signer in {s.public_key.keyid: s for s in signers}.values():  # once per key
        metadata.sign(signer, append=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, metadata.to_bytes(_SERIALIZER))


def _chosen_channels(settings: Publish, wanted: tuple[str, ...]) -> list[str]:
    names = [c.name for c in settings.channels]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown channel(s) {', '.join(unknown)}; deploy.yaml publishes {', '.join(names)}",
            hint="add them under publish.channels or fix --channel",
        )
    return list(wanted) or names
