"""The planner: desired state minus facts -> per-device steps, each with its reason.

Pure: it takes data and returns data, performs no I/O and knows nothing of SSH. `plan` prints the
`Plan` this module returns; `apply` executes that very object, so a dry run walks the same path
as the real run. A device whose facts already match the desired state gets no steps, which is
what makes a second `apply` report no changes.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

# The agent needs room for the staged payload plus the new version beside the old one.
DISK_HEADROOM = 2.0


class StepKind(enum.StrEnum):
    """What the executor does for one step; the order below is the order on a device."""

    PRE_DEPLOY_HOOK = "pre-deploy-hook"
    BOOTSTRAP = "bootstrap"
    WRITE_UNITS = "write-units"
    SEND_PATCH = "send-patch"
    SEND_ARTIFACT = "send-artifact"
    SEND_MANIFEST = "send-manifest"  # the target is still on the device: only its signed manifest
    INSTALL = "install"
    RELOAD = "reload"
    HEALTH_GATE = "health-gate"
    POST_DEPLOY_HOOK = "post-deploy-hook"


class DeviceStatus(enum.StrEnum):
    """The planner's verdict for one device."""

    UNCHANGED = "unchanged"
    CHANGE = "change"
    OFFLINE = "offline"
    BLOCKED = "blocked"  # reachable but cannot take the update (e.g. not enough disk)


@dataclass(frozen=True)
class DeviceFacts:
    """What a device reported. `reachable=False` means nothing else is known; `refused` that it
    answered but refused us (a changed host key, failed authentication): blocked, never offline."""

    name: str
    reachable: bool
    error: str | None = None
    refused: bool = False
    agent_version: str | None = None
    model_version: str | None = None
    model_sha256: str | None = None
    release_counter: int = 0
    free_disk_bytes: int | None = None
    free_memory_bytes: int | None = None
    unit_hashes: Mapping[str, str] = field(default_factory=dict)
    ready: bool = False
    systemd: bool = False  # the agent runs under systemd (else as a background process)
    stored_artifacts: Mapping[str, str] = field(default_factory=dict)  # sha256 -> version kept on disk


@dataclass(frozen=True)
class DesiredState:
    """What every selected device should run, and what the controller can send to get it there.

    `patches` maps a base artifact sha256 to the size of the patch from it to the target.
    """

    version: str
    artifact_sha256: str
    artifact_bytes: int
    agent_version: str
    unit_hashes: Mapping[str, str]
    patches: Mapping[str, int] = field(default_factory=dict)
    hooks: frozenset[str] = frozenset()  # phases that have a hook configured


@dataclass(frozen=True)
class Step:
    """One action on one device, and why it is needed."""

    kind: StepKind
    reason: str
    bytes: int = 0


@dataclass(frozen=True)
class DevicePlan:
    """Everything that will happen to one device."""

    device: str
    status: DeviceStatus
    reason: str
    from_version: str | None
    to_version: str
    steps: tuple[Step, ...] = ()

    @property
    def bytes_to_send(self) -> int:
        """Payload bytes this device will receive."""
        return sum(s.bytes for s in self.steps)


@dataclass(frozen=True)
class Plan:
    """The whole rollout plan. `facts_digest` pins the facts it was made from (for `apply plan.json`)."""

    target_version: str
    target_sha256: str
    devices: tuple[DevicePlan, ...]
    facts_digest: str

    @property
    def has_changes(self) -> bool:
        """True when at least one device has steps to run."""
        return any(d.status is DeviceStatus.CHANGE for d in self.devices)

    def to_dict(self) -> dict:
        """JSON-ready form (what `plan --output json` and `plan -o plan.json` write)."""
        data = asdict(self)
        data["has_changes"] = self.has_changes
        return data


def facts_digest(facts: Sequence[DeviceFacts]) -> str:
    """A digest of the facts a plan depends on; `apply plan.json` refuses if it changed."""
    relevant = [
        (
            f.name,
            f.reachable,
            f.agent_version,
            f.model_sha256,
            f.release_counter,
            sorted(f.unit_hashes.items()),
        )
        for f in sorted(facts, key=lambda f: f.name)
    ]
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def make_plan(desired: DesiredState, facts: Sequence[DeviceFacts]) -> Plan:
    """Plan every device; the order of `facts` is kept (it is the rollout order)."""
    return Plan(
        target_version=desired.version,
        target_sha256=desired.artifact_sha256,
        devices=tuple(plan_device(desired, f) for f in facts),
        facts_digest=facts_digest(facts),
    )


def plan_device(desired: DesiredState, facts: DeviceFacts) -> DevicePlan:
    """The steps that take one device from its facts to the desired state."""
    base = {"device": facts.name, "from_version": facts.model_version, "to_version": desired.version}
    if facts.refused:
        return DevicePlan(**base, status=DeviceStatus.BLOCKED, reason=facts.error or "refused")
    if not facts.reachable:
        return DevicePlan(**base, status=DeviceStatus.OFFLINE, reason=facts.error or "unreachable")
    steps: list[Step] = []
    if facts.agent_version != desired.agent_version:
        have = facts.agent_version or "none"
        steps.append(Step(StepKind.BOOTSTRAP, f"agent {have} -> {desired.agent_version}"))
    changed_units = sorted(u for u, h in desired.unit_hashes.items() if facts.unit_hashes.get(u) != h)
    if changed_units:
        steps.append(Step(StepKind.WRITE_UNITS, "units differ: " + ", ".join(changed_units)))
    model_steps = _model_steps(desired, facts)
    if isinstance(model_steps, str):
        return DevicePlan(**base, status=DeviceStatus.BLOCKED, reason=model_steps)
    steps.extend(model_steps)
    if not steps:
        return DevicePlan(**base, status=DeviceStatus.UNCHANGED, reason="already matches")
    # The headline is what moves the model, when something does; else the first step.
    headline = (StepKind.SEND_PATCH, StepKind.SEND_ARTIFACT, StepKind.SEND_MANIFEST, StepKind.RELOAD)
    reason = next((s.reason for s in steps if s.kind in headline), steps[0].reason)
    if model_steps:
        steps = _with_hooks(desired, steps)
    return DevicePlan(**base, status=DeviceStatus.CHANGE, reason=reason, steps=tuple(steps))


def _model_steps(desired: DesiredState, facts: DeviceFacts) -> list[Step] | str:
    """Steps that move the model, or a reason string when the device cannot take the update."""
    if facts.model_sha256 == desired.artifact_sha256:
        return [] if facts.ready else [Step(StepKind.RELOAD, "model installed but not ready")]
    have = facts.model_version or "nothing"
    patch_size = desired.patches.get(facts.model_sha256 or "")
    kept = facts.stored_artifacts.get(desired.artifact_sha256)
    if kept is not None:  # a pointer switch: nothing to stage, so no room needed either
        return [
            Step(StepKind.SEND_MANIFEST, f"{kept} is still on the device: switch to it"),
            Step(StepKind.INSTALL, f"verify the release and switch to {kept}"),
            Step(StepKind.RELOAD, "hot-swap to the new version"),
            Step(StepKind.HEALTH_GATE, "readiness and smoke prompts within the latency budget"),
        ]
    if patch_size is not None:
        send = Step(StepKind.SEND_PATCH, f"patch {have} -> {desired.version}", patch_size)
    else:
        why = "no model installed" if facts.model_sha256 is None else f"no patch from {have}"
        send = Step(StepKind.SEND_ARTIFACT, f"full artifact ({why})", desired.artifact_bytes)
    needed = int(send.bytes + desired.artifact_bytes * (DISK_HEADROOM - 1))
    if facts.free_disk_bytes is not None and facts.free_disk_bytes < needed:
        return f"needs {needed} bytes free, has {facts.free_disk_bytes}"
    return [
        send,
        Step(StepKind.INSTALL, f"verify and install {desired.version}"),
        Step(StepKind.RELOAD, "hot-swap to the new version"),
        Step(StepKind.HEALTH_GATE, "readiness and smoke prompts within the latency budget"),
    ]


def _with_hooks(desired: DesiredState, steps: list[Step]) -> list[Step]:
    before = [Step(StepKind.PRE_DEPLOY_HOOK, "pre-deploy hook")] if "pre-deploy" in desired.hooks else []
    after = [Step(StepKind.POST_DEPLOY_HOOK, "post-deploy hook")] if "post-deploy" in desired.hooks else []
    return before + steps + after
