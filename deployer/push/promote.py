"""Ring advancement in pull mode: publish a ring's release to the next ring only once every device of
the ring runs it and is ready.

    ring_devices   the inventory devices that poll a channel (the first channel whose selector their
                   labels match, as provisioning assigns them: deployer.push.pull_files)
    check_ring     per device, over the fleet transport (deployer.push.facts): reachable, running the
                   channel's artifact, and serving it (ready)
    promote        check the source ring, then publish the artifact it runs to the next channel in
                   publish.channels (or the one named); refuse with a per-device report otherwise

Every promotion, refused or done, is a line in the audit log (.sits/audit.jsonl).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from deployer.config.models import Config, Device, Publish
from deployer.errors import ConfigError, SitsError
from deployer.pull.publish import PublishedChannel, publish, published_artifact
from deployer.push.pull_files import channel_of
from deployer.push.state import append_audit
from deployer.release.desired import SITS_DIRNAME, Desired

__all__ = ["Promotion", "RingDevice", "check_ring", "next_channel", "promote", "ring_devices"]


@dataclass(frozen=True)
class RingDevice:
    """One device of the ring being checked. `problem` is empty when it converged healthy."""

    device: str
    version: str | None
    health: str  # ready | not ready | offline
    problem: str

    @property
    def converged(self) -> bool:
        """Runs the ring's artifact and serves it."""
        return not self.problem


@dataclass(frozen=True)
class Promotion:
    """A done promotion: the ring that was checked and what was published to the next channel."""

    source: str
    channel: str
    version: str
    ring: tuple[RingDevice, ...]
    published: PublishedChannel


def next_channel(settings: Publish, source: str) -> str:
    """The channel after `source` in publish.channels (the ring order). Raises ConfigError."""
    names = [c.name for c in settings.channels]
    if source not in names:
        raise ConfigError(
            f"unknown channel {source}; deploy.yaml publishes {', '.join(names)}",
            hint="name one of publish.channels with --from",
        )
    index = names.index(source)
    if index + 1 == len(names):
        raise ConfigError(
            f"{source} is the last channel in publish.channels: there is no next ring to promote to",
            hint="name the target with --channel",
        )
    return names[index + 1]


def ring_devices(config: Config, channel: str) -> tuple[Device, ...]:
    """The inventory devices that poll `channel`."""
    return tuple(d for d in config.fleet.devices if (c := channel_of(config, d)) and c.name == channel)


def check_ring(
    config: Config, devices: tuple[Device, ...], artifact: Desired, *, parallel: int
) -> list[RingDevice]:
    """Each device's version and readiness, read over its transport, against `artifact`."""
    from deployer.push.fleet import FleetSession

    fleet = FleetSession(config, devices, parallel)
    try:
        facts = fleet.facts()
    finally:
        fleet.close()
    rows = []
    for f in facts:
        if not f.reachable:
            rows.append(RingDevice(f.name, None, "offline", f"offline: {f.error or 'unreachable'}"))
            continue
        health = "ready" if f.ready else "not ready"
        if f.model_sha256 != artifact.artifact_sha256:
            problem = f"runs {f.model_version or 'nothing'}, not {artifact.version} ({health})"
        elif not f.ready:
            problem = f"installed {artifact.version} but does not serve it (not ready)"
        else:
            problem = ""
        rows.append(RingDevice(f.name, f.model_version, health, problem))
    return rows


def promote(
    config: Config,
    source: str,
    to: str,
    *,
    channel: str | None = None,
    parallel: int = 4,
    old_root_keys: tuple[Path, ...] = (),
    now: datetime | None = None,
) -> Promotion:
    """Publish the artifact channel `source` publishes to `channel` (default: the next ring) at `to`,
    after checking that every device polling `source` runs it and is ready. Raises SitsError with a
    line per device that has not converged healthy (nothing is published then)."""
    if config.publish is None:
        raise ConfigError("deploy.yaml has no publish section", hint="see docs/pull-mode.md")
    target = channel or next_channel(config.publish, source)
    if target == source:
        raise ConfigError(f"cannot promote {source} to itself", hint="name another channel with --channel")
    artifact = published_artifact(config, source)
    devices = ring_devices(config, source)
    if not devices:
        raise SitsError(
            f"no device in the inventory polls {source}, so its health cannot be checked",
            hint="label the ring's devices to match its publish.channels selector",
        )
    ring = check_ring(config, devices, artifact, parallel=parallel)
    record: dict[str, object] = {
        "action": "promote",
        "from": source,
        "channel": target,
        "version": artifact.version,
    }
    record["ring"] = [{**asdict(r), "converged": r.converged} for r in ring]
    sits_dir = config.base_dir / SITS_DIRNAME
    behind = [r for r in ring if not r.converged]
    if behind:
        append_audit(sits_dir, {**record, "status": "refused"})
        lines = "\n".join(f"  {r.device}: {r.problem}" for r in behind)
        raise SitsError(
            f"not promoting {artifact.version} from {source} to {target}: {len(behind)} of {len(ring)} "
            f"device(s) have not converged healthy:\n{lines}",
            hint=f"let {source}'s devices poll (systemctl start sits-poll.service triggers one), check "
            "`sits-deployer status`, then promote again",
        )
    (published,) = publish(
        config, to, channels=(target,), target=artifact, old_root_keys=old_root_keys, now=now
    )
    append_audit(sits_dir, {**record, "status": "published", "counter": published.counter})
    return Promotion(source, target, artifact.version, tuple(ring), published)
