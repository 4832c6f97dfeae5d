"""`plan`, `apply`, `rollback`, `status`, `logs`, `down`, `gc`: thin wrappers over deployer.push, one
call each. Tables and JSON (data) go to stdout, progress and messages to stderr."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn
from rich.table import Table

from deployer.cli.common import console, emit_json, examples, info, output_option, stdout, verbosity
from deployer.config.quantity import format_rate, format_seconds
from deployer.errors import SitsError

if TYPE_CHECKING:
    from deployer.push.cost import RolloutCost
    from deployer.push.executor import MeterFactory, RolloutReport
    from deployer.push.fleet import FleetPlan, FleetSession
    from deployer.push.meter import TransferStatus
    from deployer.push.plan import Plan
    from deployer.transport.base import Progress as OnBytes

F = TypeVar("F", bound=Callable[..., Any])
PROGRESS_MIN_BYTES = 1 << 20  # smaller uploads (units, settings, manifests) show no progress
LINE_EVERY_S = 10.0  # without a terminal: a line per device this often during a long upload
# The checkout the agent's wheel is built from (agent/), for bootstrap and the plan's wheel list.
_PROJECT = Path(__file__).resolve().parents[2]


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


def _fleet(
    config_path: Path,
    selector: tuple[str, ...],
    names: tuple[str, ...],
    parallel: int,
    *,
    secrets: bool = False,
) -> FleetSession:
    """The selected fleet; `secrets` for the commands that sign (apply, rollback): only they need
    the signing key's passphrase."""
    from deployer.config import load_config
    from deployer.push.fleet import FleetSession

    return FleetSession.select(
        load_config(config_path, secrets=secrets),
        selector=_selector(selector),
        names=names,
        parallel=parallel,
    )


def _plan_table(plan: Plan, cost: RolloutCost) -> Table:
    from deployer.config.quantity import format_bytes, format_rate, format_seconds

    artifact = plan.target_sha256[:12] or "not built"
    table = Table(title=f"plan: {plan.target_version} ({artifact})", title_justify="left")
    for column in ("device", "arch", "status", "from", "to", "steps", "bytes", "time", "reason"):
        table.add_column(column)
    for d in plan.devices:
        base = d.steps_of()
        time = (
            "-"
            if d.seconds is None or d.rate is None
            else f"{format_seconds(d.seconds)} at {format_rate(d.rate)}"
        )
        table.add_row(
            d.device,
            d.arch or "-",
            d.status.value,
            d.from_version or "-",
            d.to_version,
            ", ".join(s.kind.value for s in base) or "-",
            f"{sum(s.bytes for s in base):,}",
            time,
            escape(d.reason if base or not d.adapters else "adapters only"),
        )
        for change in d.adapters:  # each adapter on a line of its own: released, rolled back alone
            steps = d.steps_of(change.name)
            table.add_row(
                f"{d.device} adapter {change.name}",
                d.arch or "-",
                d.status.value,
                change.from_version or "-",
                change.to_version,
                ", ".join(s.kind.value for s in steps),
                f"{sum(s.bytes for s in steps):,}",
                "",
                escape(steps[0].reason),
            )
    notes = [f"total {format_bytes(cost.total_bytes)}, rollout about {format_seconds(cost.seconds)}"]
    if cost.full_downloads:
        notes.append(f"full artifact to {', '.join(cost.full_downloads)}")
    if cost.uncapped:
        notes.append(f"no bandwidth.rate for {', '.join(cost.uncapped)}: counted as instant")
    table.caption, table.caption_justify = escape("; ".join(notes)), "left"
    return table


def _print_plan(fleet: FleetSession, plan: Plan, output: str) -> None:
    """The plan on stdout: JSON, or the table and, with -v, every step's actions under it (what
    apply runs, in order); both with the rollout's cost on the devices' links."""
    from deployer.push.cost import rollout_cost
    from deployer.push.plan import DeviceStatus
    from deployer.push.rollout import make_waves

    config = fleet.config
    changing = [d.device for d in plan.devices if d.status is DeviceStatus.CHANGE]
    cost = rollout_cost(
        plan,
        make_waves(config.strategy, changing),
        parallel=fleet.parallel,
        push_total=config.bandwidth.push_total if config.bandwidth else None,
    )
    if output == "json":
        emit_json({**plan.to_dict(), "cost": cost.to_dict()})
        return
    stdout().print(_plan_table(plan, cost))
    if verbosity() < 1:
        return
    for d in plan.devices:
        for step in d.steps:
            stdout().print(f"{d.device}  {step.kind.value}: {step.reason}", markup=False)
            for action in step.actions:
                stdout().print(f"    {action.describe()}", markup=False)


def _drift(fleet: FleetSession, plan: Plan, *, signing: bool) -> SitsError | None:
    """What a real apply of `plan` would refuse or fail on, or None; `signing`: also a missing
    signing key (not for a drift check, which runs where no key is)."""
    from deployer.push.fleet import apply_failures, apply_refusal

    refusal = apply_refusal(fleet.config, plan, signing=signing)
    if refusal is not None:
        return SitsError(f"a real apply would refuse: {refusal.message}", hint=refusal.hint)
    failures = apply_failures(plan)
    if failures is not None:
        return SitsError(f"a real apply would fail: {failures.message}", hint=failures.hint)
    return None


def _report_table(report: RolloutReport) -> Table:
    table = Table(title=f"{report.action} {report.target_version} ({report.strategy})", title_justify="left")
    for column in ("device", "result", "version", "phase", "sent", "error"):
        table.add_column(column)
    for r in report.results:
        table.add_row(
            r.device, r.status, r.version or "-", r.phase, f"{r.bytes_sent:,}", escape((r.error or "")[:160])
        )
    return table


class _Board:
    """Live progress per device and phase on stderr (rich), fed from worker threads: a table of
    phases, and under it a bar with rate and ETA for each long upload."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[str, str]] = {}
        self.lock = threading.Lock()
        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TextColumn("{task.fields[rate]}"),
            TextColumn("{task.fields[eta]}"),
            console=console(),
        )
        self._tasks: dict[tuple[str, str], TaskID] = {}
        self.live = Live(self._render(), console=console(), refresh_per_second=4, transient=False)

    def update(self, device: str, phase: str, detail: str) -> None:
        with self.lock:
            self.rows[device] = (phase, detail[:80])
            self.live.update(self._render())

    def transfer(self, device: str, status: TransferStatus) -> None:
        """Draw one upload's bar: bytes, the rate over the last seconds, the time left."""
        with self.lock:
            key = (device, status.name)
            if key not in self._tasks:
                self._tasks[key] = self.bars.add_task(f"{device} {status.name}", total=status.total)
            self.bars.update(
                self._tasks[key],
                completed=status.done,
                rate=format_rate(status.rate) if status.rate else "",
                eta=f"ETA {format_seconds(status.eta_s)}"
                if status.eta_s and status.done < status.total
                else "",
            )
            self.live.update(self._render())

    def _render(self) -> Group:
        table = Table(show_header=True, box=None)
        table.add_column("device")
        table.add_column("phase")
        table.add_column("detail")
        for device, (phase, detail) in sorted(self.rows.items()):
            table.add_row(device, phase, escape(detail))
        return Group(table, self.bars) if self._tasks else Group(table)


def _on_phase(board: _Board | None) -> Callable[[str, str, str], None]:
    """Progress from the executor's worker threads: the live board on a terminal, else one line per
    phase; a hook's output (phase "<hook> output") only with -v. The verbosity is read here: the
    click context is not visible in the worker threads."""
    level = verbosity()

    def on_phase(device: str, phase: str, detail: str) -> None:
        if phase.endswith(" output"):
            if level >= 1:
                console().print(f"{device}: {phase}:\n{detail.rstrip()}", markup=False)
        elif board is not None:
            board.update(device, phase, detail)
        elif level >= 0:
            console().print(f"{device}: {phase} {detail}".rstrip(), markup=False)

    return on_phase


def _meter(board: _Board | None) -> MeterFactory | None:
    """Progress of each upload of PROGRESS_MIN_BYTES or more: a bar on the board, else (when not
    quiet) a line per device every LINE_EVERY_S seconds and at the end, with rate and ETA."""
    from deployer.push.meter import TransferMeter

    if board is None and verbosity() < 0:
        return None

    def meter(device: str, name: str) -> OnBytes:
        def show(status: TransferStatus) -> None:
            if status.total < PROGRESS_MIN_BYTES:
                return
            if board is not None:
                board.transfer(device, status)
            else:
                console().print(f"{device}: send {status.describe()}", markup=False)

        return TransferMeter(name, show, every_s=0.25 if board is not None else LINE_EVERY_S)

    return meter


def _execute(fleet: FleetSession, fp: FleetPlan, action: str, output: str) -> None:
    from deployer.push.fleet import apply_plan

    show = output == "text" and verbosity() >= 0 and console().is_terminal
    board = _Board() if show else None
    on_phase = _on_phase(board)
    run = functools.partial(
        apply_plan, fleet, fp, action=action, on_phase=on_phase, meter=_meter(board), project_dir=_PROJECT
    )
    try:
        if board:
            with board.live:
                report = run()
        else:
            report = run()
    finally:
        fleet.close()
    if output == "json":
        emit_json(report.to_dict())
    else:
        stdout().print(_report_table(report))
        if report.halted:
            console().print(f"[red]halted:[/red] {escape(report.halted)}")
    if report.exit_code:
        sys.exit(report.exit_code)


@click.command(
    epilog=examples(
        "sits-deployer plan -f deploy.yaml",
        "sits-deployer plan -f deploy.yaml --output json",
        "sits-deployer plan -f deploy.yaml -o plan.json",
        "sits-deployer plan -f deploy.yaml --detailed-exitcode   # 0 none, 2 drift, 1 apply would refuse",
    )
)
@_fleet_options
@click.option(
    "-o", "--out", type=click.Path(path_type=Path, dir_okay=False), help="Also write the plan here."
)
@click.option(
    "--detailed-exitcode",
    is_flag=True,
    help="Exit 0 when the fleet matches, 2 when it drifted, 1 when apply would refuse.",
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
    """Show what apply would change on each device, and why. Changes nothing, builds nothing, signs
    nothing and needs no passphrase: an artifact not built yet is a pending change.

    With --detailed-exitcode: 0 the fleet matches, 2 it does not (changes pending, or devices
    offline under strategy.offline: skip), 1 apply would refuse or fail (devices offline under
    offline: fail, devices that cannot take the update) or an error.
    """
    from deployer.push.fleet import plan_fleet, write_plan_file
    from deployer.release.desired import built_target

    fleet = _fleet(config_path, selector, names, parallel)
    try:
        fp = plan_fleet(fleet, built_target(fleet.config), project_dir=_PROJECT)
    finally:
        fleet.close()
    _print_plan(fleet, fp.plan, output)
    if out is not None:
        fp.built_target()  # a plan made before the build cannot be applied: no file for it
        write_plan_file(fp, config_path, out, _selector(selector) or {}, names)
    problem = _drift(fleet, fp.plan, signing=False)
    if problem is not None:
        console().print(f"[yellow]warning:[/yellow] {escape(problem.message)}")
    if detailed_exitcode and problem is not None:
        sys.exit(1)
    if detailed_exitcode and not fp.plan.converged:
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
@click.option("--dry-run", is_flag=True, help="Plan as `plan` does, and exit 1 if a real apply would refuse.")
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
    """Make the fleet match deploy.yaml (or execute a saved plan.json), by the configured strategy.

    --dry-run plans as `plan` does (it builds and signs nothing) and exits 1 when a real apply
    would refuse or fail (devices offline under strategy.offline: fail, devices that cannot take
    the update, no signing key), else 0.
    """
    from deployer.cli.build_cmds import build_progress
    from deployer.push.fleet import (
        check_plan_config,
        check_plan_file,
        check_unchanged,
        load_plan_file,
        plan_fleet,
    )
    from deployer.push.state import force_unlock as unlock
    from deployer.release.desired import build_target, built_target

    if plan_file is not None and plan_file.suffix in {".yaml", ".yml"}:
        raise click.UsageError(
            f"{plan_file} is a config, not a plan file: use `sits-deployer apply -f {plan_file}`"
        )
    saved = load_plan_file(plan_file) if plan_file else None
    if saved is not None:
        config_path, selector = Path(saved["config"]), tuple(f"{k}={v}" for k, v in saved["selector"].items())
        names = tuple(saved["devices"])
        check_plan_config(saved)  # before any facts or build: a stale file fails fast
    fleet = _fleet(config_path, selector, names, parallel, secrets=not dry_run)
    if force_unlock and not dry_run:
        held = unlock(fleet.sits_dir, force_unlock)
        info(f"removed lock {held.lock_id} ({held.command}, pid {held.pid} on {held.host})")
    try:
        # A real apply builds first when the artifact is not cached (with build's progress lines).
        progress = build_progress(output)
        target = built_target(fleet.config) if dry_run else build_target(fleet.config, progress=progress)
        fp = plan_fleet(fleet, target, project_dir=_PROJECT, cross_build=not dry_run)
    except SitsError:
        fleet.close()
        raise
    if saved is not None:
        check_plan_file(saved, fp)
    if dry_run or not fp.plan.has_changes:
        fleet.close()
        _print_plan(fleet, fp.plan, output)
        problem = _drift(fleet, fp.plan, signing=True) if dry_run else None
        if problem is not None:
            raise SitsError(f"dry run: {problem.message}", hint=problem.hint)
        if not dry_run:
            check_unchanged(fleet, fp)
        info("dry run: nothing was changed" if fp.plan.has_changes else "no changes")
        return
    _execute(fleet, fp, "apply", output)


@click.command(
    epilog=examples(
        "sits-deployer rollback -f deploy.yaml",
        "sits-deployer rollback -f deploy.yaml --to 1.0.0",
        "sits-deployer rollback -f deploy.yaml --to 1.0.0 --device edge-a",
        "sits-deployer rollback -f deploy.yaml --adapter summarise",
    )
)
@_fleet_options
@click.option("--to", "to_version", metavar="VERSION", help="Version to return to (default: the previous).")
@click.option(
    "--adapter",
    metavar="NAME",
    help="Roll back only this LoRA adapter (under the strategy), the base untouched.",
)
@output_option
def rollback(
    config_path: Path,
    selector: tuple[str, ...],
    names: tuple[str, ...],
    parallel: int,
    to_version: str | None,
    adapter: str | None,
    output: str,
) -> None:
    """Return devices to an earlier version, as a NEW signed release (anti-rollback stays on).

    A device that still has that version on disk gets only the signed manifest: a pointer switch.
    With --adapter, only that adapter returns to an earlier version, as a new adapter release.
    """
    from deployer.push.fleet import adapter_rollback_target, plan_fleet, rollback_target
    from deployer.release.desired import built_target

    fleet = _fleet(config_path, selector, names, parallel, secrets=True)
    try:
        if adapter is None:
            target = rollback_target(fleet.config, to_version, fleet.facts())
            fp = plan_fleet(fleet, target, rollback=True)
        else:
            target = adapter_rollback_target(fleet.config, adapter, to_version, fleet.facts())
            fp = plan_fleet(fleet, built_target(fleet.config), adapter_rollback=(adapter, target))
    except SitsError:
        fleet.close()
        raise
    if not fp.plan.has_changes:
        fleet.close()
        what = f"adapter {adapter} " if adapter else ""
        info(f"every selected device already runs {what}{target.version}")
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
    """Device, version, health, edge status, fallbacks in the last 5 minutes and last result of each
    device (a table on stdout). No passphrase."""
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
    columns = (
        "device",
        "arch",
        "version",
        "health",
        "edge_status",
        "fallbacks_5m",
        "agent",
        "last_result",
        "error",
    )
    for column in columns:
        table.add_column(column.replace("_", " "))
    for row in rows:
        table.add_row(*("-" if row[c] is None or row[c] == "" else str(row[c]) for c in columns))
    stdout().print(table)


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
    """Print the agent's log of one device (journalctl -u sits-agent, or its log file); --follow
    streams new lines as they are written. No passphrase."""
    from deployer.push.bootstrap import log_command
    from deployer.push.facts import gather_facts

    fleet = _fleet(config_path, (), (device,), 1)
    site = fleet.sites[device]
    transport = fleet.transport(site)
    try:
        facts = gather_facts(site, transport)
        if not facts.reachable:
            raise SitsError(f"{device} is offline: {facts.error}")
        command = log_command(site, systemd=facts.systemd, since=since, follow=follow)
        if follow:

            def write(text: str) -> None:
                sys.stdout.write(text)
                sys.stdout.flush()

            rc = transport.stream(command, write)
            if rc != 0:
                raise SitsError(f"{device}: {command} exited {rc}")
            return
        result = transport.run(command, timeout=60)
    finally:
        fleet.close()
    sys.stdout.write(result.stdout)
    if not result.ok:
        raise SitsError(f"{device}: {command} failed: {result.stderr.strip()[-300:]}")


@click.command(
    epilog=examples(
        "sits-deployer down -f deploy.yaml",
        "sits-deployer down -f deploy.yaml --device dev2",
    )
)
@_fleet_options
@output_option
def down(
    config_path: Path, selector: tuple[str, ...], names: tuple[str, ...], parallel: int, output: str
) -> None:
    """Stop the agents of the selected devices (systemd units, or the local background agents).

    Installed versions stay on the devices; the next apply starts the agents again. No passphrase.
    """
    from deployer.push.lifecycle import stop_fleet

    fleet = _fleet(config_path, selector, names, parallel)
    try:
        results = stop_fleet(fleet)
    finally:
        fleet.close()
    if output == "json":
        emit_json([r.__dict__ for r in results])
    else:
        table = Table()
        for column in ("device", "result", "detail"):
            table.add_column(column)
        for r in results:
            table.add_row(r.device, r.status, r.detail)
        stdout().print(table)
    if any(r.status == "failed" for r in results):
        sys.exit(1)


@click.command(
    epilog=examples(
        "sits-deployer gc -f deploy.yaml",
        "sits-deployer gc -f deploy.yaml --keep 1",
    )
)
@click.option(
    "-f", "--file", "config_path", type=click.Path(path_type=Path, dir_okay=False), default="deploy.yaml"
)
@click.option(
    "--keep", default=2, show_default=True, type=click.IntRange(min=0), help="Released versions to keep."
)
@output_option
def gc(config_path: Path, keep: int, output: str) -> None:
    """Delete controller artifacts and patches (.sits/) that no device runs, that deploy.yaml does not
    name, and that are not among the last --keep released versions. Needs every device reachable."""
    from deployer.push.lifecycle import collect_store

    fleet = _fleet(config_path, (), (), 4)
    try:
        facts = fleet.facts()
    finally:
        fleet.close()
    offline = [f.name for f in facts if not f.reachable]
    if offline:
        raise SitsError(
            f"cannot tell what {', '.join(offline)} run(s): nothing was deleted",
            hint="bring the devices back and run gc again",
        )
    removed = collect_store(fleet.config, [f.model_sha256 for f in facts if f.model_sha256], keep)
    if output == "json":
        emit_json([str(p) for p in removed])
    for path in removed:
        info(f"removed {path}")
    info(f"{len(removed)} item(s) removed")
