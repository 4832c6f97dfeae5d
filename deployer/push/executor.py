"""Run a Plan's steps on the devices, wave by wave, and report what each device ended up with.

The executor walks the waves `deployer.push.rollout` makes, runs at most `parallel` devices at once
(`deployer.transport.run_bounded`), and tells `on_phase(device, phase, detail)` about every step
(the CLI draws live progress from it). On each device the agent installs atomically, so a device is
always on its old or its new version; a device that fails after its install (health gate, analysis,
post-deploy hook) is rolled back to the version it had. When failures reach the strategy's threshold
the rollout halts, devices not yet started are left alone, and (with `auto_rollback`) every device
this rollout updated is rolled back. Ctrl-C stops new devices from starting, lets running ones
finish their current device, and the report (and so the audit log) records where each one is.
"""

from __future__ import annotations

import enum
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path, PurePosixPath

from deployer.config.models import Config
from deployer.core.hashing import sha256_bytes
from deployer.errors import AgentError, SitsError
from deployer.push.agent_control import AgentControl, RemoteAgent
from deployer.push.bootstrap import (
    SERVICE_USER,
    desired_files,
    install_agent,
    prepare_service_user,
    store_command,
)
from deployer.push.facts import DeviceSite
from deployer.push.fallback_files import SECRET_FILES, put_secret
from deployer.push.hooks import PHASES, HookContext, HookPhase, HookResult, run_phase_hook
from deployer.push.plan import (
    ADAPTER_RELEASE,
    GENERATED,
    RELEASE_COUNTER,
    RELEASE_MANIFEST,
    Action,
    ActionKind,
    DeviceFacts,
    DevicePlan,
    DeviceStatus,
    Plan,
    StepKind,
)
from deployer.push.rollout import (
    MetricsSnapshot,
    Wave,
    WaveKind,
    judge,
    make_waves,
    should_halt,
)
from deployer.release.desired import ReleaseFiles
from deployer.transport import Transport, run_bounded
from deployer.transport.base import Progress

__all__ = ["DeviceResult", "Executor", "HookRunner", "ResultStatus", "RolloutReport"]

STAGE_STEPS = frozenset(
    {
        StepKind.BOOTSTRAP,
        StepKind.WRITE_UNITS,
        StepKind.SEND_PATCH,
        StepKind.SEND_ARTIFACT,
        StepKind.SEND_MANIFEST,
    }
)
SWITCH_STEPS = frozenset(set(StepKind) - STAGE_STEPS - {StepKind.PRE_DEPLOY_HOOK})
DEPLOY_STEPS = STAGE_STEPS | SWITCH_STEPS
OnPhase = Callable[[str, str, str], None]
# (device, file name) -> the progress callback of that file's upload (rate and ETA for the CLI).
MeterFactory = Callable[[str, str], Progress]
# Runs deploy.yaml's hook for context.phase (None: no hook configured); raises HookError.
HookRunner = Callable[[HookContext], HookResult | None]


class ResultStatus(enum.StrEnum):
    """Where a device ended up after a rollout (the planner's verdict is plan.DeviceStatus)."""

    UPDATED = "updated"
    UNCHANGED = "unchanged"
    STAGED = "staged"  # blue-green: payload on the device, not switched (yet)
    FAILED = "failed"
    ROLLED_BACK = "rolled-back"
    OFFLINE = "offline"
    SKIPPED = "skipped"  # offline and skipped by strategy.offline, or staged and never switched
    BLOCKED = "blocked"
    NOT_STARTED = "not-started"


# Statuses that make a rollout not ok, and those that count toward the failure threshold.
_NOT_OK = frozenset(
    {ResultStatus.FAILED, ResultStatus.ROLLED_BACK, ResultStatus.NOT_STARTED, ResultStatus.BLOCKED}
)
_FAILURES = frozenset({ResultStatus.FAILED, ResultStatus.ROLLED_BACK})
_PLANNED = {
    DeviceStatus.UNCHANGED: ResultStatus.UNCHANGED,
    DeviceStatus.OFFLINE: ResultStatus.OFFLINE,
    DeviceStatus.BLOCKED: ResultStatus.BLOCKED,
}


@dataclass(frozen=True)
class DeviceResult:
    """Where one device ended up. `version` is what it runs afterwards (as far as we know)."""

    device: str
    status: ResultStatus
    from_version: str | None
    to_version: str
    version: str | None
    phase: str = ""  # the last phase reached
    error: str | None = None
    bytes_sent: int = 0


@dataclass(frozen=True)
class RolloutReport:
    """The outcome of one apply or rollback, as the audit log records it."""

    action: str
    strategy: str
    target_version: str
    results: tuple[DeviceResult, ...]
    halted: str | None = None  # why the rollout stopped early
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        """No device failed, nothing halted, not interrupted."""
        return not self.halted and not self.interrupted and not any(r.status in _NOT_OK for r in self.results)

    @property
    def exit_code(self) -> int:
        """The command's exit status: 0 when ok, 130 when interrupted (as for Ctrl-C), else 1."""
        if self.interrupted:
            return 130
        return 0 if self.ok else 1

    def to_dict(self) -> dict:
        """JSON-ready form (audit log, `--output json`)."""
        return {**asdict(self), "ok": self.ok}


@dataclass
class _RolloutProgress:
    """Mutable bookkeeping of one rollout, shared by the worker threads under `lock`."""

    results: dict[str, DeviceResult] = field(default_factory=dict)
    updated: list[str] = field(default_factory=list)  # devices this rollout changed, in order
    halted: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, result: DeviceResult) -> None:
        with self.lock:
            self.results[result.device] = result
            touched = result.status in {ResultStatus.UPDATED, ResultStatus.STAGED}
            if touched and result.device not in self.updated:
                self.updated.append(result.device)

    def failed(self) -> int:
        with self.lock:
            return sum(r.status in _FAILURES for r in self.results.values())


class _DeviceFailed(SitsError):
    """A step failed on one device; `installed` says whether its new version had been activated."""

    def __init__(self, cause: SitsError, phase: str, installed: bool) -> None:
        super().__init__(cause.message, hint=cause.hint)
        self.phase = phase
        self.installed = installed


class Executor:
    """Executes plans on a fleet through its transports.

    The device I/O beyond the plan's own actions comes through narrow seams, so that tests run the
    executor against a simulated fleet: `connect` (a transport per device), `agent` (start/reload,
    health gate, metrics; default RemoteAgent), `hooks` (deploy.yaml's hooks; default
    run_phase_hook) and `sleep` (analysis windows and pauses; the health gate's polling too).
    """

    def __init__(
        self,
        config: Config,
        sites: Mapping[str, DeviceSite],
        connect: Callable[[DeviceSite], Transport],
        *,
        parallel: int = 4,
        on_phase: OnPhase | None = None,
        meter: MeterFactory | None = None,
        wheel: Callable[[], Path] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        agent: AgentControl | None = None,
        hooks: HookRunner | None = None,
    ) -> None:
        self.config = config
        self.sites = sites
        self.connect = connect
        self.parallel = parallel
        self.on_phase = on_phase or (lambda _d, _p, _x: None)
        self.meter = meter
        self.wheel = wheel
        self.sleep = sleep
        self.agent: AgentControl = agent or RemoteAgent(config.health, sleep)
        self.hooks: HookRunner = hooks or (lambda context: run_phase_hook(config, context))
        self.adapter_releases: Mapping[str, Mapping[str, Path]] = {}

    # -- the rollout -----------------------------------------------------------------------------

    def run(
        self,
        plan: Plan,
        facts: Mapping[str, DeviceFacts],
        releases: Mapping[str, ReleaseFiles],
        *,
        action: str = "apply",
        adapter_releases: Mapping[str, Mapping[str, Path]] | None = None,
    ) -> RolloutReport:
        """Execute `plan` under the config's strategy. Never raises for a device's failure.

        `releases` holds the signed release and payload for every device whose plan sends one;
        `adapter_releases` the signed adapter release manifest by device, then adapter name.
        Raises KeyboardInterrupt after recording (the report is attached as `exc.report`).
        """
        run = _RolloutProgress()
        self.adapter_releases = adapter_releases or {}
        strategy = self.config.strategy
        for dp in plan.devices:
            if dp.status is not DeviceStatus.CHANGE:
                run.record(
                    self._result(dp, _PLANNED[dp.status], dp.from_version, phase="plan", error=_why(dp))
                )
        changing = [dp for dp in plan.devices if dp.status is DeviceStatus.CHANGE]
        by_name = {dp.device: dp for dp in changing}
        try:
            self._pre_deploy_hooks(changing, action)
            limit = strategy.failure_limit(len(changing))
            for wave in make_waves(strategy, [dp.device for dp in changing]):
                self._run_wave(wave, by_name, facts, releases, run, action)
                if wave.kind is WaveKind.STAGE and run.failed():
                    run.halted = "blue-green: a device failed to stage; no device was switched"
                elif should_halt(run.failed(), limit):
                    run.halted = f"{run.failed()} device(s) failed, threshold is {limit}"
                if run.halted:
                    break
                self._analyse(wave, by_name, run, limit)
                if run.halted:
                    break
                if wave.pause_s:
                    self.sleep(wave.pause_s)
            if run.halted and strategy.auto_rollback:
                self._roll_back_updated(run, by_name, action)
        except KeyboardInterrupt as exc:
            report = self._report(plan, run, action, interrupted=True)
            exc.report = report  # type: ignore[attr-defined]
            raise
        except SitsError as exc:  # a pre-deploy hook: nothing was changed
            run.halted = exc.message
        return self._report(plan, run, action)

    def _report(
        self, plan: Plan, run: _RolloutProgress, action: str, *, interrupted: bool = False
    ) -> RolloutReport:
        results = tuple(
            run.results.get(dp.device) or self._result(dp, ResultStatus.NOT_STARTED, dp.from_version)
            for dp in plan.devices
        )
        return RolloutReport(
            action, self.config.strategy.type, plan.target_version, results, run.halted, interrupted
        )

    def _pre_deploy_hooks(self, changing: list[DevicePlan], action: str) -> None:
        """Every device's pre-hook steps, before any device changes (one failure halts all)."""
        for dp in changing:
            for step in dp.steps:
                if step.kind is StepKind.PRE_DEPLOY_HOOK:
                    for act in step.actions:
                        self.on_phase(dp.device, act.target, "")
                        self._hook(_hook_phase(act.target), dp)

    def _run_wave(
        self,
        wave: Wave,
        plans: Mapping[str, DevicePlan],
        facts: Mapping[str, DeviceFacts],
        releases: Mapping[str, ReleaseFiles],
        run: _RolloutProgress,
        action: str,
    ) -> None:
        kinds = {WaveKind.STAGE: STAGE_STEPS, WaveKind.SWITCH: SWITCH_STEPS}.get(wave.kind, DEPLOY_STEPS)

        def job(name: str) -> None:
            if run.halted or (
                wave.kind is WaveKind.SWITCH and run.results[name].status != ResultStatus.STAGED
            ):
                return
            dp = plans[name]
            run.record(self._device(dp, facts[name], releases.get(name), kinds, wave.kind, action))

        parallel = min(self.parallel, wave.parallel or self.parallel)
        run_bounded(wave.devices, job, parallel=parallel)

    # -- one device -------------------------------------------------------------------------------

    def _device(
        self,
        dp: DevicePlan,
        facts: DeviceFacts,
        release: ReleaseFiles | None,
        kinds: frozenset[StepKind],
        wave_kind: WaveKind,
        action: str,
    ) -> DeviceResult:
        site = self.sites[dp.device]
        transport = self.connect(site)
        sent, installed, phase = 0, False, ""
        try:
            for step in dp.steps:
                if step.kind not in kinds:
                    continue
                phase = step.kind.value
                self.on_phase(dp.device, phase, step.reason)
                if step.kind is StepKind.INSTALL:
                    installed = True  # from here on, a failure may leave the new version active
                if not step.actions:
                    raise AgentError(
                        f"{site.name}: the plan's {phase} step has no actions (a plan without a recipe)"
                    )
                for act in step.actions:
                    sent += self._act(act, dp, site, transport, facts, release)
        except SitsError as exc:
            return self._fail(dp, site, transport, _DeviceFailed(exc, phase, installed), action, sent)
        if wave_kind is WaveKind.STAGE:
            self.on_phase(dp.device, "staged", "")
            return self._result(dp, ResultStatus.STAGED, dp.from_version, phase=phase, sent=sent)
        self.on_phase(dp.device, "done", f"now on {dp.to_version}")
        return self._result(dp, ResultStatus.UPDATED, dp.to_version, phase=phase, sent=sent)

    def _act(
        self,
        act: Action,
        dp: DevicePlan,
        site: DeviceSite,
        transport: Transport,
        facts: DeviceFacts,
        release: ReleaseFiles | None,
    ) -> int:
        """Run one action of the plan, as `plan -v` printed it; return the payload bytes it sent."""
        if RELEASE_COUNTER in act.target or act.source == RELEASE_MANIFEST:
            act = act.for_release(_need(release, site).counter)
        if act.kind is ActionKind.PUT:
            return self._put(act, site, transport, facts, release)
        if act.kind is ActionKind.RUN:
            transport.run(act.target, timeout=act.timeout_s).check(act.what or f"{site.name}: {act.target}")
        elif act.kind is ActionKind.HOOK:
            self._hook(_hook_phase(act.target), dp)
        else:
            self._call(act.target, dp, site, transport, facts)
        return 0

    def _put(
        self,
        act: Action,
        site: DeviceSite,
        transport: Transport,
        facts: DeviceFacts,
        release: ReleaseFiles | None,
    ) -> int:
        progress = self.meter(site.name, PurePosixPath(act.target).name) if self.meter else None
        if act.source == RELEASE_MANIFEST:
            manifest = _need(release, site).manifest
            return transport.put(manifest, site.file(act.target), progress=progress).bytes_sent
        if act.source == ADAPTER_RELEASE:  # uploaded to incoming/adapters/<name>/release.json
            name = PurePosixPath(act.target).parent.name
            signed = self.adapter_releases.get(site.name, {}).get(name)
            if signed is None:
                raise AgentError(f"{site.name}: no adapter release of {name} was signed for this device")
            return transport.put(signed, site.file(act.target), progress=progress).bytes_sent
        if act.source != GENERATED:
            return transport.put(Path(act.source), site.file(act.target), progress=progress).bytes_sent
        data = desired_files(self.config, site, systemd=facts.systemd).get(act.target)
        if data is None or sha256_bytes(data) != act.sha256:
            raise AgentError(
                f"{site.name}: {act.target} would differ from the plan (deploy.yaml or a key changed)",
                hint="run `sits-deployer plan` again and apply the new plan",
            )
        with tempfile.TemporaryDirectory(prefix="sits-files-") as tmp:
            local = Path(tmp) / "file"
            local.write_bytes(data)
            if act.target in SECRET_FILES:
                return put_secret(site, transport, local, act.target, SERVICE_USER)
            return transport.put(local, site.file(act.target)).bytes_sent

    def _call(
        self, name: str, dp: DevicePlan, site: DeviceSite, transport: Transport, facts: DeviceFacts
    ) -> None:
        """The named operations of deployer.push.operations.CALLS."""
        if name == "install-agent":
            if self.wheel is None:
                raise AgentError(
                    f"{site.name}: the agent is missing or at another version and no wheel is available",
                    hint="run from the source tree, or install sits-agent in the device's python",
                )
            install_agent(site, transport, self.wheel())
        elif name == "prepare-service-user":
            prepare_service_user(site, transport)
        elif name == "restart-if-running":
            self.agent.restart_if_running(site, transport, systemd=facts.systemd)
        elif name == "ensure-serving":
            self.agent.ensure_serving(site, transport, dp.to_version, systemd=facts.systemd)
        elif name == "health-gate":
            self.agent.health_gate(site, transport, dp.to_version)
        else:
            raise AgentError(f"{site.name}: the plan names an unknown operation {name!r}")

    def _fail(
        self,
        dp: DevicePlan,
        site: DeviceSite,
        transport: Transport,
        failure: _DeviceFailed,
        action: str,
        sent: int,
    ) -> DeviceResult:
        self.on_phase(dp.device, "failed", f"{failure.phase}: {failure.message}")
        if not failure.installed:
            return self._result(
                dp,
                ResultStatus.FAILED,
                dp.from_version,
                phase=failure.phase,
                error=failure.message,
                sent=sent,
            )
        version = self._roll_back_device(dp, site, transport, action)
        status = ResultStatus.ROLLED_BACK if version == dp.from_version else ResultStatus.FAILED
        return self._result(dp, status, version, phase=failure.phase, error=failure.message, sent=sent)

    # -- rollback of devices ------------------------------------------------------------------------

    def _roll_back_device(
        self, dp: DevicePlan, site: DeviceSite, transport: Transport, action: str
    ) -> str | None:
        """Return a device to `dp.from_version`; return the version it runs afterwards."""
        if dp.from_version is None:
            return self._installed_version(site, transport, dp.to_version)
        self.on_phase(dp.device, "rollback", f"back to {dp.from_version}")
        try:
            if action != "rollback":
                self._hook("pre-rollback", dp)
            argv = site.agent("rollback", "--to", dp.from_version)
            transport.run(store_command(site, argv), timeout=900).check(
                f"{site.name}: sits-agent rollback --to {dp.from_version}"
            )
            if action != "rollback":
                self._hook("post-rollback", dp)
        except SitsError as exc:
            self.on_phase(dp.device, "rollback-failed", exc.message)
        return self._installed_version(site, transport, dp.to_version)

    def _installed_version(self, site: DeviceSite, transport: Transport, fallback: str | None) -> str | None:
        try:
            return self.agent.serving_version(site, transport) or fallback
        except SitsError:
            return fallback

    def _roll_back_updated(self, run: _RolloutProgress, plans: Mapping[str, DevicePlan], action: str) -> None:
        def job(name: str) -> None:
            dp, old = plans[name], run.results[name]
            if old.status == ResultStatus.STAGED:  # blue-green: never switched, nothing to undo
                run.record(replace(old, status=ResultStatus.SKIPPED, version=dp.from_version))
                return
            site = self.sites[name]
            version = self._roll_back_device(dp, site, self.connect(site), action)
            status = ResultStatus.ROLLED_BACK if version == dp.from_version else ResultStatus.FAILED
            run.record(replace(old, status=status, version=version))

        run_bounded(list(run.updated), job, parallel=self.parallel)

    # -- analysis (canary) ----------------------------------------------------------------------------

    def _analyse(
        self, wave: Wave, plans: Mapping[str, DevicePlan], run: _RolloutProgress, limit: int
    ) -> None:
        if not wave.analysis_s:
            return
        names = [
            n for n in wave.devices if n in run.results and run.results[n].status == ResultStatus.UPDATED
        ]
        # The devices not yet updated are the baseline of the fallback rate, in the same window.
        baseline = [n for n in plans if n not in run.results]
        before = {n: self.agent.scrape(self.sites[n], self.connect(self.sites[n])) for n in names + baseline}
        self.sleep(wave.analysis_s)
        baseline_rate = _pooled_fallback_rate(
            [(before[n], self.agent.scrape(self.sites[n], self.connect(self.sites[n]))) for n in baseline]
        )
        for name in names:
            site = self.sites[name]
            transport = self.connect(site)
            self.on_phase(name, "analysis", f"{wave.analysis_s:g}s window")
            reason = judge(
                self.agent.sample(site, transport, before[name]),
                latency_budget_ms=self.config.health.latency_budget_ms,
                baseline_fallback_rate=baseline_rate,
            )
            if reason is not None:
                failure = _DeviceFailed(AgentError(f"{name}: analysis failed: {reason}"), "analysis", True)
                run.record(
                    self._fail(plans[name], site, transport, failure, "apply", run.results[name].bytes_sent)
                )
        if should_halt(run.failed(), limit):
            run.halted = f"canary analysis: {run.failed()} device(s) failed, threshold is {limit}"

    # -- helpers ---------------------------------------------------------------------------------

    def _hook(self, phase: HookPhase, dp: DevicePlan) -> None:
        site = self.sites[dp.device]
        context = HookContext(
            phase=phase,
            device=dp.device,
            host=site.host,
            to_version=dp.to_version,
            from_version=dp.from_version,
            application=self.config.application,
            namespace=self.config.namespace,
        )
        result = self.hooks(context)
        if result is not None and result.output.strip():  # shown with -v (a failure's error holds it)
            self.on_phase(dp.device, f"{phase} output", result.output)

    def _result(
        self,
        dp: DevicePlan,
        status: ResultStatus,
        version: str | None,
        *,
        phase: str = "",
        error: str | None = None,
        sent: int = 0,
    ) -> DeviceResult:
        return DeviceResult(dp.device, status, dp.from_version, dp.to_version, version, phase, error, sent)


def _pooled_fallback_rate(windows: list[tuple[MetricsSnapshot, MetricsSnapshot]]) -> float | None:
    """The share of answers the fallback upstream gave over these (before, after) scrapes together;
    None when they answered nothing."""
    answers = sum(after.answers - before.answers for before, after in windows)
    fallbacks = sum(after.fallbacks - before.fallbacks for before, after in windows)
    return fallbacks / answers if answers > 0 else None


def _need(release: ReleaseFiles | None, site: DeviceSite) -> ReleaseFiles:
    if release is None:
        raise AgentError(f"{site.name}: the plan sends a payload but no release was prepared for it")
    return release


def _why(dp: DevicePlan) -> str | None:
    return None if dp.status is DeviceStatus.UNCHANGED else dp.reason


def _hook_phase(name: str) -> HookPhase:
    """A plan's hook phase name as the hooks module types it (the plan holds plain strings)."""
    phases: dict[str, HookPhase] = {p: p for p in PHASES}
    if name not in phases:
        raise AgentError(f"the plan names an unknown hook phase {name!r}")
    return phases[name]
