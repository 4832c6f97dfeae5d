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

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deployer.config.models import Config
from deployer.errors import AgentError, SitsError
from deployer.push.bootstrap import (
    INCOMING,
    agent_running,
    desired_files,
    ensure_serving,
    install_agent,
    install_args,
    prepare_service_user,
    send_release,
    start_agent,
    store_command,
    write_files,
)
from deployer.push.facts import DeviceSite
from deployer.push.health import health_gate, sample, scrape_metrics, serving_version
from deployer.push.hooks import HookContext, Phase, run_phase_hook
from deployer.push.plan import DeviceFacts, DevicePlan, DeviceStatus, Plan, StepKind
from deployer.push.rollout import (
    Wave,
    WaveKind,
    judge,
    make_waves,
    should_halt,
)
from deployer.release.desired import ReleaseFiles
from deployer.transport import Transport, run_bounded

__all__ = ["DeviceResult", "Executor", "RolloutReport"]

VERSIONS_DIR = "/var/lib/sits/versions"  # the agent's verified versions (deployer.agent.store)

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


@dataclass(frozen=True)
class DeviceResult:
    """Where one device ended up. `version` is what it runs afterwards (as far as we know)."""

    device: str
    status: str  # updated unchanged staged failed rolled-back offline skipped blocked not-started
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
        bad = {"failed", "rolled-back", "not-started", "blocked"}
        return not self.halted and not self.interrupted and not any(r.status in bad for r in self.results)

    def to_dict(self) -> dict:
        """JSON-ready form (audit log, `--output json`)."""
        return {**asdict(self), "ok": self.ok}


@dataclass
class _Run:
    """Mutable bookkeeping of one rollout, shared by the worker threads under `lock`."""

    results: dict[str, DeviceResult] = field(default_factory=dict)
    updated: list[str] = field(default_factory=list)
    halted: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, result: DeviceResult) -> None:
        with self.lock:
            self.results[result.device] = result
            if result.status in {"updated", "staged"} and result.device not in self.updated:
                self.updated.append(result.device)

    def failed(self) -> int:
        with self.lock:
            return sum(r.status in {"failed", "rolled-back"} for r in self.results.values())


class _DeviceFailed(SitsError):
    """A step failed on one device; `installed` says whether its new version had been activated."""

    def __init__(self, cause: SitsError, phase: str, installed: bool) -> None:
        super().__init__(cause.message, hint=cause.hint)
        self.phase = phase
        self.installed = installed


class Executor:
    """Executes plans on a fleet through its transports."""

    def __init__(
        self,
        config: Config,
        sites: Mapping[str, DeviceSite],
        connect: Callable[[DeviceSite], Transport],
        *,
        parallel: int = 4,
        on_phase: OnPhase | None = None,
        wheel: Callable[[], Path] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self.sites = sites
        self.connect = connect
        self.parallel = parallel
        self.on_phase = on_phase or (lambda _d, _p, _x: None)
        self.wheel = wheel
        self.sleep = sleep

    # -- the rollout -----------------------------------------------------------------------------

    def run(
        self,
        plan: Plan,
        facts: Mapping[str, DeviceFacts],
        releases: Mapping[str, ReleaseFiles],
        *,
        action: str = "apply",
    ) -> RolloutReport:
        """Execute `plan` under the config's strategy. Never raises for a device's failure.

        `releases` holds the signed release and payload for every device whose plan sends one.
        Raises KeyboardInterrupt after recording (the report is attached as `exc.report`).
        """
        run = _Run()
        strategy = self.config.strategy
        for dp in plan.devices:
            if dp.status is not DeviceStatus.CHANGE:
                status = {"unchanged": "unchanged", "offline": "offline", "blocked": "blocked"}[dp.status]
                run.record(self._result(dp, status, dp.from_version, phase="plan", error=_why(dp)))
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

    def _report(self, plan: Plan, run: _Run, action: str, *, interrupted: bool = False) -> RolloutReport:
        results = tuple(
            run.results.get(dp.device) or self._result(dp, "not-started", dp.from_version)
            for dp in plan.devices
        )
        return RolloutReport(
            action, self.config.strategy.type, plan.target_version, results, run.halted, interrupted
        )

    def _pre_deploy_hooks(self, changing: list[DevicePlan], action: str) -> None:
        phase: Phase = "pre-rollback" if action == "rollback" else "pre-deploy"
        for dp in changing:
            self.on_phase(dp.device, phase, "")
            self._hook(phase, dp)

    def _run_wave(
        self,
        wave: Wave,
        plans: Mapping[str, DevicePlan],
        facts: Mapping[str, DeviceFacts],
        releases: Mapping[str, ReleaseFiles],
        run: _Run,
        action: str,
    ) -> None:
        kinds = {WaveKind.STAGE: STAGE_STEPS, WaveKind.SWITCH: SWITCH_STEPS}.get(wave.kind, DEPLOY_STEPS)

        def job(name: str) -> None:
            if run.halted or (wave.kind is WaveKind.SWITCH and run.results[name].status != "staged"):
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
                sent += self._step(step.kind, dp, site, transport, facts, release, action)
        except SitsError as exc:
            return self._fail(dp, site, transport, _DeviceFailed(exc, phase, installed), action, sent)
        if wave_kind is WaveKind.STAGE:
            self.on_phase(dp.device, "staged", "")
            return self._result(dp, "staged", dp.from_version, phase=phase, sent=sent)
        self.on_phase(dp.device, "done", f"now on {dp.to_version}")
        return self._result(dp, "updated", dp.to_version, phase=phase, sent=sent)

    def _step(
        self,
        kind: StepKind,
        dp: DevicePlan,
        site: DeviceSite,
        transport: Transport,
        facts: DeviceFacts,
        release: ReleaseFiles | None,
        action: str,
    ) -> int:
        """Run one step; return the payload bytes it sent."""
        timeout = self.config.health.readiness_timeout.total_seconds()
        if kind is StepKind.BOOTSTRAP:
            if self.wheel is None:
                raise AgentError(
                    f"{site.name}: the agent is missing or at another version and no wheel is available",
                    hint="run from the source tree, or install sits-deployer in the device's python",
                )
            install_agent(site, transport, self.wheel())
        elif kind is StepKind.WRITE_UNITS:
            changed = write_files(site, transport, desired_files(self.config, site, systemd=facts.systemd))
            if facts.systemd:
                prepare_service_user(site, transport)
            if facts.systemd and any(p.endswith(".service") for p in changed):
                transport.run("systemctl daemon-reload", timeout=60).check(f"{site.name}: daemon-reload")
            if changed and facts.model_version and agent_running(site, transport):
                start_agent(site, transport, systemd=facts.systemd, timeout_s=timeout)
        elif kind in (StepKind.SEND_PATCH, StepKind.SEND_ARTIFACT):
            return send_release(site, transport, _need(release, site))
        elif kind is StepKind.SEND_MANIFEST:
            return transport.put(
                _need(release, site).manifest, site.file(_switch_manifest(release))
            ).bytes_sent
        elif kind is StepKind.INSTALL:
            args = install_args(site, _need(release, site))
            if any(s.kind is StepKind.SEND_MANIFEST for s in dp.steps):
                # The version's verified files are on the device: the agent checks them against
                # the signed manifest and switches its pointer (nothing is staged).
                kept = site.path(f"{VERSIONS_DIR}/{dp.to_version}")
                args = ["--manifest", site.path(_switch_manifest(release)), "--artifact", kept]
            argv = site.agent("install", *args)
            transport.run(store_command(site, argv), timeout=900).check(
                f"{site.name}: sits-agent install {dp.to_version}"
            )
        elif kind is StepKind.RELOAD:
            ensure_serving(site, transport, dp.to_version, systemd=facts.systemd, timeout_s=timeout)
        elif kind is StepKind.HEALTH_GATE:
            health_gate(self.config.health, site, transport, dp.to_version, self.sleep)
        elif kind is StepKind.POST_DEPLOY_HOOK:
            self._hook("post-rollback" if action == "rollback" else "post-deploy", dp)
        return 0

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
                dp, "failed", dp.from_version, phase=failure.phase, error=failure.message, sent=sent
            )
        version = self._roll_back_device(dp, site, transport, action)
        status = "rolled-back" if version == dp.from_version else "failed"
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
            return serving_version(site, transport) or fallback
        except SitsError:
            return fallback

    def _roll_back_updated(self, run: _Run, plans: Mapping[str, DevicePlan], action: str) -> None:
        def job(name: str) -> None:
            dp, old = plans[name], run.results[name]
            if old.status == "staged":  # blue-green: never switched, nothing to undo
                run.record(DeviceResult(**{**asdict(old), "status": "skipped", "version": dp.from_version}))
                return
            site = self.sites[name]
            version = self._roll_back_device(dp, site, self.connect(site), action)
            status = "rolled-back" if version == dp.from_version else "failed"
            run.record(DeviceResult(**{**asdict(old), "status": status, "version": version}))

        run_bounded(list(run.updated), job, parallel=self.parallel)

    # -- analysis (canary) ----------------------------------------------------------------------------

    def _analyse(self, wave: Wave, plans: Mapping[str, DevicePlan], run: _Run, limit: int) -> None:
        if not wave.analysis_s:
            return
        names = [n for n in wave.devices if run.results.get(n) and run.results[n].status == "updated"]
        before = {n: scrape_metrics(self.sites[n], self.connect(self.sites[n])) for n in names}
        self.sleep(wave.analysis_s)
        for name in names:
            site = self.sites[name]
            transport = self.connect(site)
            self.on_phase(name, "analysis", f"{wave.analysis_s:g}s window")
            reason = judge(
                sample(self.config.health, site, transport, before[name]),
                latency_budget_ms=self.config.health.latency_budget_ms,
            )
            if reason is not None:
                failure = _DeviceFailed(AgentError(f"{name}: analysis failed: {reason}"), "analysis", True)
                run.record(
                    self._fail(plans[name], site, transport, failure, "apply", run.results[name].bytes_sent)
                )
        if should_halt(run.failed(), limit):
            run.halted = f"canary analysis: {run.failed()} device(s) failed, threshold is {limit}"

    # -- helpers ---------------------------------------------------------------------------------

    def _hook(self, phase: Phase, dp: DevicePlan) -> None:
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
        result = run_phase_hook(self.config, context)
        if result is not None and result.output.strip():  # shown with -v (a failure's error holds it)
            self.on_phase(dp.device, f"{phase} output", result.output)

    def _result(
        self,
        dp: DevicePlan,
        status: str,
        version: str | None,
        *,
        phase: str = "",
        error: str | None = None,
        sent: int = 0,
    ) -> DeviceResult:
        return DeviceResult(dp.device, status, dp.from_version, dp.to_version, version, phase, error, sent)


def _switch_manifest(release: ReleaseFiles | None) -> str:
    """Where a pointer switch's manifest goes on the device."""
    return f"{INCOMING}/{release.counter if release else 0}/release.json"


def _need(release: ReleaseFiles | None, site: DeviceSite) -> ReleaseFiles:
    if release is None:
        raise AgentError(f"{site.name}: the plan sends a payload but no release was prepared for it")
    return release


def _why(dp: DevicePlan) -> str | None:
    return None if dp.status is DeviceStatus.UNCHANGED else dp.reason
