"""The fleet's life around apply: stopping agents and collecting the controller's store.

stop_fleet     stop every selected device's agent (systemd unit, or the background process)
collect_store  delete controller artifacts and patches no device runs and no recent release names
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deployer.build.store import STORE_DIRNAME, Store
from deployer.config.models import Config
from deployer.push.bootstrap import stop_agent
from deployer.push.facts import DeviceSite, gather_facts
from deployer.push.fleet import FleetSession
from deployer.release.desired import Releaser, built_target
from deployer.transport import run_bounded

__all__ = ["StopResult", "collect_store", "stop_fleet"]

STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class StopResult:
    """What `down` did on one device."""

    device: str
    status: str  # stopped | offline | failed
    detail: str = ""


def stop_fleet(fleet: FleetSession) -> list[StopResult]:
    """Stop the agent of every selected device (and its poll timer under systemd). Idempotent."""

    def stop(site: DeviceSite) -> StopResult:
        transport = fleet.transport(site)
        facts = gather_facts(site, transport)
        if not facts.reachable:
            return StopResult(site.name, "offline", facts.error or "unreachable")
        if facts.systemd:
            done = transport.run(
                "systemctl stop sits-poll.timer sits-agent.service 2>/dev/null; "
                "systemctl disable sits-agent.service >/dev/null 2>&1; true",
                timeout=STOP_TIMEOUT_S,
            )
            if not done.ok:
                return StopResult(site.name, "failed", done.stderr.strip()[-200:])
            return StopResult(site.name, "stopped", "systemd unit")
        stop_agent(site, transport)
        return StopResult(site.name, "stopped", "background agent")

    outcomes = run_bounded(list(fleet.sites.values()), stop, parallel=fleet.parallel)
    return [
        o.result if o.result is not None else StopResult(o.item.name, "failed", str(o.error))
        for o in outcomes
    ]


def collect_store(config: Config, running: Sequence[str], keep: int) -> list[Path]:
    """Delete artifacts (and the patches made from or to them) that no device runs, that are not
    what deploy.yaml names now, and that are not among the last `keep` released versions.

    `running` holds the artifact sha256 of every device; a device that could not be read makes
    the caller refuse instead (its artifact would be unknown). Returns the paths removed.
    """
    store, releaser = Store(config.base_dir / STORE_DIRNAME), Releaser(config)
    kept = set(running)
    versions: list[str] = []
    for entry in reversed(releaser.history()):  # newest first
        if entry.version not in versions:
            versions.append(entry.version)
        if entry.version in versions[:keep]:
            kept.add(entry.artifact_sha256)
    target = built_target(config)
    if target is not None:
        kept.add(target.artifact_sha256)
    removed: list[Path] = []
    if store.artifacts.is_dir():
        for directory in sorted(store.artifacts.iterdir()):
            if directory.name not in kept:
                shutil.rmtree(directory)
                removed.append(directory)
    if releaser.patches_dir.is_dir():
        prefixes = {sha[:16] for sha in kept}
        for patch in sorted(releaser.patches_dir.glob("*.patch")):
            base, _, to = patch.stem.partition("-")
            if base not in prefixes or to not in prefixes:
                patch.unlink()
                removed.append(patch)
    return removed
