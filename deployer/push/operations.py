"""The actions of each plan step on a device: what `plan -v` prints and `apply` runs.

In pyinfra's terms these are the operations: they read facts and yield commands, as data. The
recipe is pure; everything it needs (the files deploy.yaml renders for each device, the patch for
each base, the artifact's files) is gathered by `deployer.push.fleet` before planning.

    write-units     put each managed file that differs, remove those deploy.yaml no longer asks for
                    (a secret whose section is gone); systemd devices: the service user, and
                    daemon-reload when a unit changed; restart a running agent that serves a model
    send-patch      put the signed release manifest and the patch into incoming/<counter>/
    send-artifact   put the manifest and every artifact file
    send-manifest   put the manifest only: the device keeps the artifact (a pointer switch)
    send-adapter(-patch)  put an adapter's signed release and its artifact (or patch) into
                    incoming/adapters/<name>/
    install-adapter run `sits-agent adapter install` (verify, hot-load, smoke, roll back alone)
    install         run `sits-agent install` (as the service user where the units are installed)
                    with the patch, the uploaded artifact, or the version the device keeps
    reload          call ensure-serving: start the agent, or have it reload onto the new version
    health-gate     call health-gate: ready on the version, smoke prompts within the budget
    *-hook          run deploy.yaml's hook for the phase, on the controller
    build           none: the artifact is not built, so the plan cannot be executed

The named operations (`CALLS`) are the executor's; their requests are the agent's HTTP API or the
bootstrap of the agent itself (deployer.push.bootstrap), whose commands depend on what the device
answers while they run.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from deployer.config.models import Config
from deployer.core.hashing import sha256_bytes
from deployer.push.bootstrap import INCOMING, STORE_DIR, store_command
from deployer.push.facts import DeviceSite
from deployer.push.plan import (
    ADAPTER_RELEASE,
    GENERATED,
    RELEASE_COUNTER,
    RELEASE_MANIFEST,
    Action,
    ActionKind,
    DesiredState,
    DeviceFacts,
    Step,
    StepKind,
    send_kind,
    stale_files,
)

__all__ = ["CALLS", "DeviceRecipe", "adapter_dir", "release_dir"]

# The executor's named operations, and what each does.
CALLS = {
    "install-agent": "create the agent's venv if needed and pip-install this controller's wheel",
    "prepare-service-user": "create the units' system user and give it the store",
    "restart-if-running": "restart the agent when it runs, so it reads the new files",
    "ensure-serving": "start the agent, or reload it, until it serves the version",
    "health-gate": "ready on the version, then every smoke prompt within the latency budget",
}
INSTALL_TIMEOUT_S = 900.0
VERSIONS_DIR = f"{STORE_DIR}/versions"  # the versions the agent verified (deployer.agent.ota.store)
DAEMON_RELOAD_TIMEOUT_S = 60.0
REMOVE_TIMEOUT_S = 30.0


def adapter_dir(name: str) -> str:
    """The device folder an adapter's release and payload are uploaded to."""
    return f"{INCOMING}/adapters/{name}"


def release_dir() -> str:
    """The device folder a release is uploaded to (named by its counter, filled in at apply)."""
    return f"{INCOMING}/{RELEASE_COUNTER}"


@dataclass(frozen=True)
class DeviceRecipe:
    """Writes every step's actions from data gathered before planning (see the module docstring).

    `files` holds, per device, the content of every file the controller manages there;
    `patches` the controller path of the patch from each base artifact sha256 to the target;
    `artifact_files` the target artifact's files (controller path, size), in upload order (none
    while it is not built: no step sends them then). For adapters: `adapter_files` the files of
    each target adapter artifact by its id, `adapter_patches` the patch by (from id, to id).
    """

    config: Config
    sites: Mapping[str, DeviceSite]
    files: Mapping[str, Mapping[str, bytes]]
    patches: Mapping[str, Path]
    artifact_files: tuple[tuple[Path, int], ...]
    adapter_files: Mapping[str, tuple[tuple[Path, int], ...]] = field(default_factory=dict)
    adapter_patches: Mapping[tuple[str, str], Path] = field(default_factory=dict)

    def adapter_actions(self, step: Step, facts: DeviceFacts, desired: DesiredState) -> tuple[Action, ...]:
        """An adapter's steps: its signed release and payload into incoming/adapters/<name>/ (emptied
        first, so no file of an earlier upload stays), then `sits-agent adapter install`, which
        verifies, hot-loads and smoke-tests it and rolls it back alone when that fails."""
        if step.kind is StepKind.BUILD:
            return ()
        site = self.sites[facts.name]
        target = next(t for t in desired.adapters if t.name == step.adapter)
        folder = adapter_dir(step.adapter)
        have = facts.adapters.get(step.adapter)
        patch = self.adapter_patches.get((have.artifact_sha256, target.artifact_sha256)) if have else None
        if step.kind is StepKind.INSTALL_ADAPTER:
            payload = ("--patch", f"{folder}/update.patch") if patch else ("--artifact", f"{folder}/artifact")
            argv = site.agent(
                "adapter",
                "install",
                "--manifest",
                site.path(f"{folder}/release.json"),
                payload[0],
                site.path(payload[1]),
            )
            what = f"{site.name}: sits-agent adapter install {target.name} {target.version}"
            return (
                Action(ActionKind.RUN, store_command(site, argv), timeout_s=INSTALL_TIMEOUT_S, what=what),
            )
        clear = Action(
            ActionKind.RUN,
            shlex.join(["rm", "-rf", site.path(folder)]),
            timeout_s=REMOVE_TIMEOUT_S,
            what=f"{site.name}: emptying {folder}",
        )
        manifest = Action(ActionKind.PUT, f"{folder}/release.json", ADAPTER_RELEASE)
        if step.kind is StepKind.SEND_ADAPTER_PATCH:
            assert patch is not None  # the planner sends a patch only when the controller has one
            size = patch.stat().st_size
            return (clear, manifest, Action(ActionKind.PUT, f"{folder}/update.patch", str(patch), bytes=size))
        files = self.adapter_files[target.artifact_sha256]
        return (
            clear,
            manifest,
            *(Action(ActionKind.PUT, f"{folder}/artifact/{p.name}", str(p), bytes=n) for p, n in files),
        )

    def actions(self, kind: StepKind, facts: DeviceFacts, desired: DesiredState) -> tuple[Action, ...]:
        """The actions of step `kind` on the device of `facts` (see deployer.push.plan.Recipe)."""
        site = self.sites[facts.name]
        if kind is StepKind.BUILD:
            return ()
        if kind is StepKind.BOOTSTRAP:
            return (_call("install-agent", f"agent {desired.agent_version} for {site.python}"),)
        if kind is StepKind.WRITE_UNITS:
            return self._write_units(site, facts, desired)
        if kind is StepKind.SEND_PATCH:
            base = facts.model_sha256 or ""
            patch = Action(
                ActionKind.PUT,
                f"{release_dir()}/update.patch",
                str(self.patches[base]),
                bytes=desired.patches[base],
            )
            return (_manifest(), patch)
        if kind is StepKind.SEND_ARTIFACT:
            folder = f"{release_dir()}/artifact"
            return (
                _manifest(),
                *(
                    Action(ActionKind.PUT, f"{folder}/{path.name}", str(path), bytes=size)
                    for path, size in self.artifact_files
                ),
            )
        if kind is StepKind.SEND_MANIFEST:
            return (_manifest(),)
        if kind is StepKind.INSTALL:
            return (self._install(site, facts, desired),)
        if kind is StepKind.RELOAD:
            return (_call("ensure-serving", f"serving {desired.version}"),)
        if kind is StepKind.HEALTH_GATE:
            return (_call("health-gate", f"ready on {desired.version}, smoke prompts within budget"),)
        prefix = "pre-" if kind is StepKind.PRE_DEPLOY_HOOK else "post-"
        return tuple(self._hook(phase) for phase in sorted(desired.hooks) if phase.startswith(prefix))

    def _write_units(self, site: DeviceSite, facts: DeviceFacts, desired: DesiredState) -> tuple[Action, ...]:
        files = self.files[site.name]
        changed = sorted(p for p, data in files.items() if facts.unit_hashes.get(p) != sha256_bytes(data))
        actions = [
            Action(ActionKind.PUT, path, GENERATED, sha256=sha256_bytes(files[path]), bytes=len(files[path]))
            for path in changed
        ]
        stale = stale_files(desired, facts)
        actions += [
            Action(
                ActionKind.RUN,
                f"rm -f {shlex.quote(site.path(path))}",
                timeout_s=REMOVE_TIMEOUT_S,
                what=f"{site.name}: removing {path} (deploy.yaml no longer asks for it)",
            )
            for path in stale
        ]
        if facts.systemd:
            actions.append(_call("prepare-service-user", "user sits owns /var/lib/sits"))
            if any(p.endswith(".service") for p in changed):
                actions.append(
                    Action(
                        ActionKind.RUN,
                        "systemctl daemon-reload",
                        timeout_s=DAEMON_RELOAD_TIMEOUT_S,
                        what=f"{site.name}: daemon-reload",
                    )
                )
        if (changed or stale) and facts.model_version:
            actions.append(_call("restart-if-running", "the agent reads the new files"))
        return tuple(actions)

    def _install(self, site: DeviceSite, facts: DeviceFacts, desired: DesiredState) -> Action:
        folder = release_dir()
        send = send_kind(desired, facts)
        if send is StepKind.SEND_PATCH:
            payload = ("--patch", f"{folder}/update.patch")
        elif send is StepKind.SEND_MANIFEST:
            # The agent checks the kept files against the signed manifest: an artifact already
            # verified under that version is only switched to, another one is copied from there.
            payload = ("--artifact", f"{VERSIONS_DIR}/{facts.stored_artifacts[desired.artifact_sha256]}")
        else:
            payload = ("--artifact", f"{folder}/artifact")
        argv = site.agent(
            "install", "--manifest", site.path(f"{folder}/release.json"), payload[0], site.path(payload[1])
        )
        return Action(
            ActionKind.RUN,
            store_command(site, argv),
            timeout_s=INSTALL_TIMEOUT_S,
            what=f"{site.name}: sits-agent install {desired.version}",
        )

    def _hook(self, phase: str) -> Action:
        hook = getattr(self.config.hooks, phase.replace("-", "_"))
        path = str(self.config.resolve(hook.path)) if hook is not None else ""
        timeout = hook.timeout.total_seconds() if hook is not None else 0.0
        return Action(ActionKind.HOOK, phase, path, timeout_s=timeout, what=f"{phase} hook")


def _manifest() -> Action:
    return Action(ActionKind.PUT, posixpath.join(release_dir(), "release.json"), RELEASE_MANIFEST)


def _call(name: str, detail: str) -> Action:
    return Action(ActionKind.CALL, name, what=f"{detail} ({CALLS[name]})")
