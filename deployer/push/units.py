"""systemd units for the device agent, rendered from the jinja2 templates in `templates/`.

    render_units(config or UnitParams)  -> {"sits-agent.service": text, "sits-rollback.service": text}
    render_pull_units(config or UnitParams) -> {"sits-poll.service": text, "sits-poll.timer": text}
    unit_digests(units)                 -> {name: sha256 of the UTF-8 bytes}, what the planner compares
                                           with the device's facts to decide whether to rewrite a unit
    write_units(units, directory)       -> the files, byte for byte what the digests cover
    verify_units(directory)             -> `systemd-analyze verify`; any output on stderr is a failure
    security_score(unit_path)           -> `systemd-analyze security --offline=true` exposure (0-10)

Rendering is pure and deterministic: the same parameters give the same bytes, so a second apply
finds nothing to change. `resources` in Kubernetes notation become systemd values here
(CPU 4000m -> CPUQuota=400%, memory 8Gi -> MemoryMax=8G). Raises ConfigError for values systemd
cannot enforce and for units that systemd-analyze rejects.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jinja2

from deployer.config.models import Config, Device
from deployer.errors import ConfigError

__all__ = [
    "AGENT_UNIT",
    "POLL_TIMER",
    "POLL_UNIT",
    "ROLLBACK_UNIT",
    "UnitParams",
    "cpu_quota",
    "memory_max",
    "render_pull_units",
    "render_units",
    "security_score",
    "unit_digests",
    "verify_units",
    "write_units",
]

AGENT_UNIT = "sits-agent.service"
ROLLBACK_UNIT = "sits-rollback.service"
POLL_UNIT = "sits-poll.service"  # pull mode (docs/pull-mode.md)
POLL_TIMER = "sits-poll.timer"
AGENT_MODULE_ARGS = ("-m", "deployer.agent.cli")
MIN_CPU_MILLICORES = 10  # CPUQuota=1%: the kernel cannot schedule a smaller CFS quota per period
MIN_MEMORY_BYTES = 64 * 2**20  # below this the interpreter and HTTP server alone do not fit
# Time for the interpreter, torch and the agent to import before loading starts (measured 3-5 s on
# a 2-core x86 box; slow ARM boards take several times longer).
START_MARGIN_S = 60
_SYSTEMD_ANALYZE_TIMEOUT_S = 60
_SUFFIXES = (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10))
_EXPOSURE = re.compile(r"Overall exposure level for \S+:\s*([0-9]+(?:\.[0-9]+)?)")
_BARE_ARG = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")


@dataclass(frozen=True)
class UnitParams:
    """Everything the templates need. Use `from_config` unless you are testing a single knob.

    ``agent_command`` is the argv prefix that runs `sits-agent` on the device: an interpreter and
    ``-m deployer.agent.cli`` (default) or the path of the console script.
    """

    agent_command: tuple[str, ...] = ("python3", *AGENT_MODULE_ARGS)
    application: str = "sits"
    namespace: str = "default"
    config_path: str = "/etc/sits/agent.yaml"
    cpu_millicores: int | None = None
    memory_bytes: int | None = None
    start_timeout_s: int = 180
    stop_timeout_s: int = 60
    restart_s: int = 5
    start_limit_burst: int = 3
    watchdog_s: int = 30
    nofile_limit: int = 4096  # LimitNOFILE=: connections (agent.yaml max_connections) + files
    private_devices: bool = True
    user: str = "sits"
    systemctl: str = "/usr/bin/systemctl"
    poll_interval_s: int = 900
    poll_jitter_s: int = 300
    poll_timeout_s: int = 3600  # a full artifact over a slow link

    def __post_init__(self) -> None:
        # Fail while rendering, not on the device: both conversions raise ConfigError.
        if self.cpu_millicores is not None:
            cpu_quota(self.cpu_millicores)
        if self.memory_bytes is not None:
            memory_max(self.memory_bytes)
        if not self.agent_command:
            raise ConfigError("the agent command is empty", hint="give the interpreter or sits-agent path")

    @classmethod
    def from_config(cls, config: Config, device: Device | None = None) -> UnitParams:
        """Parameters for one device (its interpreter and profile) or, without one, the fleet default."""
        profile = config.profiles.get(device.profile) if device and device.profile else None
        python = device.python if device else "python3"
        return cls(
            agent_command=(python, *AGENT_MODULE_ARGS),
            application=config.application,
            namespace=config.namespace,
            cpu_millicores=config.resources.cpu,
            memory_bytes=config.resources.memory,
            start_timeout_s=int(config.health.readiness_timeout.total_seconds()) + START_MARGIN_S,
            # An accelerator needs its device nodes (/dev/nvidia*, /dev/dri); a CPU-only box needs none.
            private_devices=profile is None or profile.accelerator is None,
        )

    @property
    def start_limit_interval_s(self) -> int:
        """Long enough that `start_limit_burst` slow failed starts still count as one crash loop."""
        return self.start_limit_burst * (self.restart_s + self.start_timeout_s)


def cpu_quota(millicores: int) -> str:
    """Kubernetes millicores as systemd CPUQuota=: 4000 -> '400%', 1500 -> '150%', 125 -> '12.5%'."""
    if millicores < MIN_CPU_MILLICORES:
        raise ConfigError(
            f"resources.cpu: {millicores}m is below the {MIN_CPU_MILLICORES}m (1% of a CPU) that "
            "systemd's CPUQuota= can enforce",
            hint=f"set resources.cpu to at least {MIN_CPU_MILLICORES}m, or remove it for no limit",
        )
    whole, tenth = divmod(millicores, 10)
    return f"{whole}%" if tenth == 0 else f"{whole}.{tenth}%"


def memory_max(size: int) -> str:
    """Bytes as systemd MemoryMax= (its suffixes are base 1024): 8Gi -> '8G', 10**9 -> '1000000000'."""
    if size < MIN_MEMORY_BYTES:
        raise ConfigError(
            f"resources.memory: {size} bytes is below {MIN_MEMORY_BYTES // 2**20}Mi, too little for the "
            "agent process before any model is loaded",
            hint="set resources.memory to the model's size plus about 300Mi (e.g. '1Gi'), or remove it",
        )
    for suffix, factor in _SUFFIXES:
        if size % factor == 0:
            return f"{size // factor}{suffix}"
    return str(size)


def render_units(source: Config | UnitParams, device: Device | None = None) -> dict[str, str]:
    """The unit files, name -> text, for a config (optionally one of its devices) or explicit params.

    Raises ConfigError when a resource value cannot be expressed in systemd terms.
    """
    return _render(source, device, (AGENT_UNIT, ROLLBACK_UNIT))


def render_pull_units(source: Config | UnitParams, device: Device | None = None) -> dict[str, str]:
    """The pull-mode units, name -> text: `sits-poll.service` and the jittered `sits-poll.timer`."""
    return _render(source, device, (POLL_UNIT, POLL_TIMER))


def _render(source: Config | UnitParams, device: Device | None, names: tuple[str, ...]) -> dict[str, str]:
    params = source if isinstance(source, UnitParams) else UnitParams.from_config(source, device)
    context = {
        **{field: getattr(params, field) for field in params.__dataclass_fields__},
        "start_limit_interval_s": params.start_limit_interval_s,
        "cpu_quota": cpu_quota(params.cpu_millicores) if params.cpu_millicores is not None else None,
        "memory_max": memory_max(params.memory_bytes) if params.memory_bytes is not None else None,
    }
    env = _environment()
    return {name: env.get_template(f"{name}.j2").render(context) for name in names}


def unit_digests(units: dict[str, str]) -> dict[str, str]:
    """sha256 (hex) of each unit's UTF-8 bytes: equal to `sha256sum` of the file `write_units` wrote."""
    return {name: hashlib.sha256(text.encode("utf-8")).hexdigest() for name, text in units.items()}


def write_units(units: dict[str, str], directory: Path) -> list[Path]:
    """Write each unit to `directory/<name>` (UTF-8, no newline translation) and return the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in units.items():
        path = directory / name
        path.write_bytes(text.encode("utf-8"))
        paths.append(path)
    return paths


def verify_units(directory: Path) -> None:
    """Run `systemd-analyze verify` on every unit in `directory`.

    Unknown keys and bad values only print warnings (exit status 0), so any stderr output counts
    as a failure. Raises ConfigError with systemd's own words.
    """
    units = sorted(str(path) for path in directory.glob("*.service"))
    if not units:
        raise ConfigError(f"{directory}: no *.service files to verify", hint="write the units first")
    result = _systemd_analyze("verify", *units)
    if result.returncode != 0 or result.stderr.strip():
        raise ConfigError(
            f"systemd-analyze verify rejected the units in {directory} (exit {result.returncode}):\n"
            f"{result.stderr.strip()}",
            hint="ExecStart's interpreter must exist where the unit is verified; otherwise fix the template",
        )


def security_score(unit_path: Path) -> float:
    """The overall exposure level (0 = fully locked down, 10 = no sandbox) of one unit file.

    Uses `systemd-analyze security --offline=true` (systemd >= 250), so no running systemd is
    needed. Raises ConfigError when the tool is missing, too old, or prints no score.
    """
    result = _systemd_analyze("security", "--offline=true", "--no-pager", str(unit_path))
    match = _EXPOSURE.search(result.stdout)
    if match is None:
        raise ConfigError(
            f"systemd-analyze security gave no exposure level for {unit_path} (exit {result.returncode}): "
            f"{result.stderr.strip() or result.stdout.strip()[-300:]}",
            hint="--offline=true needs systemd 250 or newer",
        )
    return float(match.group(1))


def _systemd_analyze(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("systemd-analyze")
    if binary is None:
        raise ConfigError("systemd-analyze is not installed here", hint="install the systemd package")
    try:
        return subprocess.run(
            [binary, *args],
            capture_output=True,
            text=True,
            timeout=_SYSTEMD_ANALYZE_TIMEOUT_S,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SYSTEMD_COLORS": "0", "LC_ALL": "C"},
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(
            f"systemd-analyze {args[0]} did not finish within {_SYSTEMD_ANALYZE_TIMEOUT_S}s",
            hint="retry; if it hangs again, run it by hand to see why",
        ) from exc


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # unit files, not HTML; values are escaped for systemd by the filters below
    )
    env.filters["exec_args"] = _exec_args
    env.filters["unit_text"] = _unit_text
    return env


def _template_dir() -> Path:
    """templates/ of a source checkout, or the copy the wheel carries in deployer/_data/."""
    package = Path(__file__).resolve().parents[1]  # deployer/
    for candidate in (package / "_data" / "templates", package.parent / "templates"):
        if (candidate / f"{AGENT_UNIT}.j2").is_file():
            return candidate
    raise ConfigError(
        f"the unit templates are missing (looked in {package / '_data'} and {package.parent})",
        hint="reinstall sits-deployer; the wheel carries them under deployer/_data/templates",
    )


def _exec_args(command: tuple[str, ...], *args: str) -> str:
    """An Exec*= command line: each argument quoted for systemd, with '%' and '$' kept literal."""
    return " ".join(_exec_word(word) for word in (*command, *args))


def _exec_word(word: str) -> str:
    text = _unit_text(word).replace("$", "$$")
    if _BARE_ARG.match(word):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _unit_text(value: str) -> str:
    """A value placed in a unit file: one line, and '%' doubled so systemd does not expand specifiers."""
    if "\n" in value or "\r" in value:
        raise ConfigError(f"{value!r} spans lines and cannot go into a unit file", hint="remove the newline")
    return value.replace("%", "%%")
