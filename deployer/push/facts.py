"""What a device has, read over its transport in one round trip: agent, model, disk, memory, files, health.

A fact is a small read-only probe: one stdlib-only Python program (`_PROBE`) runs on the device with
the agent's interpreter (or the bootstrap interpreter before the agent is installed) and prints one
JSON document, parsed here into `DeviceFacts`. It reads `<root>/var/lib/sits/state.json` directly,
so it works whether or not an agent is installed or running. A device that cannot be reached is a
fact too (`reachable=False` with the reason), never an exception.

`DeviceSite` says where things are on one device: commands see paths under the device's root
prefix; the local transport maps file paths under that prefix itself, SSH does not.

`gather_platform` is the bootstrap's own probe, run once the agent's interpreter exists: its Python
version, CPU architecture and libc (what its wheels must be built for), and which of the wheels
recorded in WHEELS_RECORD are still installed in it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deployer import __version__
from deployer.config.models import Config, Device
from deployer.core.agent_service import UNIT_DIR
from deployer.errors import RefusedError, TransportError
from deployer.push.api_keys import API_KEYS_FILE, controller_key
from deployer.push.plan import DeviceFacts, DevicePlatform, InstalledAdapter, SystemTorch
from deployer.transport import Transport, run_bounded

__all__ = [
    "AGENT_CONFIG",
    "DEFAULT_PYTHON",
    "PULL_CONFIG",
    "PULL_ROOT",
    "VENV_PYTHON",
    "WHEELS_RECORD",
    "DevicePlatform",
    "DeviceSite",
    "HttpReply",
    "agent_request",
    "controller_agent_version",
    "gather_facts",
    "gather_fleet",
    "gather_platform",
    "parse_platform",
    "platform_probe",
]

AGENT_CONFIG = "/etc/sits/agent.yaml"
PULL_CONFIG = "/etc/sits/pull.yaml"  # pull mode: what `sits-agent poll` reads (deployer.agent.ota.poll)
PULL_ROOT = "/etc/sits/pull-root.json"
FALLBACK_KEY_FILE = "/etc/sits/secrets/fallback-key"  # deployer.push.fallback_files writes it
KEYS_DIR = "/etc/sits/keys"
VENV_PYTHON = "/opt/sits/venv/bin/python"
# The wheels bootstrap installed, by sha256, and into which interpreter (deployer.push.bootstrap).
WHEELS_RECORD = "/opt/sits/wheels.json"
DEFAULT_PYTHON = "python3"  # inventory default: bootstrap a venv with it
PROBE_TIMEOUT_S = 30.0

Connect = Callable[[Device], Transport]


@dataclass(frozen=True)
class DeviceSite:
    """One device's names and paths as the controller uses them."""

    name: str
    host: str
    root: str  # the device's root prefix, as its own commands see it
    local: bool  # local transport: file paths are device paths, mapped under `root` by the transport
    port: int  # the agent's HTTP port
    bootstrap_python: str  # the interpreter that creates the agent's venv
    python: str  # the interpreter that runs the agent
    engine: str = "torch"  # agent.engine: which engine's packages the device gets
    system_torch: bool = False  # its profile's `torch: system`: the device brings its own torch
    api_key: str | None = field(default=None, repr=False)  # sent with agent_request; never shown

    @classmethod
    def of(cls, config: Config, device: Device) -> DeviceSite:
        """The site of an inventory device (root resolved against deploy.yaml for local devices)."""
        local = device.transport == "local"
        profile = config.profiles.get(device.profile) if device.profile else None
        root = str(config.resolve(device.root)) if local else device.root
        site = cls(
            name=device.name,
            host=device.host or "localhost",
            root=root.rstrip("/") or "/",
            local=local,
            port=device.agent_port or config.agent.port,
            bootstrap_python=device.python,
            python="",
            engine=config.agent.engine,
            system_torch=profile is not None and profile.torch == "system",
            api_key=controller_key(config),
        )
        python = site.path(VENV_PYTHON) if device.python == DEFAULT_PYTHON else device.python
        return DeviceSite(**{**site.__dict__, "python": python})

    def path(self, device_path: str) -> str:
        """A device path as the device's commands see it (under the root prefix)."""
        return device_path if self.root == "/" else self.root + device_path

    def file(self, device_path: str) -> str:
        """A device path as the transport's put/get want it."""
        return device_path if self.local else self.path(device_path)

    def agent(self, *args: str) -> list[str]:
        """argv of a `sits-agent` subcommand with this device's settings file."""
        return [self.python, "-m", "deployer.agent.cli", *args, "--config", self.path(AGENT_CONFIG)]

    @property
    def managed_files(self) -> tuple[str, ...]:
        """Device files whose hashes the facts report (the trusted keys are listed on the device)."""
        units = ("sits-agent.service", "sits-rollback.service", "sits-poll.service", "sits-poll.timer")
        return (
            AGENT_CONFIG,
            API_KEYS_FILE,
            FALLBACK_KEY_FILE,
            PULL_CONFIG,
            PULL_ROOT,
            *(f"{UNIT_DIR}/{unit}" for unit in units),
        )


@dataclass(frozen=True)
class HttpReply:
    """An answer of the agent's HTTP API, fetched on the device itself."""

    status: int  # 0: nothing listens
    body: str
    elapsed_ms: float

    def json(self) -> dict:
        """The body as a JSON object ({} when it is not one)."""
        try:
            data = json.loads(self.body)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}


# Defines platform_of(record, python): the interpreter's Python, CPU architecture and libc (what
# wheels must fit), and the sha256 of the wheels in bootstrap's `record` whose release is still
# installed in it. A record made for another interpreter, or on another architecture (a re-imaged
# device), counts no wheel.
_PLATFORM_OF = r"""
import glob, json, platform, re, subprocess, sys
def canon(n): return re.sub(r"[-_.]+", "-", n).lower()
def platform_of(record_path, python):
    libc, version = platform.libc_ver()
    if not libc:
        for loader in glob.glob("/lib/ld-musl-*.so.1"):
            out = subprocess.run([loader], capture_output=True, text=True).stderr
            m = re.search(r"Version ([0-9.]+)", out)
            libc, version = "musl", (m.group(1) if m else "")
    wheels, here = [], platform.machine()
    try:
        import importlib.metadata as md
        with open(record_path) as f: record = json.load(f)
        if record.get("python") == python and record.get("machine", here) == here:
            have = {canon(d.metadata["Name"] or ""): d.version for d in md.distributions()}
            for name, digest in record["wheels"].items():
                n, v = name.split("-")[:2]
                if have.get(canon(n)) == v: wheels.append(digest)
    except Exception: pass
    return {"python": "%d.%d" % sys.version_info[:2], "implementation": sys.implementation.name,
            "machine": here, "libc": libc, "libc_version": version, "wheels": wheels}
"""

# Runs on the device with any Python >= 3.8; prints one JSON document. argv: agent root port files...
# `agent` is 1 when this is the agent's own interpreter: only then does its `deployer` count as the
# agent (the bootstrap interpreter may be the controller's own venv, on a local device).
_PROBE = (
    _PLATFORM_OF
    + r"""
import hashlib, json, os, shutil, sys, urllib.request
agent, root, port, files = sys.argv[1] == "1", sys.argv[2], int(sys.argv[3]), sys.argv[4:]
def under(p): return p if root == "/" else root + p
def sha(p):
    try:
        with open(p, "rb") as f: return hashlib.sha256(f.read()).hexdigest()
    except OSError: return None
out = {"agent_version": None, "state": None, "hashes": {}, "ready": False, "served": None}
try:
    import deployer, importlib.util
    if agent and importlib.util.find_spec("deployer.agent.cli"): out["agent_version"] = deployer.__version__
except Exception: pass
out["python"] = sys.executable
# The agent's python as bootstrap recorded it (this one, when it is the agent's).
out["platform"] = platform_of(under(WHEELS_RECORD), sys.executable if agent else None)
try:
    with open(under(WHEELS_RECORD)) as f: out["wheels_arch"] = json.load(f).get("machine")
except (OSError, ValueError, AttributeError): out["wheels_arch"] = None
if os.environ.get("SITS_PROBE_TORCH"):  # a torch: system device: the torch it brings
    try:
        import torch
        out["torch"] = {"version": torch.__version__, "cuda": bool(torch.cuda.is_available())}
    except Exception as e:
        out["torch"] = {"version": None, "error": "%s: %s" % (type(e).__name__, e)}
try:
    with open(under("/var/lib/sits/state.json")) as f: out["state"] = json.load(f)
except (OSError, ValueError): pass
for p in files:
    out["hashes"][p] = sha(under(p))
v = under("/var/lib/sits/versions")
out["on_disk"] = sorted(os.listdir(v)) if os.path.isdir(v) else []
keys = under("/etc/sits/keys")
if os.path.isdir(keys):
    for n in sorted(os.listdir(keys)):
        if n.endswith(".pub") or n == "threshold":
            out["hashes"]["/etc/sits/keys/" + n] = sha(os.path.join(keys, n))
out["adapters"] = {}
a = under("/var/lib/sits/adapters")
for n in sorted(os.listdir(a)) if os.path.isdir(a) else []:
    try:
        with open(os.path.join(a, n, "state.json")) as f: st = json.load(f)
        if st.get("current") and st.get("version"):
            out["adapters"][n] = [st["version"], st["current"], int(st.get("counter") or 0)]
    except (OSError, ValueError, AttributeError): pass
d = under("/var/lib/sits") if os.path.isdir(under("/var/lib/sits")) else root
out["free_disk"] = shutil.disk_usage(d).free
try:
    with open("/proc/meminfo") as f:
        mem = dict(l.split(":", 1) for l in f)
    out["free_memory"] = int(mem["MemAvailable"].split()[0]) * 1024
except (OSError, KeyError, ValueError): out["free_memory"] = None
out["systemd"] = root == "/" and os.path.isdir("/run/systemd/system")
try:
    with urllib.request.urlopen("http://127.0.0.1:%d/readyz" % port, timeout=3) as r:
        body = json.loads(r.read()); out["ready"] = r.status == 200; out["served"] = body.get("version")
except Exception: pass
print(json.dumps(out))
""".replace("WHEELS_RECORD", repr(WHEELS_RECORD))
)

# argv: port method path body timeout (body "" for none); prints {"status", "body", "elapsed_ms"}.
_HTTP = r"""
import json, os, sys, time, urllib.request, urllib.error
port, method, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
data = sys.argv[4].encode() or None
headers = {"Content-Type": "application/json", "X-Sits-Fallback": "off"}  # judge the device's own model
if os.environ.get("SITS_API_KEY"): headers["Authorization"] = "Bearer " + os.environ["SITS_API_KEY"]
req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data, method=method,
                             headers=headers)
t = time.monotonic()
try:
    with urllib.request.urlopen(req, timeout=float(sys.argv[5])) as r:
        status, body = r.status, r.read().decode("utf-8", "replace")
except urllib.error.HTTPError as e:
    status, body = e.code, e.read().decode("utf-8", "replace")
except Exception as e:
    status, body = 0, str(e)
print(json.dumps({"status": status, "body": body, "elapsed_ms": (time.monotonic() - t) * 1000}))
"""


def _interpreter(site: DeviceSite, env: str = "") -> str:
    """Shell words choosing the agent's interpreter when it exists (and setting A=1), else the
    bootstrap one (A=0); run with the `env` assignments, if any."""
    agent, fallback = shlex.quote(site.python), shlex.quote(site.bootstrap_python)
    # Runs, not only exists: a venv left from another architecture (a re-imaged device) cannot.
    return f'P={agent}; A=1; "$P" -c "" >/dev/null 2>&1 || {{ P={fallback}; A=0; }}; {env}"$P"'


def _offline(site: DeviceSite, reason: str, *, refused: bool = False) -> DeviceFacts:
    """Facts of a device we could not read, with the reason in one line (never a script dump)."""
    line = " ".join(reason.split())
    return DeviceFacts(name=site.name, reachable=False, error=line[:240], refused=refused)


def gather_facts(site: DeviceSite, transport: Transport) -> DeviceFacts:
    """Probe one device. An unreachable device, or one whose probe fails, gives `reachable=False`
    and a one-line reason saying what was found."""
    if site.local and not Path(site.root).is_dir():
        return _offline(site, f"{site.name}: device root {site.root} does not exist (mkdir -p {site.root})")
    try:
        rest = shlex.join([site.root, str(site.port), *site.managed_files])
        probe_torch = "SITS_PROBE_TORCH=1 " if site.system_torch else ""
        command = f'{_interpreter(site, probe_torch)} -c {shlex.quote(_PROBE)} "$A" {rest}'
        result = transport.run(command, timeout=PROBE_TIMEOUT_S)
    except RefusedError as exc:
        return _offline(site, exc.message, refused=True)
    except TransportError as exc:
        return _offline(site, _first_line(exc))
    if result.rc == 127:
        return _offline(
            site,
            f"{site.name}: no Python on the device: neither {site.python} nor {site.bootstrap_python} "
            "runs (set the device's python: in the inventory)",
        )
    if result.rc != 0:
        last = (result.stderr or result.stdout).strip().splitlines()
        return _offline(site, f"{site.name}: the facts probe exited {result.rc}: {last[-1] if last else ''}")
    try:
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return _offline(site, f"{site.name}: the facts probe printed no JSON")
    state = data.get("state") or {}
    return DeviceFacts(
        name=site.name,
        reachable=True,
        agent_version=data.get("agent_version"),
        model_version=state.get("installed_version"),
        model_sha256=state.get("artifact_sha256"),
        release_counter=int(state.get("release_counter") or 0),
        free_disk_bytes=data.get("free_disk"),
        free_memory_bytes=data.get("free_memory"),
        unit_hashes={k: v for k, v in data["hashes"].items() if v is not None},
        ready=bool(data.get("ready")) and data.get("served") == state.get("installed_version"),
        systemd=bool(data.get("systemd")),
        stored_artifacts=_stored_artifacts(state, data.get("on_disk") or []),
        platform=_platform(data.get("platform")),
        wheels_arch=data.get("wheels_arch"),
        torch=_system_torch(data.get("torch")),
        adapters={n: InstalledAdapter(*a) for n, a in (data.get("adapters") or {}).items()},
    )


def _platform(data: object) -> DevicePlatform | None:
    """The probe's platform, or None from an older probe's output."""
    if not isinstance(data, dict):
        return None
    python, implementation, machine, libc, version = (
        str(data.get(k) or "") for k in ("python", "implementation", "machine", "libc", "libc_version")
    )
    wheels = frozenset(str(w) for w in data.get("wheels") or ())
    return DevicePlatform(python, implementation, machine, libc, version, wheels)


def _system_torch(data: object) -> SystemTorch | None:
    if not isinstance(data, dict):
        return None
    version = data.get("version")
    return SystemTorch(str(version) if version else None, bool(data.get("cuda")), data.get("error"))


def _first_line(exc: TransportError) -> str:
    """A transport error in one line: the cause's own words when there is one (not our command)."""
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.strerror:
        return f"{exc.message.split(':', 1)[0]}: {cause.strerror}"
    return exc.message.splitlines()[0] if exc.message else type(exc).__name__


def _stored_artifacts(state: dict, on_disk: list[str]) -> dict[str, str]:
    """artifact sha256 -> version of every verified version still on the device's disk."""
    out = {}
    for version, record in (state.get("versions") or {}).items():
        sha = ((record or {}).get("release") or {}).get("artifact", {}).get("sha256")
        if version in on_disk and isinstance(sha, str):
            out[sha] = version
    return out


def gather_fleet(
    sites: Sequence[DeviceSite], transports: Callable[[DeviceSite], Transport], *, parallel: int
) -> list[DeviceFacts]:
    """Facts of every device, at most `parallel` probes at once, in the order of `sites`."""
    outcomes = run_bounded(sites, lambda s: gather_facts(s, transports(s)), parallel=parallel)
    return [
        o.result if o.result is not None else DeviceFacts(o.item.name, False, str(o.error)) for o in outcomes
    ]


def agent_request(
    site: DeviceSite,
    transport: Transport,
    method: str,
    path: str,
    body: dict | None = None,
    *,
    timeout: float = 60,
) -> HttpReply:
    """Call the agent's HTTP API from the device itself (it listens on loopback only).

    Raises TransportError when the device cannot be reached or has no usable interpreter.
    """
    payload = json.dumps(body) if body is not None else ""
    argv = shlex.join(["-c", _HTTP, str(site.port), method, path, payload, str(timeout)])
    # The key rides in the environment of the one process that needs it, not in its argv.
    env = f"SITS_API_KEY={shlex.quote(site.api_key)} " if site.api_key else ""
    result = transport.run(f"{_interpreter(site, env)} {argv}", timeout=timeout + 15)
    result.check(f"{site.name}: HTTP {method} {path}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return HttpReply(int(data["status"]), data["body"], float(data["elapsed_ms"]))


# Runs with the agent's interpreter; prints one JSON document. argv: the wheels record, the python.
_PLATFORM = _PLATFORM_OF + "print(json.dumps(platform_of(sys.argv[1], sys.argv[2])))\n"


def gather_platform(site: DeviceSite, transport: Transport) -> DevicePlatform:
    """Probe the agent's interpreter (it must exist). Raises TransportError when the probe fails."""
    result = transport.run(platform_probe(site), timeout=PROBE_TIMEOUT_S).check(
        f"{site.name}: the platform probe"
    )
    return parse_platform(site.name, result.stdout)


def platform_probe(site: DeviceSite) -> list[str]:
    """The command that prints the device's platform as JSON (run it with any way in: ssh, nsenter)."""
    return [site.python, "-c", _PLATFORM, site.path(WHEELS_RECORD), site.python]


def parse_platform(name: str, stdout: str) -> DevicePlatform:
    """The DevicePlatform in the probe's output. Raises TransportError when it printed none."""
    try:
        data = json.loads(stdout.strip().splitlines()[-1])
        return DevicePlatform(
            python=data["python"],
            implementation=data["implementation"],
            machine=data["machine"],
            libc=data["libc"],
            libc_version=data["libc_version"],
            wheels=frozenset(data["wheels"]),
        )
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise TransportError(f"{name}: the platform probe printed no usable JSON ({exc})") from exc


def controller_agent_version() -> str:
    """The agent version devices should run: the controller's own."""
    return __version__
