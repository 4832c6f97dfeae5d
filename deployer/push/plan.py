"""The planner: desired state minus facts -> per-device steps, each with its reason and actions.

Pure: it takes data and returns data, performs no I/O and knows nothing of SSH. `plan` prints the
`Plan` this module returns; `apply` executes that very object, so a dry run walks the same path
as the real run. A device whose facts already match the desired state gets no steps, which is
what makes a second `apply` report no changes.

Each step carries the actions it will run, as data (as pyinfra's operations yield commands): the
files it uploads, the shell commands it runs on the device, the hooks it runs here and the named
agent operations (start or reload, the health gate) whose own requests are the agent's HTTP API.
A `Recipe` (`deployer.push.operations`) writes them; the executor runs exactly these, so
`plan -v` prints what `apply` runs. Two values are only known under the fleet lock, when the
release is signed: its manifest (`RELEASE_MANIFEST`) and its counter (`RELEASE_COUNTER`).
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

# The agent needs room for the staged payload plus the new version beside the old one.
DISK_HEADROOM = 2.0
MAX_WHEELS_SHOWN = 8  # a bootstrap step's reason names this many wheels (plan's JSON lists all)


class StepKind(enum.StrEnum):
    """What the executor does for one step; the order below is the order on a device.

    BUILD is the controller's: deploy.yaml's artifact is not built yet, so the model's own steps
    are not known (plan builds nothing; apply builds first, then plans again). It has no actions,
    and the executor refuses a plan that holds it.
    """

    BUILD = "build"
    PRE_DEPLOY_HOOK = "pre-deploy-hook"
    BOOTSTRAP = "bootstrap"
    WRITE_UNITS = "write-units"
    SEND_PATCH = "send-patch"
    SEND_ARTIFACT = "send-artifact"
    SEND_MANIFEST = "send-manifest"  # the target is still on the device: its signed manifest only
    INSTALL = "install"
    RELOAD = "reload"
    HEALTH_GATE = "health-gate"
    # An adapter (issue #41): its own signed release, after the base it was made for is in place.
    SEND_ADAPTER_PATCH = "send-adapter-patch"
    SEND_ADAPTER = "send-adapter"
    INSTALL_ADAPTER = "install-adapter"  # verify, install, hot-load and smoke-test; rolled back alone
    POST_DEPLOY_HOOK = "post-deploy-hook"


# The steps that carry a signed release to the device.
SEND_STEPS = frozenset({StepKind.SEND_PATCH, StepKind.SEND_ARTIFACT, StepKind.SEND_MANIFEST})
# The steps of an adapter's rollout: `plan` shows them on lines of their own, one per adapter.
ADAPTER_STEPS = frozenset({StepKind.SEND_ADAPTER_PATCH, StepKind.SEND_ADAPTER, StepKind.INSTALL_ADAPTER})


class DeviceStatus(enum.StrEnum):
    """The planner's verdict for one device."""

    UNCHANGED = "unchanged"
    CHANGE = "change"
    OFFLINE = "offline"
    BLOCKED = "blocked"  # reachable but cannot take the update (e.g. not enough disk)


@dataclass(frozen=True)
class DevicePlatform:
    """What a device's wheels must be built for, and the wheels bootstrap already installed there."""

    python: str  # "3.11"
    implementation: str  # sys.implementation.name: "cpython"
    machine: str  # platform.machine(): "x86_64", "aarch64"
    libc: str  # "glibc" or "musl" ("" when unknown)
    libc_version: str  # "2.36"
    wheels: frozenset[str] = frozenset()  # sha256 of recorded wheels whose release is still installed


@dataclass(frozen=True)
class SystemTorch:
    """The torch a `torch: system` device brings (JetPack's on a Jetson), as its agent's python sees it."""

    version: str | None  # None: it cannot import torch (`error` says why)
    cuda: bool = False  # torch.cuda.is_available() there
    error: str | None = None


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
    platform: DevicePlatform | None = None  # its python's (the agent's, else the bootstrap one's)
    # The architecture the installed agent's wheels were built for (bootstrap's wheels record): one
    # that differs from `arch` means the device was re-imaged, and the agent must be installed anew.
    wheels_arch: str | None = None
    torch: SystemTorch | None = None  # only for a `torch: system` device
    adapters: Mapping[str, InstalledAdapter] = field(default_factory=dict)  # by name: current version

    @property
    def arch(self) -> str | None:
        """The device's CPU architecture, as platform.machine() names it ("x86_64", "aarch64")."""
        return self.platform.machine if self.platform is not None else None


@dataclass(frozen=True)
class InstalledAdapter:
    """An adapter's current version on a device (its store's adapters/<name>/state.json)."""

    version: str
    artifact_sha256: str
    counter: int = 0  # the highest adapter release counter it installed (its anti-rollback floor)


@dataclass(frozen=True)
class AdapterTarget:
    """One adapter of deploy.yaml as built for the target base: what a device should have.
    `patches` maps an adapter artifact sha256 to the size of the patch from it to this one;
    `artifact_sha256` "" means not built for this base yet."""

    name: str
    version: str
    artifact_sha256: str
    artifact_bytes: int
    patches: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class DesiredState:
    """What every selected device should run, and what the controller can send to get it there.

    `patches` maps a base artifact sha256 to the size of the patch from it to the target.
    `built=False`: the artifact is not built yet (`artifact_sha256` is "", its size 0).
    """

    version: str
    artifact_sha256: str
    artifact_bytes: int
    agent_version: str
    unit_hashes: Mapping[str, str]
    patches: Mapping[str, int] = field(default_factory=dict)
    hooks: frozenset[str] = frozenset()  # phases that have a hook configured (pre-/post-deploy or -rollback)
    built: bool = True
    absent: frozenset[str] = frozenset()  # managed files that must not be on the device (see stale_files)
    # The device's link (deploy.yaml's bandwidth): its rate cap in bytes/s (None: none) and whether
    # a full artifact may replace a patch that cannot be made on a metered link.
    rate: float | None = None
    metered: bool = False
    allow_full_on_metered: bool = False
    # What the agent needs of the device: its torch is the device's own (`torch: system`), and
    # agent.device cuda with the torch engine.
    system_torch: bool = False
    cuda: bool = False
    # The agent's wheels the device lacks, by file name with their total size, when bootstrap is
    # due (deployer.push.wheelhouse; empty when the controller did not resolve them).
    wheels: tuple[str, ...] = ()
    wheel_bytes: int = 0
    adapters: tuple[AdapterTarget, ...] = ()  # each rolled out on its own, after the base


@dataclass(frozen=True)
class AdapterChange:
    """One adapter that moves on a device: `plan` shows it on a line of its own."""

    name: str
    from_version: str | None
    to_version: str


class ActionKind(enum.StrEnum):
    """How the executor runs one action."""

    PUT = "put"  # upload `source` (a controller file) to `target` (a device path), verified
    RUN = "run"  # run the shell command `target` on the device; a non-zero exit fails the step
    HOOK = "hook"  # run deploy.yaml's hook for phase `target` on the controller
    CALL = "call"  # the executor's named operation `target` (see deployer.push.operations.CALLS)


# A PUT source: the release manifest signed for this device when apply takes the lock.
RELEASE_MANIFEST = "<signed release manifest>"
# A PUT source: a file the controller renders from deploy.yaml; `sha256` pins its content.
GENERATED = "<from deploy.yaml>"
# A PUT source: the adapter release signed for this device when apply takes the lock (the adapter is
# the name of the target's folder, see deployer.push.operations.adapter_dir).
ADAPTER_RELEASE = "<signed adapter release>"
# In PUT targets and RUN commands: the counter of that release (its upload folder's name).
RELEASE_COUNTER = "<release-counter>"


@dataclass(frozen=True)
class Action:
    """One thing a step does, as data: what `plan -v` prints is what `apply` runs."""

    kind: ActionKind
    target: str  # PUT: device path; RUN: shell command; HOOK: phase; CALL: operation name
    source: str = ""  # PUT: controller path, RELEASE_MANIFEST or GENERATED; HOOK: the hook file
    sha256: str = ""  # PUT of a GENERATED file: the content it must have
    bytes: int = 0
    timeout_s: float = 0.0
    what: str = ""  # what it does, for messages

    def describe(self) -> str:
        """One line for `plan -v`."""
        if self.kind is ActionKind.PUT:
            pinned = f" sha256 {self.sha256[:12]}" if self.sha256 else ""
            return f"put {self.source} -> {self.target} ({self.bytes:,} bytes{pinned})"
        if self.kind is ActionKind.RUN:
            return f"run {self.target}  (timeout {self.timeout_s:g}s)"
        if self.kind is ActionKind.HOOK:
            return f"hook {self.target}: {self.source}"
        return f"call {self.target}: {self.what}"

    def for_release(self, counter: int) -> Action:
        """This action with the release counter filled in (what runs once the release is signed)."""
        return replace(
            self,
            target=self.target.replace(RELEASE_COUNTER, str(counter)),
            source=self.source.replace(RELEASE_COUNTER, str(counter)),
        )


@dataclass(frozen=True)
class Step:
    """One step on one device, why it is needed, and the actions it runs."""

    kind: StepKind
    reason: str
    bytes: int = 0
    actions: tuple[Action, ...] = ()
    adapter: str = ""  # the adapter an adapter step rolls out ("": a step of the base or the device)


@dataclass(frozen=True)
class DevicePlan:
    """Everything that will happen to one device."""

    device: str
    status: DeviceStatus
    reason: str
    from_version: str | None
    to_version: str
    steps: tuple[Step, ...] = ()
    rate: float | None = None  # the device's link cap in bytes/s (None: no cap)
    arch: str | None = None  # the device's CPU architecture (None: not reachable)
    wheels: tuple[str, ...] = ()  # the agent's wheels it will receive (bootstrap), by file name
    adapters: tuple[AdapterChange, ...] = ()  # the adapters its adapter steps move

    def steps_of(self, adapter: str = "") -> tuple[Step, ...]:
        """The steps of one adapter's rollout, or ("") those of the base and the device."""
        return tuple(s for s in self.steps if s.adapter == adapter)

    @property
    def bytes_to_send(self) -> int:
        """Payload bytes this device will receive."""
        return sum(s.bytes for s in self.steps)

    @property
    def seconds(self) -> float | None:
        """How long its payload takes at the device's rate (None: no cap, so no estimate)."""
        return None if self.rate is None else self.bytes_to_send / self.rate


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

    @property
    def converged(self) -> bool:
        """Every device known to match (an offline or blocked device is drift too)."""
        return all(d.status is DeviceStatus.UNCHANGED for d in self.devices)

    def to_dict(self) -> dict:
        """JSON-ready form (what `plan --output json` and `plan -o plan.json` write)."""
        data = asdict(self)
        data["has_changes"] = self.has_changes
        for device, plan in zip(data["devices"], self.devices, strict=True):
            device["bytes"], device["seconds"] = plan.bytes_to_send, plan.seconds
        return data


class Recipe(Protocol):
    """Writes the actions of a step (pure: everything it needs was gathered before planning)."""

    def actions(self, kind: StepKind, facts: DeviceFacts, desired: DesiredState) -> tuple[Action, ...]:
        """The actions that run step `kind` on the device of `facts`."""
        ...

    def adapter_actions(self, step: Step, facts: DeviceFacts, desired: DesiredState) -> tuple[Action, ...]:
        """The actions of an adapter's step (its `adapter` names which)."""
        ...


def facts_digest(facts: Sequence[DeviceFacts]) -> str:
    """A digest of the facts a plan depends on; `apply plan.json` refuses if it changed."""
    relevant = [
        (
            f.name,
            f.reachable,
            f.agent_version,
            f.model_sha256,
            f.release_counter,
            f.arch,
            sorted(f.unit_hashes.items()),
            sorted(f.stored_artifacts),
            sorted((n, a.artifact_sha256) for n, a in f.adapters.items()),
        )
        for f in sorted(facts, key=lambda f: f.name)
    ]
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def make_plan(
    desired: DesiredState | Mapping[str, DesiredState],
    facts: Sequence[DeviceFacts],
    recipe: Recipe | None = None,
) -> Plan:
    """Plan every device; the order of `facts` is kept (it is the rollout order).

    `desired` is one state for every device, or one per device name (their files differ); every
    per-device state names the same target. Without a `recipe` the steps carry no actions (enough
    to see what would change; the executor refuses such a plan).
    """
    per_device = desired if isinstance(desired, Mapping) else {f.name: desired for f in facts}
    targets = {(d.version, d.artifact_sha256) for d in per_device.values()}
    if len(targets) != 1:
        raise ValueError(f"every device's desired state must name one target, got {sorted(targets)}")
    ((version, sha256),) = targets
    return Plan(
        target_version=version,
        target_sha256=sha256,
        devices=tuple(plan_device(per_device[f.name], f, recipe) for f in facts),
        facts_digest=facts_digest(facts),
    )


def plan_device(desired: DesiredState, facts: DeviceFacts, recipe: Recipe | None = None) -> DevicePlan:
    """The steps that take one device from its facts to the desired state."""

    changes = adapter_changes(desired, facts)

    def verdict(status: DeviceStatus, reason: str, steps: Sequence[Step] = ()) -> DevicePlan:
        moved = tuple(c for c, _ in changes) if steps else ()
        return DevicePlan(
            facts.name,
            status,
            reason,
            facts.model_version,
            desired.version,
            tuple(steps),
            desired.rate,
            facts.arch,
            desired.wheels if any(s.kind is StepKind.BOOTSTRAP for s in steps) else (),
            moved,
        )

    if facts.refused:
        return verdict(DeviceStatus.BLOCKED, facts.error or "refused")
    if not facts.reachable:
        return verdict(DeviceStatus.OFFLINE, facts.error or "unreachable")
    cannot = cannot_run(desired, facts)
    if cannot is not None:
        return verdict(DeviceStatus.BLOCKED, cannot)
    steps: list[Step] = []
    if not desired.built:
        steps.append(Step(StepKind.BUILD, f"{desired.version} not built: run `sits-deployer build`"))
    bootstrap = _bootstrap(desired, facts)
    if bootstrap is not None:
        steps.append(bootstrap)
    changed_units = sorted(u for u, h in desired.unit_hashes.items() if facts.unit_hashes.get(u) != h)
    stale = stale_files(desired, facts)
    if changed_units or stale:
        differ = ["units differ: " + ", ".join(changed_units)] if changed_units else []
        steps.append(Step(StepKind.WRITE_UNITS, "; ".join([*differ, *(f"remove {p}" for p in stale)])))
    model_steps = _model_steps(desired, facts) if desired.built else []
    if isinstance(model_steps, str):
        return verdict(DeviceStatus.BLOCKED, model_steps)
    steps.extend(model_steps)
    steps.extend(step for _, adapter_steps in changes for step in adapter_steps)
    if not steps:
        return verdict(DeviceStatus.UNCHANGED, "already matches")
    # The headline is what moves the model, when something does; else the first step.
    headline = {
        StepKind.BUILD,
        StepKind.SEND_PATCH,
        StepKind.SEND_ARTIFACT,
        StepKind.SEND_MANIFEST,
        StepKind.RELOAD,
    }
    reason = next((s.reason for s in steps if s.kind in headline), steps[0].reason)
    if model_steps:
        steps = _with_hooks(desired, steps)
    if recipe is not None:
        steps = [
            replace(
                s,
                actions=recipe.adapter_actions(s, facts, desired)
                if s.adapter
                else recipe.actions(s.kind, facts, desired),
            )
            for s in steps
        ]
    return verdict(DeviceStatus.CHANGE, reason, steps)


def reimaged(facts: DeviceFacts) -> bool:
    """Whether the device's agent was installed for another CPU architecture than it has now."""
    return facts.wheels_arch is not None and facts.arch is not None and facts.wheels_arch != facts.arch


def _bootstrap(desired: DesiredState, facts: DeviceFacts) -> Step | None:
    """The bootstrap step, when the agent is missing, at another version, or built for another
    architecture (a re-imaged device gets a new wheelhouse, never its old wheels)."""
    if reimaged(facts):
        why = f"re-imaged from {facts.wheels_arch} to {facts.arch}: the agent's wheels for {facts.arch}"
    elif facts.agent_version != desired.agent_version:
        why = f"agent {facts.agent_version or 'none'} -> {desired.agent_version}"
    else:
        return None
    if desired.wheels:
        shown = ", ".join(desired.wheels[:MAX_WHEELS_SHOWN])
        more = len(desired.wheels) - MAX_WHEELS_SHOWN
        why += f"; {len(desired.wheels)} wheel(s) to send: {shown}" + (f", {more} more" if more > 0 else "")
    return Step(StepKind.BOOTSTRAP, why, desired.wheel_bytes)


def cannot_run(desired: DesiredState, facts: DeviceFacts) -> str | None:
    """Why the device cannot run the agent as deploy.yaml sets it, from its facts (None: it can).

    Checked before anything is sent: the system torch a `torch: system` device must bring, and
    agent.device cuda on a device whose torch sees no GPU (a system torch without CUDA, or the
    wheelhouse's torch on aarch64: PyPI's, built for server GPUs (SBSA), not a Jetson's integrated
    one, whose CUDA torch is JetPack's).
    """
    torch = facts.torch
    if desired.system_torch and torch is not None and torch.version is None:
        return (
            f"its profile says torch: system, but its python cannot import torch ({torch.error}): "
            "install the vendor's torch (Jetson: NVIDIA's JetPack wheels) or set torch: wheelhouse"
        )
    if not desired.cuda:
        return None
    if desired.system_torch and torch is not None and not torch.cuda:
        return (
            f"agent.device is cuda, but the device's system torch {torch.version} sees no CUDA device: "
            "check JetPack's torch (torch.cuda.is_available()) or set agent.device: auto"
        )
    if not desired.system_torch and facts.arch == "aarch64":
        return (
            "agent.device is cuda, but the wheelhouse's torch for aarch64 is PyPI's, which has no CUDA "
            "for a Jetson's integrated GPU: "
            "give the device's profile torch: system (JetPack's CUDA torch) or set agent.device: auto"
        )
    return None


def adapter_changes(desired: DesiredState, facts: DeviceFacts) -> list[tuple[AdapterChange, list[Step]]]:
    """Each adapter whose current version on the device is not the target's, with its steps: a
    patch from the version it has when the controller made one, else the full adapter artifact,
    then its install (which hot-loads and smoke-tests it, and rolls it back alone on failure)."""
    out = []
    for target in desired.adapters:
        have = facts.adapters.get(target.name)
        if have is not None and have.artifact_sha256 == target.artifact_sha256:
            continue
        change = AdapterChange(target.name, have.version if have else None, target.version)
        head = f"adapter {target.name} {change.from_version or 'none'} -> {target.version}"
        if not target.artifact_sha256:
            why = f"{head}: not built for this base: run `sits-deployer build`"
            out.append((change, [Step(StepKind.BUILD, why, adapter=target.name)]))
            continue
        if have is not None and have.artifact_sha256 in target.patches:
            size = target.patches[have.artifact_sha256]
            send = Step(StepKind.SEND_ADAPTER_PATCH, f"{head}: patch", size, adapter=target.name)
        else:
            full = f"{head}: full adapter artifact"
            send = Step(StepKind.SEND_ADAPTER, full, target.artifact_bytes, adapter=target.name)
        install = Step(StepKind.INSTALL_ADAPTER, f"{head}: verify, load, smoke prompts", adapter=target.name)
        out.append((change, [send, install]))
    return out


def stale_files(desired: DesiredState, facts: DeviceFacts) -> list[str]:
    """The managed files on the device that deploy.yaml no longer asks for (a secret whose section
    was removed): the write-units step deletes them."""
    return sorted(path for path in desired.absent if path in facts.unit_hashes)


def send_kind(desired: DesiredState, facts: DeviceFacts) -> StepKind:
    """How the target reaches a device that does not run it: only a signed manifest when the
    device still keeps the artifact (a pointer switch), a patch from what it runs, or the full
    artifact. The planner and the recipe's install both ask this."""
    if desired.artifact_sha256 in facts.stored_artifacts:
        return StepKind.SEND_MANIFEST
    if facts.model_sha256 is not None and facts.model_sha256 in desired.patches:
        return StepKind.SEND_PATCH
    return StepKind.SEND_ARTIFACT


def _model_steps(desired: DesiredState, facts: DeviceFacts) -> list[Step] | str:
    """Steps that move the model, or a reason string when the device cannot take the update."""
    if facts.model_sha256 == desired.artifact_sha256:
        return [] if facts.ready else [Step(StepKind.RELOAD, "model installed but not ready")]
    have = facts.model_version or "nothing"
    kind = send_kind(desired, facts)
    if kind is StepKind.SEND_MANIFEST:  # nothing to stage, so no room is needed either
        kept = facts.stored_artifacts[desired.artifact_sha256]
        return [
            Step(kind, f"{kept} is still on the device: switch to it"),
            Step(StepKind.INSTALL, f"verify the release and switch to {kept}"),
            *_switch_steps(),
        ]
    if kind is StepKind.SEND_PATCH:
        send = Step(kind, f"patch {have} -> {desired.version}", desired.patches[facts.model_sha256 or ""])
    elif facts.model_sha256 is None:
        send = Step(kind, "full artifact (no model installed)", desired.artifact_bytes)
    else:
        # The controller makes a patch from any artifact still in its store; this one is gone.
        why = f"no patch from {have}: its artifact is not in the controller's store"
        if desired.metered and not desired.allow_full_on_metered:
            return (
                f"metered link: {why}, and the full artifact ({desired.artifact_bytes:,} bytes) is "
                "never sent instead without bandwidth.allow_full_on_metered"
            )
        metered = "; metered, allowed by bandwidth.allow_full_on_metered" if desired.metered else ""
        send = Step(kind, f"full artifact ({why}{metered})", desired.artifact_bytes)
    needed = int(send.bytes + desired.artifact_bytes * (DISK_HEADROOM - 1))
    if facts.free_disk_bytes is not None and facts.free_disk_bytes < needed:
        return f"needs {needed} bytes free, has {facts.free_disk_bytes}"
    return [send, Step(StepKind.INSTALL, f"verify and install {desired.version}"), *_switch_steps()]


def _switch_steps() -> list[Step]:
    return [
        Step(StepKind.RELOAD, "hot-swap to the new version"),
        Step(StepKind.HEALTH_GATE, "readiness and smoke prompts within the latency budget"),
    ]


def _with_hooks(desired: DesiredState, steps: list[Step]) -> list[Step]:
    """The hook steps around the model steps: deploy hooks, or rollback hooks for a fleet rollback."""
    pre = sorted(p for p in desired.hooks if p.startswith("pre-"))
    post = sorted(p for p in desired.hooks if p.startswith("post-"))
    before = [Step(StepKind.PRE_DEPLOY_HOOK, f"{p} hook") for p in pre]
    after = [Step(StepKind.POST_DEPLOY_HOOK, f"{p} hook") for p in post]
    return before + steps + after
