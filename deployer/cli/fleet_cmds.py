"""`plan`, `apply`, `rollback`, `status`, `logs`: thin wrappers over deployer.push.fleet, one call each."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Group
from rich.live import Live
from rich.table import Table

from deployer.cli.common import console, emit_json, examples, info, output_option, verbosity
from deployer.errors import SitsError

F = TypeVar("F", bound=Callable[..., Any])


def _fleet_options(func: F) -> F:
    for option in reversed(
        [
            click.option(
                "-f",
                "--file",
                "config_path",
                type=click.Path(path_type=Path, dir_okay=False),
                default="deploy.yaml",
                show_default=True,
                help="The deploy.yaml.",
            ),
            click.option("--selector", multiple=True, metavar="K=V", help="Only devices with this label."),
            click.option("--device", "names", multiple=True, metavar="NAME", help="Only this device."),
            click.option("--parallel", default=4, show_default=True, type=click.IntRange(min=1)),
        ]
    ):
        func = option(func)
    return func


def _selector(pairs: tuple[str, ...]) -> dict[str, str] | None:
    if not pairs:
        return None
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise click.BadParameter(f"{bad[0]!r}: write a selector as key=value", param_hint="--selector")
    return dict(p.split("=", 1) for p in pairs)


def _fleet(config_path: Path, selector: tuple[str, ...], names: tuple[str, ...], parallel: int):
    from deployer.config import load_config
    from deployer.push.fleet import FleetSession

    return FleetSession.select(
        load_config(config_path), selector=_selector(selector), names=names, parallel=parallel
    )


def _plan_table(plan: Any) -> Table:
    table = Table(title=f"plan: {plan.target_version} ({plan.target_sha256[:12]})", title_justify="left")
    for column in ("device", "status", "from", "to", "steps", "bytes", "reason"):
        table.add_column(column)
    for d in plan.devices:
        steps = ", ".join(s.kind.value for s in d.steps) or "-"
        table.add_row(
            d.device,
            d.status.value,
            d.from_version or "-",
            d.to_version,
            steps,
            f"{d.bytes_to_send:,}",
            d.reason,
        )
    return table


def _print_plan(plan: Any) -> None:
    """The plan table; with -v, every step's actions under it (what apply runs, in order)."""
    console().print(_plan_table(plan))
    if verbosity() < 1:
        return
    for d in plan.devices:
        for step in d.steps:
            console().print(f"{d.device}  {step.kind.value}: {step.reason}", markup=False)
            for action in step.actions:
                console().print(f"    {action.describe()}", markup=False)


def _report_table(report: Any) -> Table:
    table = Table(title=f"{report.action} {report.target_version} ({report.strategy})", title_justify="left")
    for column in ("device", "result", "version", "phase", "sent", "error"):
        table.add_column(column)
    for r in report.results:
        table.add_row(
            r.device, r.status, r.version or "-", r.phase, f"{r.bytes_sent:,}", (r.error or "")[:160]
        )
    return table


class _Board:
    """Live progress per device and phase on stderr (rich), fed from worker threads."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[str, str]] = {}
        self.lock = threading.Lock()
        self.live = Live(self._table(), console=console(), refresh_per_second=4, transient=False)

    def update(self, device: str, phase: str, detail: str) -> None:
        with self.lock:
            self.rows[device] = (phase, detail[:80])
            self.live.update(Group(self._table()))

    def _table(self) -> Table:
        table = Table(show_header=True, box=None)
        table.add_column("device")
        table.add_column("phase")
        table.add_column("detail")
        for device, (phase, detail) in sorted(self.rows.items()):
            table.add_row(device, phase, detail)
        return table


def _execute(fleet: Any, fp: Any, action: str, output: str) -> None:
    from deployer.push.fleet import apply_plan

    show = output == "text" and verbosity() >= 0 and console().is_terminal
    board = _Board() if show else None
    verbose = verbosity() > 0  # read here: the click context is not visible in the worker threads
    on_phase = board.update if board else (lambda d, p, x: info(f"{d}: {p} {x}") if verbose else None)
    project = Path(__file__).resolve().parents[2]
    try:
        if board:
            with board.live:
                report = apply_plan(fleet, fp, action=action, on_phase=on_phase, project_dir=project)
        else:
            report = apply_plan(fleet, fp, action=action, on_phase=on_phase, project_dir=project)
    finally:
        fleet.close()
    if output == "json":
        emit_json(report.to_dict())
    else:
        console().print(_report_table(report))
        if report.halted:
            console().print(f"[red]halted:[/red] {report.halted}")
    if report.exit_code:
        sys.exit(report.exit_code)


@click.command(
    epilog=examples(
        "sits-deployer plan -f deploy.yaml",
        "sits-deployer plan -f deploy.yaml --output json",
        "sits-deployer plan -f deploy.yaml -o plan.json",
        "sits-deployer plan -f deploy.yaml --detailed-exitcode   # 0 none, 2 changes",
    )
)
@_fleet_options
@click.option(
    "-o", "--out", type=click.Path(path_type=Path, dir_okay=False), help="Also write the plan here."
)
@click.option(
    "--detailed-exitcode", is_flag=True, help="Exit 0 when nothing changes, 2 when changes are pending."
)
@output_option
def plan(
    config_path: Path,
    selector: tuple[str, ...],
    names: tuple[str, ...],
    parallel: int,
    out: Path | None,
    detailed_exitcode: bool,
    output: str,
) -> None:
    """Show what apply would change on each device, and why. Changes nothing."""
    from deployer.push.fleet import plan_fleet, write_plan_file
    from deployer.release.desired import build_target

    fleet = _fleet(config_path, selector, names, parallel)
    try:
        fp = plan_fleet(fleet, build_target(fleet.config))
    finally:
        fleet.close()
    if out is not None:
        write_plan_file(fp, config_path, out, _selector(selector) or {}, names)
    if output == "json":
        emit_json(fp.plan.to_dict())
    else:
        _print_plan(fp.plan)
    if detailed_exitcode and fp.plan.has_changes:
        sys.exit(2)


@click.command(
    epilog=examples(
        "sits-deployer apply -f deploy.yaml",
        "sits-deployer apply -f deploy.yaml --dry-run",
        "sits-deployer apply plan.json",
        "sits-deployer apply -f deploy.yaml --parallel 8 --selector ring=canary",
    )
)
@click.argument("plan_file", required=False, type=click.Path(path_type=Path, exists=True, dir_okay=False))
@_fleet_options
@click.option("--dry-run", is_flag=True, help="Print the plan and stop.")
@click.option("--force-unlock", metavar="LOCK_ID", help="Remove a lock left by a killed run (needs its id).")
@output_option
def apply(
    plan_file: Path | None,
    config_path: Path,
    selector: tuple[str, ...],
    names: tuple[str, ...],
    parallel: int,
    dry_run: bool,
    force_unlock: str | None,
    output: str,
) -> None:
    """Make the fleet match deploy.yaml (or execute a saved plan.json), by the configured strategy."""
    from deployer.push.fleet import check_plan_file, check_unchanged, load_plan_file, plan_fleet
    from deployer.push.state import force_unlock as unlock
    from deployer.release.desired import build_target

    saved = load_plan_file(plan_file) if plan_file else None
    if saved is not None:
        config_path, selector = Path(saved["config"]), tuple(f"{k}={v}" for k, v in saved["selector"].items())
        names = tuple(saved["devices"])
    fleet = _fleet(config_path, selector, names, parallel)
    if force_unlock:
        held = unlock(fleet.sits_dir, force_unlock)
        info(f"removed lock {held.lock_id} ({held.command}, pid {held.pid} on {held.host})")
    try:
        fp = plan_fleet(fleet, build_target(fleet.config))
    except SitsError:
        fleet.close()
        raise
    if saved is not None:
        check_plan_file(saved, fp)
    if dry_run or not fp.plan.has_changes:
        fleet.close()
        if output == "json":
            emit_json(fp.plan.to_dict())
        else:
            _print_plan(fp.plan)
        if not dry_run:
            check_unchanged(fleet, fp)
        info("no changes" if not fp.plan.has_changes else "dry run: nothing was changed")
        return
    _execute(fleet, fp, "apply", output)


@click.command(
    epilog=examples(
        "sits-deployer rollback -f deploy.yaml",
        "sits-deployer rollback -f deploy.yaml --to 1.0.0",
        "sits-deployer rollback -f deploy.yaml --to 1.0.0 --device edge-a",
    )
)
@_fleet_options
@click.option("--to", "to_version", metavar="VERSION", help="Version to return to (default: the previous).")
@output_option
def rollback(
    config_path: Path,
    selector: tuple[str, ...],
    names: tuple[str, ...],
    parallel: int,
    to_version: str | None,
    output: str,
) -> None:
    """Return devices to an earlier version, as a NEW signed release (anti-rollback stays on)."""
    from deployer.push.fleet import plan_fleet, rollback_target

    fleet = _fleet(config_path, selector, names, parallel)
    try:
        target = rollback_target(fleet.config, to_version, fleet.facts())
        fp = plan_fleet(fleet, target, rollback=True)
    except SitsError:
        fleet.close()
        raise
    if not fp.plan.has_changes:
        fleet.close()
        info(f"every selected device already runs {target.version}")
        return
    _execute(fleet, fp, "rollback", output)


@click.command(
    epilog=examples(
        "sits-deployer status -f deploy.yaml", "sits-deployer status -f deploy.yaml --output json"
    )
)
@_fleet_options
@output_option
def status(
    config_path: Path, selector: tuple[str, ...], names: tuple[str, ...], parallel: int, output: str
) -> None:
    """Device, version, health, edge status, fallbacks in the last 5 minutes, last result."""
    from deployer.push.fleet import fleet_status

    fleet = _fleet(config_path, selector, names, parallel)
    try:
        rows = fleet_status(fleet)
    finally:
        fleet.close()
    if output == "json":
        emit_json(rows)
        return
    table = Table()
    columns = ("device", "version", "health", "edge_status", "fallbacks_5m", "agent", "last_result", "error")
    for column in columns:
        table.add_column(column.replace("_", " "))
    for row in rows:
        table.add_row(*("-" if row[c] is None or row[c] == "" else str(row[c]) for c in columns))
    console().print(table)


@click.command(
    epilog=examples(
        "sits-deployer logs edge-a -f deploy.yaml",
        "sits-deployer logs edge-a --since '10 min ago'",
        "sits-deployer logs edge-a --follow",
    )
)
@click.argument("device")
@click.option(
    "-f", "--file", "config_path", type=click.Path(path_type=Path, dir_okay=False), default="deploy.yaml"
)
@click.option("--since", help="journalctl --since (systemd devices), e.g. '10 min ago'.")
@click.option("--follow", is_flag=True, help="Keep printing new lines (Ctrl-C to stop).")
def logs(device: str, config_path: Path, since: str | None, follow: bool) -> None:
    """Print the agent's log of one device (journalctl -u sits-agent, or its log file)."""
    from deployer.push.bootstrap import log_command
    from deployer.push.facts import gather_facts

    fleet = _fleet(config_path, (), (device,), 1)
    site = fleet.sites[device]
    transport = fleet.transport(site)
    try:
        facts = gather_facts(site, transport)
        command = log_command(site, systemd=facts.systemd, since=since, follow=follow)
        result = transport.run(command, timeout=24 * 3600 if follow else 60)
    finally:
        fleet.close()
    sys.stdout.write(result.stdout)
    if not result.ok:
        raise SitsError(f"{device}: {command} failed: {result.stderr.strip()[-300:]}")
