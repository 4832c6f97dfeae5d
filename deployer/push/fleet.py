"""The fleet commands' work, one function each: plan, apply, rollback, status (the CLI only prints).

    plan_fleet     config -> facts of the selected devices -> per-device desired state -> Plan
                   (plan.make_plan, each step's actions written by operations.DeviceRecipe)
    apply_plan     lock, refusals (apply_refusal: what apply --dry-run reports too), releases,
                   executor, audit log
    rollback_fleet a Plan whose target is an older artifact, issued as a new signed release
    fleet_status   device, version, health, last result (from the audit log)

A plan file (`plan -o plan.json`) records the Plan and the deploy.yaml it came from; `apply plan.json`
re-reads the facts and refuses when their digest differs from the one the plan was made from.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from deployer.config.models import Config, Device
from deployer.core.hashing import sha256_bytes
from deployer.core.ratelimit import Throttle, TokenBucket
from deployer.core.redact import redacted_json
from deployer.errors import ConfigError, KeyFileError, SignatureError, SitsError
from deployer.push.bootstrap import (
    AGENT_PROJECT,
    REMOVED_WHEN_UNSET,
    agent_wheelhouse,
    build_agent_wheel,
    desired_files,
)
from deployer.push.executor import Executor, MeterFactory, OnPhase, ResultStatus, RolloutReport
from deployer.push.facts import DeviceSite, controller_agent_version, gather_fleet
from deployer.push.health import scrape_metrics
from deployer.push.operations import DeviceRecipe
from deployer.push.plan import (
    SEND_STEPS,
    AdapterTarget,
    DesiredState,
    DeviceFacts,
    DeviceStatus,
    Plan,
    StepKind,
    make_plan,
    reimaged,
)
from deployer.push.rollout import OfflineDecision, decide_offline
from deployer.push.state import FleetLock, append_audit, read_audit
from deployer.push.wheelhouse import CrossBuildPending
from deployer.release.adapters import AdapterReleaser, adapter_in_store, built_adapters
from deployer.release.desired import SITS_DIRNAME, Desired, ReleaseFiles, Releaser, artifact_in_store
from deployer.transport import LocalTransport, Transport, run_bounded

__all__ = [
    "FleetPlan",
    "FleetSession",
    "apply_failures",
    "apply_plan",
    "apply_refusal",
    "check_plan_config",
    "check_plan_file",
    "config_digest",
    "fleet_status",
    "load_plan_file",
    "make_fleet_plan",
    "plan_fleet",
    "prepare_releases",
    "rollback_target",
    "write_plan_file",
]

PLAN_FILE_KIND = "sits-plan"
# Warnings without a command's return value to carry them; with no handler configured, Python's
# last-resort handler prints them to stderr.
_log = logging.getLogger("sits.deployer")
Connect = Callable[[Config, Device, DeviceSite], Transport]


@dataclass
class FleetSession:
    """The devices one command selected from a config's inventory (`config.fleet`), their sites,
    and one open transport per device. `connect` makes a device's transport (tests pass a
    simulated one)."""

    config: Config
    devices: tuple[Device, ...]
    parallel: int = 4
    connect: Connect | None = None

    def __post_init__(self) -> None:
        self.sites = {d.name: DeviceSite.of(self.config, d) for d in self.devices}
        self._transports: dict[str, Transport] = {}
        total = self.config.bandwidth.push_total if self.config.bandwidth else None
        # One bucket for every upload of this session: the total holds whatever --parallel is.
        self._push_total = TokenBucket(total) if total else None

    @classmethod
    def select(
        cls,
        config: Config,
        *,
        selector: Mapping[str, str] | None = None,
        names: Sequence[str] = (),
        parallel: int = 4,
        connect: Connect | None = None,
    ) -> FleetSession:
        """The devices matching every `selector` label (default: strategy.selector) and, if given, `names`."""
        labels = dict(config.strategy.selector if selector is None else selector)
        unknown = set(names) - {d.name for d in config.fleet.devices}
        if unknown:
            raise ConfigError(f"no such device(s) in the inventory: {', '.join(sorted(unknown))}")
        chosen = tuple(
            d
            for d in config.fleet.devices
            if all(d.labels.get(k) == v for k, v in labels.items()) and (not names or d.name in names)
        )
        if not chosen:
            raise ConfigError(
                "no device matches the selection", hint="check --selector/--device and the labels"
            )
        return cls(config, chosen, parallel, connect)

    def transport(self, site: DeviceSite) -> Transport:
        """The (cached) transport of a device."""
        if site.name not in self._transports:
            device = next(d for d in self.devices if d.name == site.name)
            transport = (self.connect or _connect)(self.config, device, site)
            rate = self.config.link_for(device).rate
            buckets = [TokenBucket(rate)] if rate else []
            if self._push_total is not None:
                buckets.append(self._push_total)
            transport.throttle = Throttle(buckets) if buckets else None
            self._transports[site.name] = transport
        return self._transports[site.name]

    def close(self) -> None:
        """Close every connection."""
        for transport in self._transports.values():
            transport.close()

    def facts(self) -> list[DeviceFacts]:
        """Facts of every selected device, in inventory order."""
        return gather_fleet(list(self.sites.values()), self.transport, parallel=self.parallel)

    @property
    def sits_dir(self) -> Path:
        """The project's `.sits/` directory."""
        return self.config.base_dir / SITS_DIRNAME


def _connect(config: Config, device: Device, site: DeviceSite) -> Transport:
    if site.local:
        return LocalTransport(Path(site.root), label=device.name)
    from deployer.transport.ssh import SshOptions, SshTransport

    defaults = SshOptions()
    options = SshOptions(
        user=device.user,
        key_file=config.resolve(device.identity_file) if device.identity_file else None,
        known_hosts=config.resolve(device.known_hosts) if device.known_hosts else defaults.known_hosts,
        trust_on_first_use=device.trust_on_first_use,
        max_in_flight=config.link_for(device).max_in_flight or defaults.max_in_flight,
    )
    return SshTransport(device.host or device.name, port=device.port, options=options, label=device.name)


@dataclass(frozen=True)
class FleetPlan:
    """A Plan with the facts and target it was made from (`target` None: deploy.yaml's artifact
    is not built yet, and the plan cannot be executed)."""

    plan: Plan
    facts: tuple[DeviceFacts, ...]
    target: Desired | None
    adapters: Mapping[str, Desired | None] = field(default_factory=dict)  # as built for the target

    def built_target(self) -> Desired:
        """The target; raises SitsError when it is not built (such a plan is only shown)."""
        if self.target is None:
            raise SitsError(
                f"{self.plan.target_version} is not built, so this plan cannot be applied",
                hint="run `sits-deployer build`, then plan again",
            )
        return self.target


def plan_fleet(
    fleet: FleetSession,
    target: Desired | None,
    *,
    rollback: bool = False,
    project_dir: Path | None = None,
    cross_build: bool = False,
    adapter_rollback: tuple[str, Desired] | None = None,
) -> FleetPlan:
    """Facts of the fleet minus the target: the per-device plan (patches are made as needed).
    `target` None: deploy.yaml's artifact is not built; its devices get a pending build step.
    `project_dir` (the checkout the agent's wheel is built from): the agent's wheels each device
    due a bootstrap lacks are gathered for its platform and named in the plan, so a platform no
    wheel can be had for fails here, before anything is sent; `cross_build` (apply) cross-compiles
    a source-only one, where a plan only names it (deployer.push.wheelhouse).
    `adapter_rollback` (name, adapter artifact): only that adapter moves, to that artifact; a
    device that would need any other step is refused (SitsError), so the base is never touched.
    Raises SitsError for a platform no wheel can be had for."""
    facts = fleet.facts()
    wheels = _missing_wheels(fleet, facts, project_dir, cross_build=cross_build) if project_dir else {}
    releaser = Releaser(fleet.config)
    patches: dict[str, Path] = {}
    for f in facts:
        if target is None or target.artifact_sha256 in f.stored_artifacts:
            continue  # not built (nothing to patch to), or still on the device (a pointer switch)
        base = artifact_in_store(fleet.config, f.model_sha256) if f.model_sha256 else None
        if base is not None and base.artifact_sha256 != target.artifact_sha256:
            patches[base.artifact_sha256] = releaser.patch(base, target)
    # A fleet rollback moves the base only: adapters roll back on their own (not from here yet).
    adapters: Mapping[str, Desired | None] = {}
    if adapter_rollback is not None:
        adapters = dict([adapter_rollback])
    elif target is not None and not rollback:
        adapters = built_adapters(fleet.config, target.artifact_sha256)
    adapter_patches: dict[tuple[str, str], Path] = {}
    for f in facts:
        for name, have in f.adapters.items():
            want, old = adapters.get(name), adapter_in_store(fleet.config, have.artifact_sha256)
            if want is not None and old is not None and old.artifact_sha256 != want.artifact_sha256:
                key = (old.artifact_sha256, want.artifact_sha256)
                adapter_patches[key] = AdapterReleaser(fleet.config, name).patch(old, want)
    fp = make_fleet_plan(
        fleet.config,
        fleet.sites,
        facts,
        target,
        patches,
        rollback=rollback,
        wheels=wheels,
        adapters=adapters,
        adapter_patches=adapter_patches,
    )
    if adapter_rollback is not None:
        for dp in fp.plan.devices:
            if dp.steps_of():
                raise SitsError(
                    f"{dp.device}: rolling adapter {adapter_rollback[0]} back would also "
                    f"{dp.steps_of()[0].reason}",
                    hint="apply deploy.yaml first, then roll the adapter back",
                )
    return fp


def _missing_wheels(
    fleet: FleetSession, facts: Sequence[DeviceFacts], project_dir: Path, *, cross_build: bool
) -> dict[str, tuple[tuple[str, ...], int]]:
    """device -> (file names, total bytes) of the agent's wheels it lacks, for each device that a
    bootstrap is due on (the agent's own wheel included: it is always sent)."""
    agent = controller_agent_version()
    due = [
        f
        for f in facts
        if f.reachable and f.platform is not None and (f.agent_version != agent or reimaged(f))
    ]
    if not due or not (project_dir / AGENT_PROJECT / "pyproject.toml").is_file():
        return {}
    wheel = build_agent_wheel(project_dir, fleet.sits_dir / "wheels")
    out: dict[str, tuple[tuple[str, ...], int]] = {}
    for f in due:
        assert f.platform is not None  # filtered above
        try:
            house = agent_wheelhouse(fleet.sites[f.name], f.platform, wheel, cross_build=cross_build)
        except CrossBuildPending as exc:  # a plan: apply compiles it, and then knows the rest
            out[f.name] = ((f"{exc.name} (cross-compiled for {exc.arch} by apply, once)", wheel.name), 0)
            continue
        except SitsError as exc:
            raise SitsError(f"{f.name}: {exc.message}", hint=exc.hint) from exc
        lacking = [w.path for w in house.wheels if w.sha256 not in f.platform.wheels] + [wheel]
        out[f.name] = (tuple(p.name for p in lacking), sum(p.stat().st_size for p in lacking))
    return out


def make_fleet_plan(
    config: Config,
    sites: Mapping[str, DeviceSite],
    facts: Sequence[DeviceFacts],
    target: Desired | None,
    patches: Mapping[str, Path],
    *,
    rollback: bool = False,
    wheels: Mapping[str, tuple[tuple[str, ...], int]] | None = None,
    adapters: Mapping[str, Desired | None] | None = None,
    adapter_patches: Mapping[tuple[str, str], Path] | None = None,
) -> FleetPlan:
    """The plan for these facts: per device the files deploy.yaml renders for it and the patch
    from its base (`patches`: base artifact sha256 -> patch file), then plan.make_plan.
    `target` None: deploy.yaml's artifact, not built yet. `wheels`: device -> the agent's wheels
    it lacks (names, total bytes), for its bootstrap step. `adapters`: deploy.yaml's adapters as
    built for the target (None: not built), `adapter_patches` by (from id, to id)."""
    wheels = wheels or {}
    adapters, adapter_patches = adapters or {}, adapter_patches or {}
    adapter_targets = _adapter_targets(config, adapters, adapter_patches)
    files = {f.name: desired_files(config, sites[f.name], systemd=f.systemd) for f in facts}
    sizes = {base: path.stat().st_size for base, path in patches.items()}
    hooks = _configured_hooks(config, rollback=rollback)
    devices = {d.name: d for d in config.fleet.devices}
    links = {f.name: config.link_for(devices[f.name]) for f in facts}
    push_total = config.bandwidth.push_total if config.bandwidth else None
    desired = {
        f.name: DesiredState(
            version=target.version if target else config.model.version,
            artifact_sha256=target.artifact_sha256 if target else "",
            artifact_bytes=target.artifact_bytes if target else 0,
            agent_version=controller_agent_version(),
            unit_hashes={path: sha256_bytes(data) for path, data in files[f.name].items()},
            patches={base: sizes[base] for base in (f.model_sha256,) if base in sizes},
            hooks=hooks,
            built=target is not None,
            absent=REMOVED_WHEN_UNSET - files[f.name].keys(),
            rate=min((r for r in (links[f.name].rate, push_total) if r), default=None),
            metered=links[f.name].metered,
            allow_full_on_metered=links[f.name].allow_full_on_metered,
            system_torch=sites[f.name].system_torch,
            cuda=config.agent.device == "cuda" and config.agent.engine == "torch",
            wheels=wheels.get(f.name, ((), 0))[0],
            wheel_bytes=wheels.get(f.name, ((), 0))[1],
            adapters=adapter_targets,
        )
        for f in facts
    }
    recipe = DeviceRecipe(
        config=config,
        sites=sites,
        files=files,
        patches=patches,
        artifact_files=_files(target.artifact_dir) if target else (),
        adapter_files={a.artifact_sha256: _files(a.artifact_dir) for a in adapters.values() if a is not None},
        adapter_patches=adapter_patches,
    )
    return FleetPlan(make_plan(desired, facts, recipe), tuple(facts), target, adapters)


def _adapter_targets(
    config: Config, adapters: Mapping[str, Desired | None], patches: Mapping[tuple[str, str], Path]
) -> tuple[AdapterTarget, ...]:
    """deploy.yaml's adapters as the planner wants them (artifact id "": not built for the target)."""
    out = []
    for spec in config.model.adapters:
        if spec.name not in adapters:
            continue
        built = adapters[spec.name]
        if built is None:
            out.append(AdapterTarget(spec.name, spec.version, "", 0))
            continue
        sizes = {a: p.stat().st_size for (a, b), p in patches.items() if b == built.artifact_sha256}
        out.append(
            AdapterTarget(spec.name, built.version, built.artifact_sha256, built.artifact_bytes, sizes)
        )
    return tuple(out)


def _files(directory: Path) -> tuple[tuple[Path, int], ...]:
    """An artifact's files and sizes, in upload order."""
    return tuple((p, p.stat().st_size) for p in sorted(directory.iterdir()) if p.is_file())


def _configured_hooks(config: Config, *, rollback: bool) -> frozenset[str]:
    """The phases around the model steps that have a hook: deploy ones, or rollback ones."""
    phases = ("pre-rollback", "post-rollback") if rollback else ("pre-deploy", "post-deploy")
    return frozenset(p for p in phases if getattr(config.hooks, p.replace("-", "_")) is not None)


def rollback_target(config: Config, to: str | None, current: Sequence[DeviceFacts]) -> Desired:
    """The artifact a fleet rollback returns to: version `to`, or the newest released version that
    no selected device runs now. Raises SitsError when the controller no longer has it."""
    entries = list(reversed(Releaser(config).history()))
    running = {f.model_sha256 for f in current if f.model_sha256}
    for entry in entries:
        if (to is not None and entry.version == to) or (to is None and entry.artifact_sha256 not in running):
            found = artifact_in_store(config, entry.artifact_sha256)
            if found is not None:
                return found
    raise SitsError(
        f"no released artifact of {to or 'an earlier version'} in this project's store",
        hint="rollback goes to versions this controller released; see .sits/releases/ledger.json",
    )


def adapter_rollback_target(
    config: Config, name: str, to: str | None, current: Sequence[DeviceFacts]
) -> Desired:
    """The adapter artifact a fleet rollback of adapter `name` returns to: version `to`, or the
    newest released version of it that no selected device has now. Raises SitsError when the
    controller never released it or no longer has it."""
    running = {a.artifact_sha256 for f in current if (a := f.adapters.get(name)) is not None}
    for entry in reversed(AdapterReleaser(config, name).history()):
        if (to is not None and entry.version == to) or (to is None and entry.artifact_sha256 not in running):
            found = adapter_in_store(config, entry.artifact_sha256)
            if found is not None:
                return found
    raise SitsError(
        f"no released version {to or 'before the current one'} of adapter {name} in this project's store",
        hint=f"rollback goes to versions this controller released; see .sits/releases/adapters/{name}/",
    )


def prepare_releases(fleet: FleetSession, fp: FleetPlan) -> dict[str, ReleaseFiles]:
    """Sign (or reuse) the release each changing device needs; counters above every device's."""
    releaser, target = Releaser(fleet.config), fp.built_target()
    floor = max((f.release_counter for f in fp.facts), default=0)
    facts = {f.name: f for f in fp.facts}
    out: dict[str, ReleaseFiles] = {}
    for dp in fp.plan.devices:
        kinds = {s.kind for s in dp.steps}
        if StepKind.SEND_PATCH in kinds:
            base = artifact_in_store(fleet.config, facts[dp.device].model_sha256 or "")
            out[dp.device] = releaser.release(target, base, floor=floor)
        elif kinds & {StepKind.SEND_ARTIFACT, StepKind.SEND_MANIFEST}:
            out[dp.device] = releaser.release(target, None, floor=floor)
    for manifest in sorted({r.manifest for r in out.values()}):
        _check_signed_enough(fleet.config, manifest)
    return out


def prepare_adapter_releases(fleet: FleetSession, fp: FleetPlan) -> dict[str, dict[str, Path]]:
    """Sign (or reuse) the adapter release each changing device needs, by device then adapter: a
    counter line per adapter, above the counter the device reported for it."""
    facts = {f.name: f for f in fp.facts}
    out: dict[str, dict[str, Path]] = {}
    for dp in fp.plan.devices:
        for change in dp.adapters:
            steps = dp.steps_of(change.name)
            if not any(s.kind in (StepKind.SEND_ADAPTER, StepKind.SEND_ADAPTER_PATCH) for s in steps):
                continue
            want = fp.adapters.get(change.name)
            have = facts[dp.device].adapters.get(change.name)
            base = None
            if have is not None and any(s.kind is StepKind.SEND_ADAPTER_PATCH for s in steps):
                base = adapter_in_store(fleet.config, have.artifact_sha256)
            assert want is not None  # the plan sends only adapters built in the store
            floor = have.counter if have is not None else 0
            released = AdapterReleaser(fleet.config, change.name).release(want, base, floor=floor)
            _check_signed_enough(fleet.config, released.manifest)
            out.setdefault(dp.device, {})[change.name] = released.manifest
    return out


def _check_signed_enough(config: Config, manifest: Path) -> None:
    """Refuse before anything is sent when the devices would refuse the release's signatures, e.g.
    a k-of-n threshold that the one signing key of `apply` cannot meet alone. The trusted keys are
    loaded as a device loads them: a file that is no usable key is skipped with a warning naming
    it, so this check refuses exactly what the devices (which receive these files) would refuse."""
    from deployer.core.release import read_envelope
    from deployer.core.verify import check_signatures, load_usable_keys

    signing = config.signing
    if signing is None or not signing.trusted_keys:
        return
    trusted = load_usable_keys(
        [config.resolve(k) for k in signing.trusted_keys],
        signing.threshold,
        where="signing.trusted_keys",
        warn=_log.warning,
    )
    try:
        check_signatures(read_envelope(manifest), trusted)
    except SignatureError as exc:
        raise SignatureError(
            f"{manifest}: {exc.message}; the devices would refuse it, so nothing was sent",
            hint=f"have other trusted keys sign it (sits-deployer sign {manifest} --key OTHER.key), "
            "then run apply again: it reuses this release",
        ) from exc


def apply_plan(
    fleet: FleetSession,
    fp: FleetPlan,
    *,
    action: str = "apply",
    on_phase: OnPhase | None = None,
    meter: MeterFactory | None = None,
    project_dir: Path | None = None,
    releases: Callable[[FleetSession, FleetPlan], Mapping[str, ReleaseFiles]] = prepare_releases,
    executor: Callable[..., Executor] = Executor,
) -> RolloutReport:
    """Execute a plan under the fleet lock and record it in the audit log.

    `releases` signs what the devices need (tests pass prepared files) and `executor` makes the
    Executor (tests bind its seams). Raises SitsError when the lock is held or, with
    `strategy.offline: fail`, a device is offline (nothing changed in either case). Ctrl-C:
    recorded, then KeyboardInterrupt propagates.
    """
    fp.built_target()  # raises for a plan made before the build: it cannot run
    refusal = apply_refusal(fleet.config, fp.plan)
    with FleetLock(fleet.sits_dir, action).held() as lock:
        if refusal is not None:
            raise refusal
        signed = releases(fleet, fp)
        adapter_releases = prepare_adapter_releases(fleet, fp)
        wheel: Callable[[], Path] | None = None
        if project_dir is not None and (project_dir / AGENT_PROJECT / "pyproject.toml").is_file():

            def wheel() -> Path:
                return build_agent_wheel(project_dir, fleet.sits_dir / "wheels")

        runner = executor(
            fleet.config,
            fleet.sites,
            fleet.transport,
            parallel=fleet.parallel,
            on_phase=on_phase,
            meter=meter,
            wheel=wheel,
        )
        record: dict[str, Any] = {
            "action": action,
            "lock_id": lock.lock_id,
            "plan_digest": fp.plan.facts_digest,
        }
        try:
            by_name = {f.name: f for f in fp.facts}
            report = runner.run(fp.plan, by_name, signed, action=action, adapter_releases=adapter_releases)
        except KeyboardInterrupt as exc:
            append_audit(fleet.sits_dir, {**record, **exc.report.to_dict()})  # type: ignore[attr-defined]
            raise
        report = _mark_skipped(report, _offline_decision(fleet.config, fp.plan).skipped)
        append_audit(fleet.sits_dir, {**record, **report.to_dict()})
        return report


def _offline_decision(config: Config, plan: Plan) -> OfflineDecision:
    offline = [d.device for d in plan.devices if d.status is DeviceStatus.OFFLINE]
    return decide_offline(config.strategy.offline, offline)


def apply_refusal(config: Config, plan: Plan, *, signing: bool = True) -> SitsError | None:
    """Why apply refuses `plan` before it changes anything, or None: devices offline under
    `strategy.offline: fail`, or releases to send and no key to sign them. apply_plan raises it;
    `apply --dry-run` and `plan --detailed-exitcode` report it, the latter with `signing=False`:
    a drift check runs where no signing key is (CI's drift job)."""
    refusal = _offline_decision(config, plan).refusal
    if refusal:
        return SitsError(refusal, hint="bring the devices back, or set strategy.offline: skip")
    sends = any(s.kind in SEND_STEPS for d in plan.devices for s in d.steps)
    if signing and sends and (config.signing is None or config.signing.private_key is None):
        return KeyFileError(
            "deploy.yaml has no signing.private_key, and devices install only signed releases",
            hint="make a key pair with `sits-deployer keygen -o keys/release` and set "
            "signing.private_key: keys/release.key",
        )
    return None


def apply_failures(plan: Plan) -> SitsError | None:
    """The devices that apply would report failed without trying (they cannot take the update)."""
    blocked = [f"{d.device} ({d.reason})" for d in plan.devices if d.status is DeviceStatus.BLOCKED]
    return SitsError(f"device(s) cannot take the update: {', '.join(blocked)}") if blocked else None


def check_unchanged(fleet: FleetSession, fp: FleetPlan) -> None:
    """For a plan with no changes: raise unless every device really matches.

    Offline devices (under `strategy.offline: fail`) and blocked ones have no steps either, so
    "no changes" alone would report a fleet that has not converged as done.
    """
    problem = apply_refusal(fleet.config, fp.plan) or apply_failures(fp.plan)
    if problem is not None:
        raise problem


def _mark_skipped(report: RolloutReport, skipped: Sequence[str]) -> RolloutReport:
    results = tuple(
        replace(r, status=ResultStatus.SKIPPED) if r.device in skipped else r for r in report.results
    )
    return replace(report, results=results)


# -- plan files ------------------------------------------------------------------------------------


def write_plan_file(
    fp: FleetPlan, config_path: Path, out: Path, selector: Mapping[str, str], names: Sequence[str]
) -> None:
    """Write a plan file that `apply plan.json` can execute, secrets redacted (check_plan_file
    compares a fresh plan redacted the same way)."""
    data = {
        "kind": PLAN_FILE_KIND,
        "config": str(config_path.resolve()),
        "config_sha256": config_digest(config_path),
        "selector": dict(selector),
        "devices": list(names),
        "plan": fp.plan.to_dict(),
    }
    out.write_text(redacted_json(data, indent=2, sort_keys=True) + "\n")


def load_plan_file(path: Path) -> dict[str, Any]:
    """Read a plan file. Raises ConfigError when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable plan file ({exc})") from exc
    if not isinstance(data, dict) or data.get("kind") != PLAN_FILE_KIND:
        raise ConfigError(f"{path}: not a plan file written by `sits-deployer plan -o`")
    return data


def config_digest(config_path: Path) -> str:
    """sha256 of deploy.yaml and the inventory it names, as they are on disk now."""
    import yaml

    text = config_path.read_bytes()
    try:
        inventory = (yaml.safe_load(text) or {}).get("fleet", {}).get("inventory")
    except (yaml.YAMLError, AttributeError):
        inventory = None
    parts = [text]
    if isinstance(inventory, str) and (config_path.parent / inventory).is_file():
        parts.append((config_path.parent / inventory).read_bytes())
    return sha256_bytes(b"\0".join(parts))


def check_plan_config(saved: Mapping[str, Any]) -> None:
    """Refuse a saved plan at once when deploy.yaml (or its inventory) changed since it was made."""
    path = Path(saved["config"])
    if saved.get("config_sha256") not in (None, config_digest(path)):
        raise SitsError(
            f"{path} changed since this plan was made; not applying it",
            hint="run `sits-deployer plan -o plan.json` again, review it, then apply the new file",
        )


def check_plan_file(saved: Mapping[str, Any], fresh: FleetPlan) -> None:
    """Refuse a saved plan unless planning now gives exactly it: same facts, same steps."""
    plan = saved["plan"]
    if plan["facts_digest"] != fresh.plan.facts_digest or plan["target_sha256"] != fresh.plan.target_sha256:
        raise SitsError(
            "the fleet changed since this plan was made (facts digest or target differ); not applying it",
            hint="run `sits-deployer plan -o plan.json` again, review it, then apply the new file",
        )
    if json.loads(redacted_json(fresh.plan.to_dict())) != plan:
        raise SitsError(
            "deploy.yaml changed since this plan was made (the steps differ); not applying it",
            hint="run `sits-deployer plan -o plan.json` again, review it, then apply the new file",
        )


# -- status ------------------------------------------------------------------------------------------


def fleet_status(fleet: FleetSession) -> list[dict[str, Any]]:
    """Per device: version, health, edge status and fallbacks over the last 5 minutes (from its
    agent's /metrics; None where the agent has no fallback), and its result in the last apply or
    rollback that touched it."""
    last: dict[str, dict[str, Any]] = {}
    for record in read_audit(fleet.sits_dir):
        for result in record.get("results", []):
            if result.get("status") not in {"unchanged", "not-started"}:
                last[result["device"]] = {"action": record.get("action"), "at": record.get("at"), **result}
    facts = fleet.facts()
    # Each agent's own view: its edge status and the fallbacks of the last 5 minutes (/metrics).
    scraped = run_bounded(
        [f.name for f in facts if f.reachable],
        lambda name: scrape_metrics(fleet.sites[name], fleet.transport(fleet.sites[name])),
        parallel=fleet.parallel,
    )
    metrics = {o.item: o.result for o in scraped if o.result is not None}
    rows = []
    for f in facts:
        health = "offline" if not f.reachable else ("ready" if f.ready else "not ready")
        result = last.get(f.name)
        seen = metrics.get(f.name)
        rows.append(
            {
                "device": f.name,
                "arch": f.arch,
                "version": f.model_version,
                "health": health,
                "agent": f.agent_version,
                "release_counter": f.release_counter,
                "edge_status": seen.edge_status if seen else ("offline" if not f.reachable else None),
                "fallbacks_5m": None if seen is None or seen.fallbacks_5m is None else int(seen.fallbacks_5m),
                "last_result": f"{result['action']} {result['status']} ({result['at']})" if result else None,
                "error": f.error or (result or {}).get("error"),
            }
        )
    return rows
