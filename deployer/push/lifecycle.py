"""The fleet's life around apply: what plan sees before a build, stopping agents, following logs,
and collecting the controller's store.

    built_target   the artifact deploy.yaml names if it was built before (never builds)
    pending_plan   the plan while that artifact is not built yet: every reachable device has a
                   pending change ("1.2.0 not built: run `sits-deployer build`")
    stop_fleet     stop every selected device's agent (systemd unit, or the background process)
    follow         run a command on a device and copy its output as it comes (logs --follow)
    collect_store  delete controller artifacts and patches no device runs and no recent release names
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deployer.build.store import Store
from deployer.config.models import Config
from deployer.core.hashing import sha256_bytes
from deployer.errors import SitsError
from deployer.push.bootstrap import desired_files, stop_agent
from deployer.push.facts import DeviceSite, controller_agent_version, gather_facts
from deployer.push.fleet import Fleet
from deployer.push.plan import (
    DesiredState,
    DevicePlan,
    DeviceStatus,
    Plan,
    StepKind,
    facts_digest,
    plan_device,
)
from deployer.release.desired import SITS_DIRNAME, Desired, Releaser
from deployer.transport import LocalTransport, Transport, run_bounded

__all__ = [
    "StopResult",
    "built_target",
    "collect_store",
    "follow",
    "not_built_reason",
    "pending_plan",
    "stop_fleet",
]

STORE_DIRNAME = "store"
_WITHOUT_ARTIFACT = frozenset({StepKind.BOOTSTRAP, StepKind.WRITE_UNITS})


def built_target(config: Config) -> Desired | None:
    """The artifact deploy.yaml names when it is in the store already; None when it is not built.

    Hashes the source model and looks its inputs up; quantizes nothing and writes nothing.
    """
    from deployer.build.pipeline import find_built
    from deployer.build.request import request_from_config

    found = find_built(request_from_config(config))
    return None if found is None else Desired(config.model.version, found.artifact_id, found.artifact_dir)


def not_built_reason(config: Config) -> str:
    """What plan says of a device while the target artifact is not built."""
    return f"{config.model.version} not built: run `sits-deployer build`"


def pending_plan(fleet: Fleet) -> Plan:
    """The plan while the artifact is not built: offline and refused devices as they are, every
    other device a pending change with the steps known without the artifact (bootstrap, units);
    the model's steps are known once it is built."""
    facts = fleet.facts()
    config = fleet.config
    version, reason = config.model.version, not_built_reason(config)
    devices = []
    for f in facts:
        if f.refused or not f.reachable:
            status = DeviceStatus.BLOCKED if f.refused else DeviceStatus.OFFLINE
            why = f.error or ("refused" if f.refused else "unreachable")
            devices.append(DevicePlan(f.name, status, why, f.model_version, version))
            continue
        files = desired_files(config, fleet.sites[f.name], systemd=f.systemd)
        units = {path: sha256_bytes(data) for path, data in files.items()}
        known = plan_device(DesiredState(version, "", 0, controller_agent_version(), units), f)
        steps = tuple(s for s in known.steps if s.kind in _WITHOUT_ARTIFACT)
        devices.append(DevicePlan(f.name, DeviceStatus.CHANGE, reason, f.model_version, version, steps))
    return Plan(version, "", tuple(devices), facts_digest(facts))


@dataclass(frozen=True)
class StopResult:
    """What `down` did on one device."""

    device: str
    status: str  # stopped | offline | failed
    detail: str = ""


def stop_fleet(fleet: Fleet) -> list[StopResult]:
    """Stop the agent of every selected device (and its poll timer under systemd). Idempotent."""

    def stop(site: DeviceSite) -> StopResult:
        facts = gather_facts(site, fleet.transport(site))
        if not facts.reachable:
            return StopResult(site.name, "offline", facts.error or "unreachable")
        transport = fleet.transport(site)
        if facts.systemd:
            done = transport.run(
                "systemctl stop sits-poll.timer sits-agent.service 2>/dev/null; "
                "systemctl disable sits-agent.service >/dev/null 2>&1; true",
                timeout=120,
            )
            if not done.ok:
                return StopResult(site.name, "failed", done.stderr.strip()[-200:])
        else:
            stop_agent(site, transport)
        return StopResult(site.name, "stopped", "systemd unit" if facts.systemd else "background agent")

    outcomes = run_bounded(list(fleet.sites.values()), stop, parallel=fleet.parallel)
    return [
        o.result if o.result is not None else StopResult(o.item.name, "failed", str(o.error))
        for o in outcomes
    ]


def follow(transport: Transport, command: str, write: Callable[[str], None]) -> int:
    """Run `command` on the device and pass its output to `write` as it arrives; return its exit
    status. Ctrl-C ends it (KeyboardInterrupt propagates after the remote command is stopped)."""
    if isinstance(transport, LocalTransport):
        with subprocess.Popen(
            ["/bin/sh", "-c", command],
            cwd=transport.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        ) as proc:
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    write(line)
                return proc.wait()
            finally:
                proc.kill()
    from deployer.transport.ssh import SshTransport

    if not isinstance(transport, SshTransport):
        raise SitsError(f"{transport.label}: this transport cannot stream output")
    channel = transport._open_channel()  # a plain session: the transport has no streaming verb
    try:
        channel.set_combine_stderr(True)
        channel.exec_command(command)
        while True:
            data = channel.recv(65536)
            if not data:
                break
            write(data.decode("utf-8", errors="replace"))
        return channel.recv_exit_status()
    finally:
        channel.close()


def collect_store(config: Config, running: Sequence[str], keep: int) -> list[Path]:
    """Delete artifacts (and the patches made from or to them) that no device runs, that are not
    what deploy.yaml names now, and that are not among the last `keep` released versions.

    `running` holds the artifact sha256 of every device; a device that could not be read makes
    the caller refuse instead (its artifact would be unknown). Returns the paths removed.
    """
    sits = config.base_dir / SITS_DIRNAME
    store = Store(sits / STORE_DIRNAME)
    kept = set(running)
    versions: list[str] = []
    for entry in reversed(Releaser(config).history()):  # newest first
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
    patches = sits / "patches"
    if patches.is_dir():
        prefixes = {sha[:16] for sha in kept}
        for patch in sorted(patches.glob("*.patch")):
            base, _, to = patch.stem.partition("-")
            if base not in prefixes or to not in prefixes:
                patch.unlink()
                removed.append(patch)
    return removed
