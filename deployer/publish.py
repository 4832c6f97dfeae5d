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
timestamp that names files not yet there. Raises KeyFileError, ConfigError, BuildError, TransportError.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from securesystemslib.signer import CryptoSigner, Signer, SSlibKey
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
from deployer.desired import SITS_DIRNAME, Desired, ReleaseFiles, Releaser, artifact_in_store, build_target
from deployer.errors import ConfigError, KeyFileError
from deployer.publish_upload import upload

__all__ = [
    "ChannelTarget",
    "PublishedChannel",
    "SignedChannel",
    "channel_targets",
    "load_signers",
    "publish",
    "sign_channel",
]

ROLES = (Root.type, Targets.type, Snapshot.type, Timestamp.type)
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
    """What `publish` did to one channel."""

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


@dataclass(frozen=True)
class SignedChannel:
    """The metadata versions `sign_channel` wrote; `changed` is False when only the timestamp was."""

    targets_version: int
    timestamp_version: int
    changed: bool


@dataclass(frozen=True)
class _Current:
    """The channel's latest signed metadata on disk (None before its first publish)."""

    root: Metadata[Root] | None
    targets: Metadata[Targets] | None
    snapshot: Metadata[Snapshot] | None
    timestamp: Metadata[Timestamp] | None


def publish(
    config: Config, to: str, *, channels: tuple[str, ...] = (), now: datetime | None = None
) -> list[PublishedChannel]:
    """Build (or reuse) deploy.yaml's target, sign releases and TUF metadata, and upload per channel."""
    settings = config.publish or Publish()
    chosen = _chosen_channels(settings, channels)
    signers = load_signers(config, settings)
    target = build_target(config)
    releaser = Releaser(config)
    results = []
    for name in chosen:
        local = config.base_dir / SITS_DIRNAME / "channels" / name
        current = _read_current(local)
        history = _history(current)
        bases = [
            d
            for sha in history.artifacts
            if sha != target.artifact_sha256 and (d := artifact_in_store(config, sha)) is not None
        ][: settings.patch_bases]
        floor = history.floor(target.artifact_sha256)
        full = releaser.release(target, None, floor=floor)
        patches = [(b, releaser.release(target, b, floor=floor)) for b in bases]
        files = channel_targets(target, full, patches)
        outcome = sign_channel(local, files, signers, settings, config, now=now or datetime.now(UTC))
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
            )
        )
    return results


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
    signers: list[Signer],
    settings: Publish,
    config: Config,
    *,
    now: datetime,
) -> SignedChannel:
    """Write the channel's target files and new metadata under `local`.

    Targets and snapshot get a new version only when the files changed, they passed half their
    validity, or the root was renewed; the timestamp always does.
    """
    now = now.replace(microsecond=0)
    current = _read_current(local)
    root = _root(local, current, signers, settings, now)
    long_lived = now + (config.signing.expires_in if config.signing else timedelta(days=30))
    entries = {f.path: _target_file(f) for f in files}
    old_targets, old_snapshot = current.targets, current.snapshot
    changed = old_targets is None or _fingerprint(old_targets.signed.targets) != _fingerprint(entries)
    renew = old_targets is None or old_targets.signed.expires - now < (long_lived - now) / 2
    if changed or renew or current.root is None or root.signed.version != current.root.signed.version:
        for f in files:
            _place_target(local, f, entries[f.path])
        version = old_targets.signed.version + 1 if old_targets else 1
        targets = Metadata(Targets(version=version, expires=long_lived, targets=entries))
        _write_signed(local / "metadata" / f"{version}.targets.json", targets, signers)
        snap_version = old_snapshot.signed.version + 1 if old_snapshot else 1
        snapshot = Metadata(
            Snapshot(version=snap_version, expires=long_lived, meta={"targets.json": MetaFile(version)})
        )
        _write_signed(local / "metadata" / f"{snap_version}.snapshot.json", snapshot, signers)
    else:
        targets, snapshot = old_targets, old_snapshot
    assert snapshot is not None and targets is not None
    ts_version = current.timestamp.signed.version + 1 if current.timestamp else 1
    timestamp = Metadata(
        Timestamp(
            version=ts_version,
            expires=now + settings.timestamp_expires,
            snapshot_meta=MetaFile(snapshot.signed.version),
        )
    )
    _write_signed(local / "metadata" / "timestamp.json", timestamp, signers)
    return SignedChannel(targets.signed.version, ts_version, changed)


def _root(
    local: Path, current: _Current, signers: list[Signer], settings: Publish, now: datetime
) -> Metadata[Root]:
    """The channel's root: made at first publish, re-signed under a new version before it expires."""
    root = current.root
    keyids = {s.public_key.keyid for s in signers}
    if root is not None and set(root.signed.roles[Root.type].keyids) != keyids:
        raise KeyFileError(
            f"{local}: the channel's root trusts other keys than publish.keys / signing.private_key",
            hint="publish with the channel's keys; key rotation needs a new root signed by the old keys",
        )
    if root is not None and root.signed.expires - now > _ROOT_RENEW:
        return root
    fresh = Root(
        version=root.signed.version + 1 if root else 1,
        expires=now + settings.root_expires,
        consistent_snapshot=True,
    )
    for role in ROLES:
        for signer in signers:
            fresh.add_key(signer.public_key, role)
        fresh.roles[role].threshold = settings.threshold
    metadata = Metadata(fresh)
    _write_signed(local / "metadata" / f"{fresh.version}.root.json", metadata, signers)
    return metadata


def _read_current(local: Path) -> _Current:
    """Load the newest root and the chain timestamp -> snapshot -> targets from `local/metadata`."""
    meta = local / "metadata"
    roots = sorted(int(n) for p in meta.glob("*.root.json") if (n := p.name.split(".")[0]).isdigit())
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
    for signer in signers:
        metadata.sign(signer, append=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(metadata.to_bytes(_SERIALIZER))
    tmp.replace(path)


def load_signers(config: Config, settings: Publish) -> list[Signer]:
    """The TUF signers: `publish.keys`, else `signing.private_key` (passphrase from its env variable)."""
    from deployer.sign import is_encrypted, load_private_key

    signing = config.signing
    paths = list(settings.keys) or ([signing.private_key] if signing and signing.private_key else [])
    if not paths:
        raise KeyFileError(
            "publishing needs a private key: neither publish.keys nor signing.private_key is set",
            hint="make one with `sits-deployer keygen -o keys/release` and name it under signing:",
        )
    if len(paths) < settings.threshold:
        raise ConfigError(
            f"publish.threshold is {settings.threshold} but only {len(paths)} key(s) are named",
            hint="add keys under publish.keys or lower publish.threshold",
        )
    env = signing.passphrase_env if signing else "SITS_SIGNING_PASSPHRASE"
    signers: list[Signer] = []
    for name in paths:
        path = config.resolve(name)
        secret = None
        if is_encrypted(path):
            if env not in os.environ:
                raise KeyFileError(f"{path} is encrypted and ${env} is not set", hint=f"export {env}=...")
            secret = os.environ[env].encode("utf-8")
        key = load_private_key(path, secret)
        signers.append(CryptoSigner(key, SSlibKey.from_crypto(key.public_key())))
    return signers


def _chosen_channels(settings: Publish, wanted: tuple[str, ...]) -> list[str]:
    names = [c.name for c in settings.channels]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown channel(s) {', '.join(unknown)}; deploy.yaml publishes {', '.join(names)}",
            hint="add them under publish.channels or fix --channel",
        )
    return list(wanted) or names
