"""`sits-agent`: the device side's command line. Each command parses flags, calls one function of
the store, updater or server, and prints the result (people: stderr; `--output json`: stdout).

The updater reaches the running server through its admin unix socket (POST /admin/reload, at
`admin_socket` of the device's agent.yaml); no server answering is not an error (the new version
loads when the agent starts).
Exit codes: 0 ok, 1 refused or failed, 2 usage.
"""

from __future__ import annotations

import functools
import http.client
import json
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import click

from deployer import __version__
from deployer.agent.ota.adapter_install import (
    AdapterControl,
    AdapterInstaller,
    ControlAnswer,
    device_base,
    device_trust,
)
from deployer.agent.ota.adapters import AdapterStore
from deployer.agent.ota.bundle import RunningAgent, install_bundle
from deployer.agent.ota.store import DeviceStore
from deployer.agent.ota.updater import Reloader, ReloadOutcome, Updater
from deployer.agent.settings import DEFAULT_SETTINGS_PATH, AgentSettings, load_settings
from deployer.core.agent_service import LOG_FILE, PID_FILE, SERVICE, UNIT_DIR, restart_command
from deployer.core.clikit import emit_json, examples, output_option, plain_error, verbosity
from deployer.core.redact import redacting_stdio
from deployer.errors import AgentError, SitsError

__all__ = ["cli", "http_adapter_control", "http_reloader", "main", "restart_agent", "running_agent"]

HISTORY_SHOWN = 10
F = TypeVar("F", bound=Callable[..., Any])


class _AgentGroup(click.Group):
    """Turns our errors into a message on stderr and exit code 1, never a traceback; everything a
    command prints passes the redaction of the secrets it learns (deployer/core/redact.py)."""

    def invoke(self, ctx: click.Context) -> object:
        with redacting_stdio():
            try:
                return super().invoke(ctx)
            except SitsError as exc:
                plain_error(exc)
                ctx.exit(exc.exit_code)


@click.group(
    cls=_AgentGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="Examples:\n\n  sits-agent serve --config /etc/sits/agent.yaml\n\n"
    "  sits-agent install --manifest release.json --patch 1.0.0-1.1.0.patch\n\n"
    "  sits-agent rollback --root /srv/devices/dev-1\n\n  sits-agent status --output json",
)
@click.version_option(__version__, "--version", prog_name="sits-agent")
@click.option("-v", "--verbose", count=True, help="More detail on stderr (repeatable).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: bool) -> None:
    """The SITS device agent: serves the installed model, installs verified updates, rolls back."""
    ctx.obj = {"verbosity": -1 if quiet else verbose}


def device_options(func: F) -> F:
    """Add `--config` and `--root` to a command; it receives the settings as `settings`."""

    @click.option(
        "--config",
        "config_path",
        type=click.Path(path_type=Path, dir_okay=False),
        default=DEFAULT_SETTINGS_PATH,
        show_default=True,
        envvar="SITS_AGENT_CONFIG",
        help="Agent settings (root prefix, port, ...). A missing file means the defaults.",
    )
    @click.option(
        "--root",
        type=click.Path(path_type=Path, file_okay=False),
        default=None,
        envvar="SITS_ROOT",
        help="Root prefix of etc/sits and var/lib/sits, overriding the settings' `root`.",
    )
    @functools.wraps(func)
    def wrapper(config_path: Path, root: Path | None, **kwargs: Any) -> Any:
        if root is not None and config_path == DEFAULT_SETTINGS_PATH:
            # A device under a root prefix keeps its settings there too (its port, its socket).
            config_path = root / "etc" / "sits" / "agent.yaml"
        settings = load_settings(config_path) if config_path.exists() else AgentSettings()
        if root is not None:
            settings = settings.model_copy(update={"root": root})
        return func(settings=settings, **kwargs)

    return wrapper  # type: ignore[return-value]


def info(message: str) -> None:
    """A status line on stderr unless --quiet."""
    if verbosity() >= 0:
        click.echo(message, err=True)


def debug(message: str) -> None:
    """A detail line on stderr only with -v."""
    if verbosity() >= 1:
        click.echo(message, err=True)


def _updater(settings: AgentSettings, *, reload: bool = True) -> Updater:
    return Updater(
        DeviceStore(settings.root),
        reloader=http_reloader(settings) if reload else None,
        on_step=lambda step: debug(f"step: {step}"),
    )


@cli.command(epilog=examples("sits-agent serve --config /etc/sits/agent.yaml"))
@device_options
def serve(settings: AgentSettings) -> None:
    """Serve the current version over the OpenAI-compatible API until SIGTERM.

    Cleans up after an interrupted install first. Exits non-zero when the current version fails
    to load, so systemd's OnFailure= unit can roll back, and when the server's event loop stops
    answering, so that Restart=on-failure restarts it.
    """
    from deployer.agent.http.server import run_server  # torch and the engine load only here

    _updater(settings, reload=False).start_up()
    run_server(settings)


@cli.command(
    epilog=examples(
        "sits-agent install --manifest release.json --patch v1-v2.patch",
        "sits-agent install --manifest release.json --artifact ./artifact",
        "sits-agent install --from /media/usb/sits-bundle.tar   # an offline bundle",
    )
)
@click.option(
    "--manifest",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="The signed release manifest.",
)
@click.option(
    "--patch",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="A delta patch from the installed version.",
)
@click.option(
    "--artifact",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    help="A full artifact directory.",
)
@click.option(
    "--from",
    "bundle",
    type=click.Path(path_type=Path),
    help="An offline bundle (sits-deployer bundle): its directory or tar file, e.g. on a USB stick.",
)
@click.option("--no-reload", is_flag=True, help="Do not ask the running server to load it.")
@output_option
@device_options
def install(
    settings: AgentSettings,
    manifest: Path | None,
    patch: Path | None,
    artifact: Path | None,
    bundle: Path | None,
    no_reload: bool,
    output: str,
) -> None:
    """Verify a signed release and install it from a patch or a full artifact directory, or from
    an offline bundle (--from), checked with the same keys, expiry and anti-rollback. A bundle
    that carries another version of the agent's wheels upgrades this agent from them (pip, no
    index, each wheel held to its signed sha256) and restarts it."""
    updater = _updater(settings, reload=not no_reload)
    if bundle is not None:
        if manifest or patch or artifact:
            raise click.UsageError(
                "--from installs a whole bundle: leave out --manifest, --patch, --artifact"
            )
        outcome = install_bundle(bundle, updater, settings.device_class, running_agent(settings))
        debug(f"from {outcome.source} ({outcome.payload})")
        if outcome.agent is not None:
            info(f"agent {outcome.agent} installed from the bundle's wheels, was {outcome.agent_from}")
            info(outcome.restarted)
        result = outcome.install
    elif manifest is None or (patch is None) == (artifact is None):
        raise click.UsageError("give --manifest and exactly one of --patch or --artifact (or --from BUNDLE)")
    else:
        result = updater.install(manifest, patch=patch, artifact=artifact)
    if output == "json":
        emit_json(asdict(result))
    elif not result.changed:
        info(f"version {result.version} (counter {result.release_counter}) is already installed")
    else:
        info(f"installed {result.version} (counter {result.release_counter}), was {result.from_version}")
        if result.reload is not None or bundle is None:  # an upgraded agent was restarted instead
            _say_reload(result.reload)


@cli.command(
    epilog=examples(
        "sits-agent rollback",
        "sits-agent rollback --to 1.0.0",
        "sits-agent rollback --on-failure   # from sits-rollback.service",
    )
)
@click.option("--to", "to", metavar="VERSION", help="A version on disk (default: the previous one).")
@click.option("--on-failure", is_flag=True, help="For systemd OnFailure=: leave the failing version.")
@output_option
@device_options
def rollback(settings: AgentSettings, to: str | None, on_failure: bool, output: str) -> None:
    """Return to the previous (or a named) version already verified on this device."""
    if to and on_failure:
        raise click.UsageError("--to and --on-failure exclude each other")
    updater = _updater(settings)
    result = updater.self_rollback() if on_failure else updater.rollback(to)
    if output == "json":
        emit_json(asdict(result))
    elif not result.changed:
        info(f"version {result.version} is already current")
    else:
        info(f"rolled back to {result.version}, was {result.from_version}")
        _say_reload(result.reload)


@cli.command(epilog=examples("sits-agent reload", "sits-agent reload --output json"))
@click.option("--version", "version", metavar="VERSION", help="Load this version (default: current).")
@output_option
@device_options
def reload(settings: AgentSettings, version: str | None, output: str) -> None:
    """Have the running server load the current version beside the old one and swap."""
    answer = _call(settings, "POST", "/admin/reload", {"version": version} if version else {})
    if answer is None:
        raise AgentError(
            f"no agent is listening on {settings.admin_socket_path}",
            hint="start it (systemctl start sits-agent); it loads the current version on start",
        )
    status, body = answer
    if output == "json":
        emit_json(body)
    ok = status == 200 and body.get("ok") is True
    if not ok:
        raise AgentError(f"reload refused: {_reason(body)}", hint="see `sits-agent status` and the journal")
    info(f"serving {body.get('active_version')}")


@cli.command(epilog=examples("sits-agent status", "sits-agent status --output json"))
@output_option
@device_options
def status(settings: AgentSettings, output: str) -> None:
    """What is installed: current and previous version, versions on disk, recent history."""
    store = DeviceStore(settings.root)
    state = store.read_state()
    data: dict[str, Any] = {
        "root": str(settings.root),
        "current": store.current_version(),
        "previous": store.previous_version(),
        "artifact_sha256": state.artifact_sha256,
        "release_counter": state.release_counter,
        "versions": {
            v: {
                "counter": r.release.counter if (r := state.versions.get(v)) else None,
                "installed_at": r.installed_at if r else None,
                "failed": r.failed if r else None,
            }
            for v in store.installed_versions()
        },
        "history": [h.model_dump() for h in state.history[-HISTORY_SHOWN:]],
        # An interrupted pointer change; the next sits-agent operation or start finishes it.
        "pending": state.pending.model_dump() if state.pending else None,
        "pull": _pull_state(store),
    }
    if output == "json":
        emit_json(data)
        return
    info(f"current  {data['current'] or '-'}   previous {data['previous'] or '-'}")
    info(f"release counter {state.release_counter}   store {store.base}")
    for version, facts in data["versions"].items():
        flag = " (failed)" if facts["failed"] else ""
        info(f"  {version:<16} counter {facts['counter']}  installed {facts['installed_at']}{flag}")
    for h in state.history[-HISTORY_SHOWN:]:
        info(f"  {h.at} {h.action:<13} {h.result:<6} {h.version or '-'} {h.reason}")
    if (pull := data["pull"]) is not None:
        info(f"pull: last poll {pull['last_attempt']} {pull['result']}, last success {pull['last_success']}")
        if pull["error"]:
            info(f"  failing ({pull['failures']}x, retry after {pull['retry_after']}): {pull['error']}")


@cli.command(epilog=examples("sits-agent poll", "sits-agent poll --force"))
@click.option("--force", is_flag=True, help="Poll now even while backing off after failures.")
@output_option
@device_options
def poll(settings: AgentSettings, force: bool, output: str) -> None:
    """Check the channel in etc/sits/pull.yaml and install a newer release (the timer runs this)."""
    from deployer.agent.ota.poll import Poller, load_pull_settings  # tuf and requests load only here

    store = DeviceStore(settings.root)
    outcome = Poller(store, _updater(settings), load_pull_settings(settings.root)).poll(force=force)
    if output == "json":
        emit_json(asdict(outcome))
    elif outcome.result == "updated" and outcome.install is not None:
        info(
            f"updated to {outcome.install.version} from {outcome.install.from_version} "
            f"({outcome.payload}, {outcome.bytes_downloaded} bytes in {outcome.requests} requests)"
        )
        _say_reload(outcome.install.reload)
    elif outcome.result == "up-to-date":
        cost = f"{outcome.requests} requests, {outcome.bytes_downloaded} bytes"
        info(f"up to date ({outcome.channel_version}; {cost})")
    else:
        info(outcome.detail)


@cli.command(epilog=examples("sits-agent gc --keep 3"))
@click.option("--keep", type=click.IntRange(min=1), default=3, show_default=True)
@output_option
@device_options
def gc(settings: AgentSettings, keep: int, output: str) -> None:
    """Remove old versions, keeping the newest KEEP (current and previous always stay)."""
    removed = _updater(settings, reload=False).collect_garbage(keep)
    if output == "json":
        emit_json({"removed": removed})
    else:
        info(f"removed {', '.join(removed)}" if removed else "nothing to remove")


@cli.group(
    epilog=examples(
        "sits-agent adapter list",
        "sits-agent adapter reload summarise",
        "sits-agent adapter install --manifest summarise-3.json --artifact ./summarise",
        "sits-agent adapter rollback summarise",
    )
)
def adapter() -> None:
    """LoRA adapters: installed, rolled back and (re)loaded each on its own, the base untouched."""


@adapter.command("reload", epilog=examples("sits-agent adapter reload summarise"))
@click.argument("name")
@output_option
@device_options
def adapter_reload(settings: AgentSettings, name: str, output: str) -> None:
    """Have the running agent load adapter NAME's current version (none installed: unload it);
    requests already running finish on the version they started with."""
    answer = _call(settings, "POST", "/admin/adapters/reload", {"name": name})
    if answer is None:
        raise AgentError(
            f"no agent is listening on {settings.admin_socket_path}",
            hint="start it (systemctl start sits-agent); it loads the installed adapters on start",
        )
    status, body = answer
    if output == "json":
        emit_json(body)
    if status != 200:
        raise AgentError(f"adapter reload refused: {_reason(body)}", hint="see the agent's journal")
    if body["status"] == "loaded":
        info(f"adapter {name} {body['version']} loaded")
    else:
        info(f"adapter {name} unloaded (none installed)")


@adapter.command("list", epilog=examples("sits-agent adapter list", "sits-agent adapter list --output json"))
@output_option
@device_options
def adapter_list(settings: AgentSettings, output: str) -> None:
    """The installed adapters (current and previous version) and, when the agent runs, which it
    has loaded."""
    store = AdapterStore(DeviceStore(settings.root).base)
    answer = _call(settings, "GET", "/v1/models")
    served = {}
    if answer is not None and answer[0] == 200:
        served = {m["id"]: m for m in answer[1].get("data", ()) if m.get("kind") == "lora"}
    rows = []
    for name in sorted(store.installed()):
        state = store.state(name)
        entry = served.get(name)
        rows.append(
            {
                "name": name,
                "version": state.version,
                "artifact_id": state.current,
                "previous_version": state.previous_version,
                "counter": state.counter,
                "loaded": entry["loaded"] if entry else False,
                "loaded_version": entry["version"] if entry else None,
            }
        )
    if output == "json":
        emit_json({"agent_running": answer is not None, "adapters": rows})
        return
    if answer is None:
        info(f"no agent is listening on {settings.admin_socket_path}: nothing is loaded")
    if not rows:
        info("no adapters installed")
    for row in rows:
        loaded = f"loaded {row['loaded_version']}" if row["loaded"] else "not loaded"
        info(
            f"  {row['name']:<20} {row['version']:<12} previous {row['previous_version'] or '-':<12} {loaded}"
        )


@adapter.command(
    "install",
    epilog=examples(
        "sits-agent adapter install --manifest summarise-3.json --artifact ./summarise",
        "sits-agent adapter install --manifest summarise-4.json --patch a1-a2.patch",
    ),
)
@click.option(
    "--manifest",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    required=True,
    help="The signed adapter release.",
)
@click.option(
    "--patch",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="A delta patch from the installed version of the adapter.",
)
@click.option(
    "--artifact",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    help="The full adapter artifact directory.",
)
@output_option
@device_options
def adapter_install(
    settings: AgentSettings, manifest: Path, patch: Path | None, artifact: Path | None, output: str
) -> None:
    """Verify a signed adapter release (keys, expiry, its own counter, the base it was made for),
    install it, have the running agent load it and run its smoke prompts; roll back on failure."""
    if (patch is None) == (artifact is None):
        raise click.UsageError("give --manifest and exactly one of --patch or --artifact")
    result = _adapter_installer(settings).install(manifest, artifact=artifact, patch=patch)
    if output == "json":
        emit_json(asdict(result))
    else:
        info(f"adapter {result.name} {result.version} (counter {result.counter}), was {result.from_version}")


@adapter.command("rollback", epilog=examples("sits-agent adapter rollback summarise"))
@click.argument("name")
@output_option
@device_options
def adapter_rollback(settings: AgentSettings, name: str, output: str) -> None:
    """Make adapter NAME's previous version current again (none: unload it) and reload it."""
    result = _adapter_installer(settings).rollback(name)
    if output == "json":
        emit_json(asdict(result))
    else:
        info(f"adapter {name} rolled back to {result.version or 'none'}, was {result.from_version}")


def _adapter_installer(settings: AgentSettings) -> AdapterInstaller:
    device = DeviceStore(settings.root)
    return AdapterInstaller(
        AdapterStore(device.base),
        http_adapter_control(settings),
        trusted=device_trust(device, warn=info),
        base_artifact_id=device_base(device),
    )


def http_adapter_control(settings: AgentSettings) -> AdapterControl:
    """The running agent's adapter endpoints on its admin socket (POST /admin/adapters/reload and
    /admin/adapters/smoke); no agent listening counts as loaded (it loads adapters on start)."""

    def ask(path: str, name: str, ok: Callable[[dict], bool]) -> ControlAnswer:
        answer = _call(settings, "POST", path, {"name": name})
        if answer is None:
            return ControlAnswer(True, False, f"no agent listening on {settings.admin_socket_path}")
        status, body = answer
        return ControlAnswer(status == 200 and ok(body), True, _reason(body) or str(body.get("detail", "")))

    return AdapterControl(
        reload=lambda name: ask("/admin/adapters/reload", name, lambda b: "status" in b),
        smoke=lambda name: ask("/admin/adapters/smoke", name, lambda b: b.get("ok") is True),
    )


@cli.command(epilog=examples("sits-agent version"))
def version() -> None:
    """Print the agent's version."""
    click.echo(__version__)


def _pull_state(store: DeviceStore) -> dict[str, Any] | None:
    """The last poll's record (pull mode), or None on a device that never polled."""
    path = store.base / "pull" / "poll-state.json"
    if not path.exists():
        return None
    from deployer.agent.ota.poll import PollState

    try:
        return PollState.model_validate_json(path.read_bytes()).model_dump()
    except ValueError:
        return {"error": f"{path} is unreadable", "result": None}


def running_agent(settings: AgentSettings) -> RunningAgent:
    """This agent, as an offline bundle upgrades it: its version, its environment's interpreter."""
    return RunningAgent(__version__, sys.executable, lambda: restart_agent(settings))


def restart_agent(settings: AgentSettings) -> str:
    """Restart this device's agent as bootstrap restarts it after an upgrade (its systemd unit, or
    the background agent of its pid file, with agent.yaml under the root); say what was done.
    Raises AgentError when the restart command fails."""
    root = Path(settings.root)

    def on_device(path: str) -> str:
        return str(root / path.lstrip("/"))

    systemd = root == Path("/") and Path(on_device(f"{UNIT_DIR}/{SERVICE}")).is_file()
    if not systemd and not Path(on_device(PID_FILE)).is_file():
        return "no agent was running: the new agent serves the installed version when started"
    config = on_device(str(DEFAULT_SETTINGS_PATH))  # where apply writes it, under the root
    serve = [sys.executable, "-m", "deployer.agent.cli", "serve", "--config", config]
    command = restart_command(
        systemd=systemd, serve=serve, pid_file=on_device(PID_FILE), log_file=on_device(LOG_FILE)
    )
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise AgentError(
            f"restarting the upgraded agent failed: {(done.stderr or done.stdout).strip()[-400:]}",
            hint=f"restart it by hand (systemctl restart {SERVICE}); the new version is installed",
        )
    return f"restarted the agent ({'systemctl restart ' + SERVICE if systemd else 'its background process'})"


def http_reloader(settings: AgentSettings) -> Reloader:
    """A Reloader that asks the server on this device through its admin socket: nothing if it
    already serves the version (GET /v1/models), else POST /admin/reload, which answers after the
    swap."""

    def reload(version: str, reason: str) -> ReloadOutcome:
        models = _call(settings, "GET", "/v1/models")
        if models is None:
            where = settings.admin_socket_path
            return ReloadOutcome(True, False, f"no agent listening on {where}; it loads on start")
        active = [m.get("version") for m in models[1].get("data", []) if m.get("status") == "active"]
        if active == [version]:
            return ReloadOutcome(True, True, f"already serving {version}")
        answer = _call(settings, "POST", "/admin/reload", {"version": version, "reason": reason})
        if answer is None:
            return ReloadOutcome(False, False, "the agent stopped answering during the reload")
        status, body = answer
        return ReloadOutcome(status == 200 and body.get("ok") is True, True, _reason(body))

    return reload


class _UnixConnection(http.client.HTTPConnection):
    """http.client over the agent's admin unix socket."""

    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        """Connect to the socket instead of a TCP address."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self._path))


def _call(
    settings: AgentSettings, method: str, path: str, body: dict[str, str] | None = None
) -> tuple[int, dict] | None:
    """(status, JSON body) of one request to the local agent's admin socket, or None when nothing
    listens there.

    Raises AgentError when it listens but does not answer properly (timeout, non-JSON, no access).
    """
    where = settings.admin_socket_path
    conn = _UnixConnection(where, timeout=settings.readiness_timeout_s + 30)
    try:
        payload = None if body is None else json.dumps(body)
        conn.request(method, path, payload, {"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except OSError as exc:
        raise AgentError(
            f"the agent's admin socket {where} did not answer {method} {path}: {exc}",
            hint="run this as the agent's user (sits) or root; check `systemctl status sits-agent`",
        ) from exc
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError as exc:
        raise AgentError(
            f"the agent answered {method} {path} with non-JSON (HTTP {response.status})"
        ) from exc


def _reason(body: dict) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message", "unknown error"))
    return str(body.get("reason") or "")


def _say_reload(outcome: ReloadOutcome | None) -> None:
    if outcome is None:
        info("the running server was not asked to reload (--no-reload)")
    elif outcome.served:
        info("the running server swapped to it")
    else:
        info(outcome.detail)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="sits-agent")


if __name__ == "__main__":
    main()
