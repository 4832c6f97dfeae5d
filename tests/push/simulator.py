"""A simulated fleet for executor tests, in the spirit of python-tuf's RepositorySimulator.

This is a fake, on purpose: a fleet of 5-50 devices with scripted faults (an install that fails on
dev3, a slow smoke test on dev2, dev5 offline, metrics that report 20% errors, a connection that
drops after N bytes) cannot exist in a unit test. The lab tests (tests/fleet/*_lab.py) stay the
end-to-end layer with real agents over real SSH.

What is simulated is the device end of the executor's seams, so the executor, the planner, the
recipe of commands and the transport's put (resume, verify, rename) all run for real:

    SimTransport   the Transport interface in memory: files in a dict, and `run` understands
                   the commands the recipe writes (sits-agent install / rollback, daemon-reload);
                   any other command exits 127, so a recipe change the simulator does not know
                   fails loudly
    SimAgent       AgentControl: serving version, start/reload, the health gate, metrics samples
    SimHooks       the hook runner: records each call, prints a line, fails where scripted
    FakeClock      the executor's sleep: records each wait, can raise KeyboardInterrupt (Ctrl-C)

Every device event goes into one ordered log (`SimFleet.events`), which is what wave-order tests read.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployer.config.models import Config, Health
from deployer.errors import AgentError, HookError, TransportError
from deployer.push.bootstrap import desired_files
from deployer.push.executor import Executor
from deployer.push.facts import DeviceSite
from deployer.push.fleet import FleetPlan, FleetSession, make_fleet_plan
from deployer.push.hooks import HookContext, HookResult
from deployer.push.operations import VERSIONS_DIR
from deployer.push.plan import DeviceFacts, DevicePlatform
from deployer.push.rollout import MetricsSnapshot, Sample
from deployer.release.desired import Desired, ReleaseFiles
from deployer.transport.base import ConnectionDropped, RetryPolicy, RunResult, Transport

AGENT_VERSION = "0.1.0"


@dataclass
class Script:
    """The faults of one simulated device."""

    offline: bool = False
    install_fails: bool = False
    smoke_ms: float = 50.0
    error_rate: float = 0.0  # share of 5xx answers among the requests of an analysis window
    drop_after: int | None = None  # a put's connection drops after this many bytes...
    drops: int = 1  # ...this many times (more than the transport's attempts: the put fails)
    hook_fails: frozenset[str] = frozenset()  # hook phases that exit non-zero for this device


@dataclass
class SimDevice:
    """One device: what it runs, its files (by device path), and its script."""

    name: str
    version: str | None
    sha256: str | None
    root: str
    counter: int = 0
    script: Script = field(default_factory=Script)
    files: dict[str, bytearray] = field(default_factory=dict)
    serving: str | None = None
    previous: tuple[str | None, str | None] = (None, None)
    kept: dict[str, str] = field(default_factory=dict)  # the versions on its disk: sha256 -> version
    requests: float = 0.0
    errors: float = 0.0
    answers: float = 0.0  # generation requests, and those its fallback upstream answered
    fallbacks: float = 0.0
    arch: str = "x86_64"  # its CPU now
    wheels_arch: str | None = "x86_64"  # the CPU its agent's wheels were installed for

    def metrics(self) -> MetricsSnapshot:
        """What its /metrics would say now."""
        return MetricsSnapshot(self.requests, self.errors, self.answers, self.fallbacks)

    def facts(self, unit_hashes: dict[str, str]) -> DeviceFacts:
        """What the facts probe would report."""
        if self.script.offline:
            return DeviceFacts(self.name, reachable=False, error=f"{self.name}: connection timed out")
        return DeviceFacts(
            name=self.name,
            reachable=True,
            agent_version=AGENT_VERSION,
            model_version=self.version,
            model_sha256=self.sha256,
            release_counter=self.counter,
            free_disk_bytes=10**12,
            unit_hashes=unit_hashes,
            ready=self.serving == self.version and self.version is not None,
            stored_artifacts=dict(self.kept),
            platform=DevicePlatform("3.11", "cpython", self.arch, "glibc", "2.36"),
            wheels_arch=self.wheels_arch,
        )


class SimTransport(Transport):
    """The Transport interface on a SimDevice's in-memory files."""

    def __init__(self, fleet: SimFleet, device: SimDevice) -> None:
        self.fleet = fleet
        self.device = device
        self.label = device.name
        self.retry = RetryPolicy(attempts=3, base_delay_s=0.0, max_delay_s=0.0)  # no real waits
        self.connected_bytes = 0

    def _reach(self) -> None:
        if self.device.script.offline:
            raise TransportError(f"{self.device.name}: connection timed out")

    def run(self, cmd: str | Sequence[str], timeout: float = 60.0) -> RunResult:
        """Understand the recipe's device commands; anything else exits 127."""
        self._reach()
        command = cmd if isinstance(cmd, str) else shlex.join(cmd)
        self.fleet.log(self.device.name, "run", command)
        if command == "systemctl daemon-reload":
            return RunResult(0, "", "")
        argv = shlex.split(command)
        if "deployer.agent.cli" in argv:
            sub = argv[argv.index("deployer.agent.cli") + 1]
            if sub == "install":
                return self._install(argv)
            if sub == "rollback":
                return self._rollback(argv[argv.index("--to") + 1])
        return RunResult(127, "", f"sim: unknown command {command!r}")

    def _device_path(self, path: str) -> str:
        return path.removeprefix(self.device.root)

    def _install(self, argv: list[str]) -> RunResult:
        device = self.device
        manifest = self._device_path(argv[argv.index("--manifest") + 1])
        payload_flag = "--patch" if "--patch" in argv else "--artifact"
        payload = self._device_path(argv[argv.index(payload_flag) + 1])
        kept = payload.removeprefix(f"{VERSIONS_DIR}/") if payload.startswith(VERSIONS_DIR) else None
        uploaded = any(p.startswith(payload) for p in device.files)
        if manifest not in device.files or not (uploaded or kept in device.kept.values()):
            return RunResult(2, "", f"sim: {manifest} or {payload} was not uploaded")
        if device.script.install_fails:
            self.fleet.log(device.name, "install-failed", "")
            return RunResult(1, "", "sim: install failed (scripted)")
        release = json.loads(bytes(device.files[manifest]))
        device.previous = (device.version, device.sha256)
        device.version, device.sha256 = release["version"], release["artifact_sha256"]
        device.kept[device.sha256] = device.version  # the agent keeps the versions it verified
        device.counter = release["counter"]
        device.serving = device.version  # the agent hot-swaps after its install
        self.fleet.log(device.name, "installed", device.version)
        return RunResult(0, "", "")

    def _rollback(self, to: str) -> RunResult:
        device = self.device
        if device.version == to:  # e.g. after a failed install: already there
            return RunResult(0, "", "")
        if device.previous[0] != to:
            return RunResult(1, "", f"sim: {to} is not the previous version")
        device.version, device.sha256 = device.previous
        device.serving = device.version
        self.fleet.log(device.name, "rolled-back", to)
        return RunResult(0, "", "")

    def close(self) -> None:
        """Nothing to release."""

    def _size(self, remote_path: str) -> int | None:
        self._reach()
        data = self.device.files.get(remote_path)
        return None if data is None else len(data)

    def _remote_sha256(self, remote_path: str, length: int | None = None) -> str | None:
        self._reach()
        data = self.device.files.get(remote_path)
        return None if data is None else hashlib.sha256(bytes(data[:length])).hexdigest()

    def _write(
        self, local_path: Path, remote_path: str, offset: int, on_bytes: Callable[[int], None]
    ) -> None:
        self._reach()
        data = local_path.read_bytes()[offset:]
        target = self.device.files.setdefault(remote_path, bytearray())
        del target[offset:]
        script = self.device.script
        if script.drop_after is not None and script.drops > 0 and len(data) > script.drop_after:
            script.drops -= 1
            target += data[: script.drop_after]
            on_bytes(script.drop_after)
            self.fleet.log(self.device.name, "dropped", remote_path)
            raise ConnectionDropped(f"{self.device.name}: connection reset after {script.drop_after} bytes")
        target += data
        on_bytes(len(data))

    def _read(self, remote_path: str, local_path: Path) -> None:
        local_path.write_bytes(bytes(self.device.files[remote_path]))

    def _rename(self, src: str, dst: str) -> None:
        self.device.files[dst] = self.device.files.pop(src)
        self.fleet.log(self.device.name, "put", dst)

    def _remove(self, remote_path: str) -> None:
        self.device.files.pop(remote_path, None)

    def _makedirs(self, remote_dir: str) -> None:
        self._reach()


@dataclass
class SimAgent:
    """AgentControl for simulated devices (deployer.push.agent_control)."""

    fleet: SimFleet
    health: Health

    def _device(self, site: DeviceSite) -> SimDevice:
        device = self.fleet.devices[site.name]
        if device.script.offline:
            raise TransportError(f"{site.name}: connection timed out")
        return device

    def serving_version(self, site: DeviceSite, transport: Transport) -> str | None:
        """See AgentControl."""
        return self._device(site).serving

    def ensure_serving(self, site: DeviceSite, transport: Transport, version: str, *, systemd: bool) -> None:
        """See AgentControl."""
        device = self._device(site)
        if device.version != version:
            raise AgentError(f"{site.name}: installed {device.version}, cannot serve {version}")
        device.serving = version

    def restart_if_running(self, site: DeviceSite, transport: Transport, *, systemd: bool) -> None:
        """See AgentControl."""
        self.fleet.log(site.name, "restarted", "")

    def health_gate(self, site: DeviceSite, transport: Transport, version: str) -> float:
        """See AgentControl: the scripted smoke latency against the real budget."""
        device = self._device(site)
        self.fleet.log(site.name, "health-gate", version)
        if device.serving != version:
            raise AgentError(f"{site.name}: not ready on {version}")
        if device.script.smoke_ms > self.health.latency_budget_ms:
            raise AgentError(
                f"{site.name}: smoke prompt took {device.script.smoke_ms:.0f} ms, "
                f"over the {self.health.latency_budget_ms} ms budget"
            )
        return device.script.smoke_ms

    def scrape(self, site: DeviceSite, transport: Transport) -> MetricsSnapshot:
        """See AgentControl."""
        return self._device(site).metrics()

    def sample(self, site: DeviceSite, transport: Transport, before: MetricsSnapshot) -> Sample:
        """See AgentControl: 100 requests served in the window, `error_rate` of them 5xx."""
        device = self._device(site)
        device.requests += 100
        device.errors += 100 * device.script.error_rate
        self.fleet.log(site.name, "analysed", "")
        after = device.metrics()
        return Sample(site.name, device.serving is not None, device.script.smoke_ms, before, after)


@dataclass
class SimHooks:
    """The hook runner: records (phase, device) and fails where a device's script says so."""

    fleet: SimFleet

    def __call__(self, context: HookContext) -> HookResult:
        self.fleet.log(context.device, "hook", context.phase)
        if context.phase in self.fleet.devices[context.device].script.hook_fails:
            raise HookError(
                f"hook {context.phase} exited with status 3 for {context.device}",
                phase=context.phase,
                path=Path("hooks/check.sh"),
                returncode=3,
            )
        output = f"{context.phase}: checked {context.device}\n"
        return HookResult(context.phase, Path("hooks/check.sh"), 0, output, 0.0)


@dataclass
class FakeClock:
    """The executor's sleep: records every wait; raises KeyboardInterrupt at wait number `interrupt_at`."""

    fleet: SimFleet
    waits: list[float] = field(default_factory=list)
    interrupt_at: int | None = None

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.fleet.log("-", "sleep", f"{seconds:g}")
        self.fleet.traffic()
        if self.interrupt_at is not None and len(self.waits) == self.interrupt_at:
            raise KeyboardInterrupt


class SimFleet:
    """Devices dev1..devN on version 1.0.0, a target 2.0.0 (with a patch from 1.0.0), and the seams."""

    def __init__(
        self, tmp: Path, size: int = 5, *, strategy: dict[str, Any] | None = None, **doc: Any
    ) -> None:
        self.tmp = tmp
        self.lock = threading.Lock()
        # Per model version, the share of answers its devices leave to the fallback upstream.
        self.fallback_rates: dict[str, float] = {}
        self.events: list[tuple[str, str, str]] = []
        names = [f"dev{i}" for i in range(1, size + 1)]
        self.config = Config.model_validate(
            {
                "apiVersion": "sits.dev/v1",
                "kind": "Deployment",
                "application": "sim",
                "model": {
                    "name": "tiny",
                    "version": "2.0.0",
                    "source": "x",
                    "quantization": {"scheme": "int8"},
                },
                "fleet": {
                    "devices": [
                        {"name": n, "transport": "local", "root": f"/sim/{n}", "python": "python3"}
                        for n in names
                    ]
                },
                "strategy": strategy or {"type": "all-at-once"},
                "health": {"latency_budget_ms": 1000, "smoke_prompts": ["Hi"]},
                # Never read: the releases are stand-ins; apply refuses to send without a key.
                "signing": {"private_key": "keys/release.key"},
                **doc,
            }
        )
        # The loader sets where deploy.yaml lives; here it is the test's directory, so `.sits/`
        # (lock, audit log) is written there.
        self.config._path = tmp / "deploy.yaml"
        self.session = FleetSession.select(self.config, connect=self._connect)
        self.v1 = self._artifact("1.0.0")
        self.target = self._artifact("2.0.0")
        self.patch = tmp / "v1-v2.patch"
        self.patch.write_bytes(b"P" * 4096)
        self.devices = {
            n: SimDevice(
                n,
                "1.0.0",
                self.v1.artifact_sha256,
                self.session.sites[n].root,
                serving="1.0.0",
                kept={self.v1.artifact_sha256: "1.0.0"},
            )
            for n in names
        }
        self.transports = {n: SimTransport(self, d) for n, d in self.devices.items()}
        self.agent = SimAgent(self, self.config.health)
        self.hooks = SimHooks(self)
        self.clock = FakeClock(self)
        self._counter = 10
        # Every device already has the files deploy.yaml renders for it, so plans hold model steps only.
        for name, site in self.session.sites.items():
            for path, data in desired_files(self.config, site, systemd=False).items():
                self.devices[name].files[path] = bytearray(data)

    def _artifact(self, version: str) -> Desired:
        folder = self.tmp / f"artifact-{version}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(version.encode() * 2048)
        (folder / "sits-manifest.json").write_text(json.dumps({"version": version}))
        return Desired(version, hashlib.sha256(version.encode()).hexdigest(), folder)

    def _connect(self, config: Config, device: Any, site: DeviceSite) -> Transport:
        return self.transports[device.name]

    def traffic(self) -> None:
        """Clients' requests while the executor waits: 100 answers on every serving device, the
        share `fallback_rates` gives its version answered by the upstream."""
        with self.lock:
            for device in self.devices.values():
                if device.serving is not None:
                    device.answers += 100
                    device.fallbacks += 100 * self.fallback_rates.get(device.serving, 0.0)

    def log(self, device: str, event: str, detail: str) -> None:
        """Append one event to the ordered log (called from the executor's worker threads)."""
        with self.lock:
            self.events.append((device, event, detail))

    def of(self, event: str) -> list[str]:
        """The devices of every `event`, in the order they happened."""
        return [d for d, e, _ in self.events if e == event]

    def facts(self) -> list[DeviceFacts]:
        """What the facts probe would report for every device, in inventory order."""
        out = []
        for device in self.devices.values():
            hashes = {
                p: hashlib.sha256(bytes(b)).hexdigest()
                for p, b in device.files.items()
                if p.startswith("/etc/")
            }
            out.append(device.facts(hashes))
        return out

    def plan(
        self, target: Desired | None = None, wheels: dict[str, tuple[tuple[str, ...], int]] | None = None
    ) -> FleetPlan:
        """The real planner and recipe on the simulated facts (patches from 1.0.0 to the target);
        `wheels`: the agent's wheels each device lacks, as deployer.push.fleet gathers them."""
        target = target or self.target
        patches = {self.v1.artifact_sha256: self.patch} if target is self.target else {}
        return make_fleet_plan(self.config, self.session.sites, self.facts(), target, patches, wheels=wheels)

    def releases(self, _session: FleetSession, fp: FleetPlan) -> dict[str, ReleaseFiles]:
        """A signed-release stand-in per changing device: a manifest the SimTransport reads."""
        out = {}
        for dp in fp.plan.devices:
            if any(s.kind.value.startswith("send-") for s in dp.steps):
                self._counter += 1
                manifest = self.tmp / f"release-{self._counter}.json"
                body = {"version": fp.target.version, "artifact_sha256": fp.target.artifact_sha256}
                manifest.write_text(json.dumps({**body, "counter": self._counter}))
                patch = self.patch if dp.from_version == "1.0.0" else None
                out[dp.device] = ReleaseFiles(manifest, self._counter, patch, fp.target.artifact_dir)
        return out

    def executor(self, config: Config | None = None, *_site_args: Any, **kwargs: Any) -> Executor:
        """An Executor bound to the simulator's seams (usable as apply_plan's `executor`, whose
        sites and transports it replaces with the simulator's)."""
        kwargs.setdefault("parallel", 4)
        return Executor(
            config or self.config,
            self.session.sites,
            lambda site: self.transports[site.name],
            sleep=self.clock.sleep,
            agent=self.agent,
            hooks=self.hooks,
            on_phase=lambda d, p, x: self.log(d, f"phase:{p}", x),
            **{k: v for k, v in kwargs.items() if k not in {"sleep", "agent", "hooks", "on_phase"}},
        )
