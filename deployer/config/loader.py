"""Reading deploy.yaml (and its inventory) into a `Config`, collecting every problem on the way.

The pipeline: YAML with positions -> ${VAR} interpolation -> inventory -> schema (pydantic) ->
semantic checks on every section that validated on its own, so that one broken section does not
hide the problems of the others. Nothing is written anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from deployer.config.checks import CheckInput, run_checks
from deployer.config.findings import Finding, sort_findings
from deployer.config.interpolate import Interpolated, interpolate, redact_finding
from deployer.config.models import Config, Device, Inventory
from deployer.config.schema_findings import validation_findings
from deployer.config.sourcemap import SourceMap
from deployer.config.yamlpos import load_yaml
from deployer.errors import ConfigError

# deploy.yaml and the inventory are refused past this size before they are parsed: a 10,000-device
# inventory is about 1 MiB, and parsing is what a huge file would exhaust.
MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_CONFIG_BYTES_ENV = "SITS_MAX_CONFIG_BYTES"

# The sections the checks look at, by field name; the fleet is merged with its inventory first.
_CHECKED_SECTIONS = (
    "model",
    "signing",
    "profiles",
    "strategy",
    "resources",
    "hooks",
    "agent",
    "fallback",
)


@dataclass
class LoadResult:
    """The config (None if anything is wrong) and every finding, in reading order."""

    config: Config | None
    findings: list[Finding] = field(default_factory=list)


@dataclass
class _Document:
    """One parsed file: its interpolated data and where each field sits."""

    positions: SourceMap
    values: Interpolated


def load_config(
    path: str | Path, environ: Mapping[str, str] | None = None, *, secrets: bool = True
) -> Config:
    """Load and fully validate deploy.yaml; raise ConfigError whose ``findings`` lists them all.

    ``secrets=False`` is for commands that sign nothing (plan, status, logs): the signing key's
    passphrase is then not needed.
    """
    result = read_config(Path(path), os.environ if environ is None else environ, secrets=secrets)
    if result.config is None:
        count = sum(f.is_error for f in result.findings)
        raise ConfigError(
            f"{path}: {count} problem{'s' if count != 1 else ''} in the configuration",
            findings=result.findings,
            hint=f"run `sits-deployer validate -f {path}` to list them",
        )
    return result.config


def validate_file(path: str | Path, environ: Mapping[str, str] | None = None) -> list[Finding]:
    """Every problem in the deploy.yaml at ``path``; an empty list when it is valid."""
    return read_config(Path(path), os.environ if environ is None else environ).findings


def read_config(path: Path, environ: Mapping[str, str], *, secrets: bool = True) -> LoadResult:
    """Load ``path`` into a Config, or report why not. Bad input never raises."""
    main, findings = _read_document(path, environ)
    if main is None:
        return LoadResult(None, findings)
    data = main.values.data
    if not isinstance(data, dict):
        message = "the file must be a mapping of fields (key: value)"
        return LoadResult(None, [*findings, main.positions.finding((), message)])
    inventory, inventory_findings = _inventory_devices(path, data, main.positions, environ)
    findings += inventory_findings
    config: Config | None = None
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        findings += validation_findings(
            exc, Config, main.positions, main.values.sources, main.values.unresolved
        )
    fleet = data.get("fleet")
    inline = fleet.get("devices", []) if isinstance(fleet, dict) else []
    devices = [_valid(Device, d) for d in inline] if isinstance(inline, list) else None
    devices = None if devices is None or inventory is None else devices + inventory
    given = CheckInput(
        path.parent, main.positions, environ, devices=devices, secrets=secrets, **_sections(data)
    )
    findings = [redact_finding(f) for f in findings + run_checks(given)]
    if any(f.is_error for f in findings) or config is None or devices is None:
        return LoadResult(None, sort_findings(findings))
    fleet_devices = [*config.fleet.devices, *(inventory or [])]
    merged = config.model_copy(update={"fleet": config.fleet.model_copy(update={"devices": fleet_devices})})
    merged._path = path
    return LoadResult(merged, sort_findings(findings))  # warnings only


def max_config_bytes(environ: Mapping[str, str]) -> int:
    """The size limit for deploy.yaml and the inventory: $SITS_MAX_CONFIG_BYTES, else 4 MiB.
    A value that is not a positive whole number is ignored (the default applies)."""
    value = environ.get(MAX_CONFIG_BYTES_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else MAX_CONFIG_BYTES


def _read_document(path: Path, environ: Mapping[str, str]) -> tuple[_Document | None, list[Finding]]:
    """The parsed, interpolated file and its findings; None when it could not be parsed."""
    file = str(path)
    limit = max_config_bytes(environ)
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
        if len(raw) > limit:
            return None, [
                Finding(
                    file,
                    1,
                    1,
                    "<file>",
                    f"the file is larger than the limit of {limit} bytes ({limit / 2**20:.1f} MiB); "
                    "it was not parsed",
                    f"split the fleet into several projects, or raise the limit with "
                    f"{MAX_CONFIG_BYTES_ENV}=<bytes>",
                )
            ]
        text = raw.decode("utf-8")
    except FileNotFoundError:
        return None, [Finding(file, 1, 1, "<file>", "file not found", "check the path")]
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        return None, [Finding(file, 1, 1, "<file>", f"cannot read the file: {reason}")]
    parsed = load_yaml(text, file)
    if parsed.data is None:
        empty = [Finding(file, 1, 1, "<root>", "the file is empty")]
        return None, parsed.findings or empty
    values = interpolate(parsed.data, parsed.positions, environ)
    return _Document(parsed.positions, values), parsed.findings + values.findings


def _inventory_devices(
    path: Path, data: dict[str, Any], positions: SourceMap, environ: Mapping[str, str]
) -> tuple[list[Device] | None, list[Finding]]:
    """The inventory's devices ([] without an inventory, None when it is broken).

    Their positions are grafted into ``positions`` after the inline devices, keeping the
    inventory's file name, so findings about them point into the inventory.
    """
    fleet = data.get("fleet")
    if not isinstance(fleet, dict):
        return [], []
    name = fleet.get("inventory")
    if not isinstance(name, str) or not name:
        return [], []
    inventory_path = Path(name).expanduser()
    if not inventory_path.is_absolute():
        inventory_path = path.parent / inventory_path
    if not inventory_path.is_file():
        hint = f"looked for {inventory_path}; fix fleet.inventory or list the devices inline"
        return None, [positions.finding(("fleet", "inventory"), f"inventory {name} does not exist", hint)]
    document, findings = _read_document(inventory_path, environ)
    if document is None:
        return None, findings
    try:
        inventory = Inventory.model_validate(document.values.data)
    except ValidationError as exc:
        values = document.values
        errors = validation_findings(exc, Inventory, document.positions, values.sources, values.unresolved)
        return None, [redact_finding(f) for f in findings + errors]
    inline = fleet.get("devices")
    offset = len(inline) if isinstance(inline, list) else 0
    positions.graft_items(document.positions, ("devices",), ("fleet", "devices"), offset)
    return list(inventory.devices), [redact_finding(f) for f in findings]


def _sections(data: dict[str, Any]) -> dict[str, Any]:
    """Each checked section validated on its own; None where it is absent-and-required or invalid."""
    sections: dict[str, Any] = {}
    for name in _CHECKED_SECTIONS:
        info = Config.model_fields[name]
        if name in data:
            sections[name] = _valid(_annotation(name), data[name])
        else:
            sections[name] = None if info.is_required() else info.get_default(call_default_factory=True)
    return sections


def _valid(annotation: Any, value: Any) -> Any:
    """``value`` validated against ``annotation``, or None when it does not validate."""
    try:
        return _adapter(annotation).validate_python(value)
    except ValidationError:
        return None


@cache
def _annotation(name: str) -> Any:
    info = Config.model_fields[name]
    return Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation


@cache
def _adapter(annotation: Any) -> TypeAdapter[Any]:
    return TypeAdapter(annotation)
