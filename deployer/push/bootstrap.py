"""Put the agent on a device and keep its files and process as deploy.yaml says.

    install_agent     the agent without the controller and without an index: a venv at
                      /opt/sits/venv made with the device's `python` (seeing the system site
                      packages when its profile says `torch: system`), or, when the inventory
                      names another interpreter, that one; the controller's wheelhouse for the
                      device's platform (deployer.push.wheelhouse) minus the wheels the device
                      already installed (by sha256), installed with `pip --no-index`; then the
                      agent's own wheel, sits-agent (agent/pyproject.toml, built once per
                      controller run), with --no-deps: the controller's distribution, sits-deployer,
                      never reaches a device
    desired_files     what the controller keeps on the device, by device path: agent.yaml, the
                      trusted keys, the systemd units when the device runs systemd, and the
                      pull-mode files when deploy.yaml provisions it to poll (pull_provision);
                      REMOVED_WHEN_UNSET the key files deleted once deploy.yaml no longer asks
    write_files       upload each file that differs (verified by sha256, renamed into place)
    start_agent       systemd: daemon-reload, enable --now / restart; otherwise (the local demo
                      fleet) `sits-agent serve` as a background process with a pid file and a log

Device paths: the agent's log is /var/log/sits-agent.log and its pid file /run/sits-agent.pid when
it runs without systemd.

Under systemd the units run the agent as the static user `sits` (docs/units.md): `prepare_service_user`
creates it and hands it the store, and `store_command` runs the controller's own agent commands that
write the store (install, rollback) as that user, so that every file there stays the agent's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import posixpath
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from deployer import __version__
from deployer.config.models import Config
from deployer.core.agent_service import (
    LOG_FILE,
    PID_FILE,
    SERVICE,
    pip_install,
    restart_command,
    stop_command,
)
from deployer.errors import AgentError, SitsError, TransportError
from deployer.push.api_keys import API_KEYS_FILE, key_file, read_keys
from deployer.push.facts import (
    AGENT_CONFIG,
    FALLBACK_KEY_FILE,
    KEYS_DIR,
    UNIT_DIR,
    VENV_PYTHON,
    WHEELS_RECORD,
    DevicePlatform,
    DeviceSite,
    agent_request,
    gather_platform,
)
from deployer.push.fallback_files import fallback_files, fallback_settings
from deployer.push.pull_files import pull_files
from deployer.push.units import POLL_TIMER
from deployer.push.wheelhouse import PipTarget, Wheelhouse, agent_requirements, build_wheelhouse
from deployer.release.desired import ReleaseFiles
from deployer.transport import Transport

__all__ = [
    "AGENT_PROJECT",
    "INCOMING",
    "LOG_FILE",
    "REMOVED_WHEN_UNSET",
    "agent_settings",
    "agent_wheelhouse",
    "build_agent_wheel",
    "bundle_wheels",
    "desired_files",
    "ensure_serving",
    "install_agent",
    "install_args",
    "log_command",
    "prepare_service_user",
    "send_release",
    "short_admin_socket",
    "start_agent",
    "stop_agent",
    "store_command",
    "write_files",
]

AGENT_PROJECT = "agent"  # sits-agent's project folder in the checkout
INCOMING = "/var/lib/sits/incoming"  # uploads; not staging/, which the agent empties on each start
SERVICE_USER = "sits"  # User= of the units (deployer.push.units.UnitParams.user)
STORE_DIR = "/var/lib/sits"
KERNEL_DIR = f"{STORE_DIR}/cache/kernels"  # the agent's kernel cache (agent/compile_cache.py)
ADMIN_SOCKET = "/run/sits/admin.sock"  # the agent's default, under its root (deployer.agent.settings)
UNIX_PATH_MAX = 107  # bytes of a unix socket's path (sun_path is 108 with its NUL)
_START_POLL_S = 0.5
_JOB_POLL_S = 2.0
_log = logging.getLogger("sits.deployer")


def agent_settings(config: Config, site: DeviceSite) -> str:
    """The agent.yaml text for one device (deterministic, so its hash tells whether it changed)."""
    settings = {
        "host": str(config.agent.host),
        "port": site.port,
        "root": site.root,
        "engine": config.agent.engine,
        "device": config.agent.device,
        "compile": config.agent.compile,
        # Only when on: every agent.yaml written before it existed stays the same text (no restart).
        **({"draft": config.agent.draft} if config.agent.draft != "off" else {}),
        **({"kv_cache_type": config.agent.kv_cache_type} if config.agent.kv_cache_type != "auto" else {}),
        "max_concurrent": config.agent.max_concurrent,
        "queue_length": config.agent.queue_length,
        "max_tokens": config.agent.max_tokens,
        "swap_policy": config.agent.swap_policy,
        "smoke_prompts": [{"prompt": p} for p in config.health.smoke_prompts],
        "latency_budget_ms": config.health.latency_budget_ms,
        "readiness_timeout_s": config.health.readiness_timeout.total_seconds(),
    }
    socket = short_admin_socket(site)
    if socket is not None:
        settings["admin_socket"] = socket
    device = next(d for d in config.fleet.devices if d.name == site.name)
    if device.profile:  # only then: an agent.yaml of a device without a profile stays the same text
        settings["device_class"] = device.profile
    if (fallback := fallback_settings(config, device, site)) is not None:
        settings["fallback"] = fallback
    if config.resources.cpu is not None:
        # As many engine threads as whole CPUs in the quota: more threads than the quota allows
        # spin at llama.cpp's barriers while throttled (decode collapses to a few tokens/s).
        settings["threads"] = max(1, config.resources.cpu // 1000)
    return "# Written by sits-deployer from deploy.yaml; local edits are overwritten.\n" + yaml.safe_dump(
        settings, sort_keys=True
    )


def short_admin_socket(site: DeviceSite) -> str | None:
    """Where a local device's admin socket goes when `<root>/run/sits/admin.sock` is too long for a
    unix socket (a project in a deep directory): a directory of its own under this user's home, as
    the agent of a local device runs as this user. None: the default fits (or an SSH device)."""
    if not site.local or len(site.path(ADMIN_SOCKET).encode()) <= UNIX_PATH_MAX:
        return None
    digest = hashlib.sha256(site.root.encode()).hexdigest()[:16]
    return str(Path.home() / ".cache" / "sits-deployer" / "run" / digest / "admin.sock")


# Managed files removed from a device once deploy.yaml no longer asks for them: a key file left
# behind stays a secret on disk (the fallback upstream's), or stays in force (the agent reads its API
# keys from the default path whether agent.yaml names them or not, and the controller sends none).
REMOVED_WHEN_UNSET = frozenset({API_KEYS_FILE, FALLBACK_KEY_FILE})


def desired_files(config: Config, site: DeviceSite, *, systemd: bool) -> dict[str, bytes]:
    """Device path -> content of every file the controller manages on this device."""
    files = {AGENT_CONFIG: agent_settings(config, site).encode()}
    if config.agent.api_keys is not None:
        files[API_KEYS_FILE] = key_file(read_keys(config))
    if config.signing:
        for key in config.signing.trusted_keys:
            path = config.resolve(key)
            files[f"{KEYS_DIR}/{path.stem}.pub"] = path.read_bytes()
        # The agent reads its k-of-n signature threshold from here (absent means 1).
        files[f"{KEYS_DIR}/threshold"] = f"{config.signing.threshold}\n".encode()
    device = next(d for d in config.fleet.devices if d.name == site.name)
    params = None
    if systemd:
        from deployer.push.units import UnitParams, render_units

        # With the device: its profile decides PrivateDevices= (an accelerator needs its nodes).
        params = UnitParams.from_config(config, device)
        params = UnitParams(
            **{
                **params.__dict__,
                "agent_command": (site.python, "-m", "deployer.agent.cli"),
                "config_path": site.path(AGENT_CONFIG),
            }
        )
        for name, text in render_units(params).items():
            files[f"{UNIT_DIR}/{name}"] = text.encode()
    return files | fallback_files(config, device) | pull_files(config, device, params)


def write_files(site: DeviceSite, transport: Transport, files: dict[str, bytes]) -> list[str]:
    """Upload each file (unchanged ones are skipped by their hash); return the paths that changed."""
    changed = []
    with tempfile.TemporaryDirectory(prefix="sits-files-") as tmp:
        for i, (device_path, data) in enumerate(sorted(files.items())):
            local = Path(tmp) / str(i)
            local.write_bytes(data)
            if not transport.put(local, site.file(device_path)).unchanged:
                changed.append(device_path)
    return changed


@functools.cache
def build_agent_wheel(project_dir: Path, out_dir: Path) -> Path:
    """Build the agent's wheel (sits-agent, from the checkout `project_dir`'s agent/) once, with
    `pip wheel --no-deps`, into `out_dir`. Raises SitsError if pip fails."""
    out_dir.mkdir(parents=True, exist_ok=True)
    source = project_dir / AGENT_PROJECT
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out_dir), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    wheels = sorted(out_dir.glob(f"sits_agent-{__version__}-*.whl"))
    if done.returncode != 0 or not wheels:
        raise SitsError(
            f"building the sits-agent wheel from {source} failed: {done.stderr.strip()[-400:]}",
            hint=f"run `pip wheel --no-deps {AGENT_PROJECT}` in the project to see why, or name an "
            "interpreter that already has sits-agent as the device's `python`",
        )
    return wheels[-1]


def install_agent(site: DeviceSite, transport: Transport, wheel: Path) -> None:
    """Install the agent from its `wheel` (sits-agent) and the wheelhouse of its requirements and its
    engine's extra; the device needs no index.

    Raises SitsError when the wheelhouse cannot be built, TransportError when a device step fails.
    """
    if site.python == site.path(VENV_PYTHON):
        _ensure_venv(site, transport)
    if site.system_torch:
        _check_system_torch(site, transport)
    device = gather_platform(site, transport)
    house = agent_wheelhouse(site, device, wheel)
    incoming = f"{INCOMING}/wheels"
    for w in house.wheels:
        if w.sha256 not in device.wheels:
            transport.put(w.path, site.file(f"{incoming}/{w.path.name}"))
    transport.put(wheel, site.file(f"{incoming}/{wheel.name}"))
    pip = pip_install(site.python)
    wheels_dir = site.path(incoming)
    # Pins, not ranges: the device ends with exactly the wheelhouse's releases; those it has already
    # satisfy their pins without their wheels being sent again.
    _run_detached(
        site,
        transport,
        [*pip, "--find-links", wheels_dir, *house.pins],
        f"{site.name}: pip install of the agent's {len(house.pins)} wheels",
        timeout_s=1800,
    )
    if site.python == site.path(VENV_PYTHON):
        # Our venv's agents from before the split came as the controller's wheel, which owns the
        # agent's files too (and the controller's modules): sits-agent alone may own them now.
        transport.run(
            [site.python, "-m", "pip", "uninstall", "--yes", "--quiet", "sits-deployer"], timeout=300
        ).check(f"{site.name}: pip uninstall of the controller's sits-deployer")
    # The agent is replaced even at the same version; its dependencies are the ones above.
    _run_detached(
        site,
        transport,
        [*pip, "--force-reinstall", "--no-deps", f"{wheels_dir}/{wheel.name}"],
        f"{site.name}: pip install of {wheel.name}",
        timeout_s=900,
    )
    if site.engine == "torch" and not site.system_torch and PipTarget.of(device).runs_controller_builds():
        _send_cpu_kernels(site, transport)
    # The machine: a device re-imaged to another architecture never counts these wheels as its own.
    record = {
        "python": site.python,
        "machine": device.machine,
        "wheels": {w.path.name: w.sha256 for w in house.wheels},
    }
    write_files(
        site, transport, {WHEELS_RECORD: (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()}
    )
    transport.run(["rm", "-rf", wheels_dir], timeout=60)  # installed: the wheels would only take space


def agent_wheelhouse(
    site: DeviceSite, device: DevicePlatform, wheel: Path, *, cross_build: bool = True
) -> Wheelhouse:
    """The wheelhouse of the agent's `wheel` for the device's platform: its requirements and its
    engine's extra, torch left out when the device brings its own. `cross_build`: a source-only
    wheel the target lacks is cross-compiled (apply), else named in the error (plan).
    Raises SitsError when a wheel cannot be had for the platform."""
    requirements = agent_requirements(wheel, site.engine, system_torch=site.system_torch)
    return build_wheelhouse(requirements, PipTarget.of(device), cross_build=cross_build)


def bundle_wheels(
    config: Config, device_class: str | None, device: DevicePlatform, project_dir: Path, out_dir: Path
) -> tuple[Path, ...]:
    """What an offline bundle carries for the agent of `device_class` on `device`'s platform: the
    sits-agent wheel built from `project_dir` (into `out_dir`) and its wheelhouse (with the engine's
    extra, torch left out for a `torch: system` profile; llama-cpp-python cross-compiled when the
    platform needs it). Raises SitsError when a wheel cannot be had for the platform."""
    profile = config.profiles.get(device_class) if device_class else None
    wheel = build_agent_wheel(project_dir, out_dir)
    system_torch = profile is not None and profile.torch == "system"
    requirements = agent_requirements(wheel, config.agent.engine, system_torch=system_torch)
    house = build_wheelhouse(requirements, PipTarget.of(device))
    return (wheel, *(w.path for w in house.wheels))


def _send_cpu_kernels(site: DeviceSite, transport: Transport) -> None:
    """Our CPU kernels (agent/engines/native.py), built here, into the agent's kernel cache on a
    device that runs this controller's builds. Devices seldom have a C++ compiler, and without the
    library an AVX2-only CPU runs int4 and int8 layers on torch's kernels at a third of the speed.
    The library's name carries its source and torch version, so a device whose torch differs
    ignores it. Best effort: without a compiler here the device builds its own or keeps torch's."""
    library, why = _controller_kernels()
    if library is None:
        _log.info("%s: no CPU kernels to send (%s)", site.name, why)
        return
    transport.put(library, site.file(f"{KERNEL_DIR}/{library.name}"))


@functools.cache
def _controller_kernels() -> tuple[Path | None, str]:
    """(the library built here, "") or (None, why not); once per run, not once per device."""
    # A program of the agent's, as the local transport runs agents: the controller imports none.
    done = subprocess.run(
        [sys.executable, "-m", "deployer.agent.engines.torch.native", "--library"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    library = Path(done.stdout.strip())
    if done.returncode != 0 or not library.is_file():
        return None, done.stderr.strip()[-200:]
    return library, ""


def _run_detached(
    site: DeviceSite, transport: Transport, argv: list[str], what: str, *, timeout_s: float
) -> None:
    """Run a long device command outside the SSH session and poll until it ends.

    Installing torch runs for minutes without output: a connection that drops or idles out
    meanwhile must not kill it half-way, so it runs detached (setsid) and each poll is a fresh short
    command. Raises TransportError when it fails or outlives `timeout_s`.
    """
    job = shlex.quote(site.path(f"{INCOMING}/job"))
    body = f"{shlex.join(argv)} >{job}/log 2>&1; echo $? >{job}/rc.tmp && mv {job}/rc.tmp {job}/rc"
    transport.run(
        f"rm -rf {job} && mkdir -p {job} && (setsid sh -c {shlex.quote(body)} </dev/null >/dev/null 2>&1 &)",
        timeout=60,
    ).check(f"{what}: starting it")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done = transport.run(f"cat {job}/rc 2>/dev/null && tail -c 600 {job}/log", timeout=60)
        except TransportError:
            done = None  # a dropped connection: the command goes on; the next poll reconnects
        if done is not None and done.ok and done.stdout.strip():
            rc, _, log = done.stdout.partition("\n")
            if rc.strip() != "0":
                raise TransportError(
                    f"{what} failed with exit code {rc.strip()}: {log.strip() or '(no output)'}"
                )
            return
        time.sleep(_JOB_POLL_S)
    raise TransportError(f"{what} did not finish within {timeout_s:g}s", hint=f"see {job}/log on the device")


def _check_system_torch(site: DeviceSite, transport: Transport) -> None:
    """Fail before sending anything when the torch the device should bring is not there."""
    found = transport.run([site.python, "-c", "import torch; print(torch.__version__)"], timeout=300)
    if not found.ok:
        last = ((found.stderr or found.stdout).strip().splitlines() or ["no output"])[-1]
        raise AgentError(
            f"{site.name}: its profile says torch: system, but {site.python} cannot import torch ({last})",
            hint="install the vendor's torch for the device's python (Jetson: NVIDIA's JetPack wheels), "
            "or set the profile's torch: wheelhouse",
        )


def _ensure_venv(site: DeviceSite, transport: Transport) -> None:
    """Create the agent's venv, or recreate it when its system-site-packages setting is not the profile's."""
    venv = posixpath.dirname(posixpath.dirname(site.python))
    want = "true" if site.system_torch else "false"
    same = f"grep -qx 'include-system-site-packages = {want}' {shlex.quote(f'{venv}/pyvenv.cfg')}"
    flags = "--clear --system-site-packages" if site.system_torch else "--clear"
    # Runs, not only exists: a venv left from another architecture (a re-imaged device) cannot.
    transport.run(
        f"if ! {shlex.quote(site.python)} -c '' >/dev/null 2>&1 || ! {same}; "
        f"then {shlex.quote(site.bootstrap_python)} -m venv {flags} {shlex.quote(venv)}; fi",
        timeout=300,
    ).check(f"{site.name}: creating the agent's venv at {venv}")


def prepare_service_user(site: DeviceSite, transport: Transport) -> None:
    """systemd devices: create the units' system user when missing and give it the store."""
    user, store = SERVICE_USER, shlex.quote(site.path(STORE_DIR))
    transport.run(
        f"id -u {user} >/dev/null 2>&1 || useradd --system --home-dir {STORE_DIR} "
        f"--shell /usr/sbin/nologin {user}; mkdir -p {store} && chown -R {user}:{user} {store}",
        timeout=120,
    ).check(f"{site.name}: creating the service user {user}")


def store_command(site: DeviceSite, argv: list[str]) -> str:
    """A shell command running agent `argv` as the service user where the units are installed.

    There the uploads (made as the SSH user) are handed to that user first; elsewhere (the local demo
    fleet, devices without systemd) `argv` runs as it is.
    """
    command = shlex.join(argv)
    if site.root != "/":
        return command
    user, store = SERVICE_USER, shlex.quote(STORE_DIR)
    unit = shlex.quote(f"{UNIT_DIR}/{SERVICE}")
    return (
        f"if [ -f {unit} ] && id -u {user} >/dev/null 2>&1 && [ $(id -u) = 0 ]; then "
        f"chown -R {user}:{user} {store} && exec runuser -u {user} -- {command}; else exec {command}; fi"
    )


def _release_dir(release: ReleaseFiles) -> str:
    return f"{INCOMING}/{release.counter}"


def send_release(site: DeviceSite, transport: Transport, release: ReleaseFiles) -> int:
    """Upload a release manifest and its payload (resumable, verified); return the bytes sent."""
    folder = _release_dir(release)
    sent = transport.put(release.manifest, site.file(f"{folder}/release.json")).bytes_sent
    if release.patch is not None:
        return sent + transport.put(release.patch, site.file(f"{folder}/update.patch")).bytes_sent
    for path in sorted(release.artifact_dir.iterdir()):
        sent += transport.put(path, site.file(f"{folder}/artifact/{path.name}")).bytes_sent
    return sent


def install_args(site: DeviceSite, release: ReleaseFiles) -> list[str]:
    """`sits-agent install` arguments for a release that `send_release` uploaded."""
    folder = _release_dir(release)
    payload = ["--patch", f"{folder}/update.patch"] if release.patch else ["--artifact", f"{folder}/artifact"]
    return ["--manifest", site.path(f"{folder}/release.json"), payload[0], site.path(payload[1])]


def ensure_serving(
    site: DeviceSite, transport: Transport, version: str, *, systemd: bool, timeout_s: float
) -> None:
    """Make the agent serve `version`: start it when it is not running, else have it reload."""
    from deployer.push.health import serving_version

    if not agent_running(site, transport):
        start_agent(site, transport, systemd=systemd, timeout_s=timeout_s)
    elif serving_version(site, transport) != version:  # else the install's own hot swap did it
        transport.run(site.agent("reload"), timeout=timeout_s + 30).check(f"{site.name}: sits-agent reload")


def agent_running(site: DeviceSite, transport: Transport) -> bool:
    """Whether an agent answers on the device's port."""
    return agent_request(site, transport, "GET", "/healthz", timeout=5).status == 200


def start_agent(site: DeviceSite, transport: Transport, *, systemd: bool, timeout_s: float) -> None:
    """(Re)start the agent and wait until it answers /readyz. Raises AgentError when it does not."""
    serve, pid, log = site.agent("serve"), site.path(PID_FILE), site.path(LOG_FILE)
    restart = restart_command(systemd=systemd, serve=serve, pid_file=pid, log_file=log)
    if systemd:
        timer = shlex.quote(f"{UNIT_DIR}/{POLL_TIMER}")
        transport.run(
            # A pull-mode device (its timer provisioned) also polls by itself from now on.
            f"{restart} && if [ -f {timer} ]; then systemctl enable --now {POLL_TIMER}; fi",
            timeout=timeout_s + 30,
        ).check(f"{site.name}: systemctl restart sits-agent")
    else:
        transport.run(restart, timeout=60).check(f"{site.name}: starting sits-agent serve")
    _wait_ready(site, transport, timeout_s)


def stop_agent(site: DeviceSite, transport: Transport) -> None:
    """Stop the background agent of a device without systemd (no-op when none runs)."""
    transport.run(stop_command(site.path(PID_FILE)), timeout=30)


def _wait_ready(site: DeviceSite, transport: Transport, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    reply = None
    while time.monotonic() < deadline:
        try:
            reply = agent_request(site, transport, "GET", "/readyz", timeout=5)
        except TransportError:
            reply = None
        if reply is not None and reply.status == 200:
            return
        time.sleep(_START_POLL_S)
    raise AgentError(
        f"{site.name}: the agent did not become ready within {timeout_s:g}s "
        f"({reply.body.strip()[:200] if reply else 'no answer'})",
        hint=f"see `sits-deployer logs {site.name}`",
    )


def log_command(site: DeviceSite, *, systemd: bool, since: str | None, follow: bool, lines: int = 200) -> str:
    """The shell command that prints (or follows) the agent's log on the device."""
    if systemd:
        argv = ["journalctl", "-u", "sits-agent", "--no-pager", "-n", str(lines)]
        argv += ["--since", since] if since else []
        return shlex.join([*argv, *(["-f"] if follow else [])])
    return shlex.join(["tail", "-n", str(lines), *(["-F"] if follow else []), site.path(LOG_FILE)])
