"""`init`, `validate` and `schema`: the deploy.yaml commands. Thin: parse flags, call, print."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import cast

import click

from deployer.cli.common import console, emit_json, info, output_option
from deployer.core.fsutil import atomic_write


@click.command(
    epilog="Examples:\n\n  sits-deployer validate -f deploy.yaml\n\n"
    "  sits-deployer validate -f examples/fleet-ssh/deploy.yaml --output json\n\n"
    "Each problem is printed as file:line:column: field.path: message (hint).\n"
    "Exit status: 0 valid, 1 problems found, 2 usage error.",
)
@click.option(
    "-f",
    "--file",
    "file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=Path("deploy.yaml"),
    show_default=True,
    help="The deploy.yaml to check (its inventory is checked too).",
)
@output_option
@click.pass_context
def validate(ctx: click.Context, file: Path, output: str) -> None:
    """Check deploy.yaml and report every problem at once, with line and column.

    Beyond the schema: unique device names, hooks that exist and are executable, referenced
    files, keys that are EC P-256 PEM, selectors that match devices, strategy parameters that
    fit the fleet, and resources (and the model at its quantization) that fit each profile.
    """
    from deployer.config.loader import read_config

    result = read_config(file, os.environ)
    if output == "json":
        emit_json([finding.to_dict() for finding in result.findings])
    else:
        for finding in result.findings:
            console().print(str(finding), markup=False)
    if result.config is None:
        count = sum(f.is_error for f in result.findings)
        console().print(f"[red]{count} problem{'s' if count != 1 else ''}[/red] in {file}")
        ctx.exit(1)
    devices = len(result.config.fleet.devices)
    info(f"{file}: valid ({result.config.application}, {devices} device{'s' if devices != 1 else ''})")


@click.command(
    epilog="Examples:\n\n  sits-deployer init my-fleet\n\n  cd my-fleet && sits-deployer validate\n\n"
    "  sits-deployer init --force .",
)
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False), default=Path(), required=False)
@click.option("--force", is_flag=True, help="Overwrite files that exist already.")
@output_option
def init(directory: Path, force: bool, output: str) -> None:
    """Create a working project: deploy.yaml, inventory.yaml, a hook, keys/ and the schemas.

    Two local devices (directories under .sits/fleet/, each with a free port of this machine)
    and the builtin demo model. Signing is configured but init writes no key: make it with
    `sits-deployer keygen -o keys/release`, and the project validates, applies and serves.
    """
    from deployer.config.scaffold import scaffold_project

    written = scaffold_project(directory, force=force)
    if output == "json":
        emit_json([str(path) for path in written])
        return
    for path in written:
        info(f"  wrote {path}")
    info(f"next: cd {directory} && sits-deployer keygen -o keys/release && sits-deployer validate")


@click.command(
    epilog="Examples:\n\n  sits-deployer schema -o schemas/deploy.schema.json\n\n"
    "  sits-deployer schema --kind inventory -o schemas/inventory.schema.json\n\n"
    "  sits-deployer schema --check -o schemas/deploy.schema.json   # exit 1 when stale",
)
@click.option(
    "--kind",
    type=click.Choice(["deploy", "inventory"]),
    default="deploy",
    show_default=True,
    help="deploy.yaml, or an inventory file.",
)
@click.option(
    "-o",
    "--out",
    "out",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the schema to this file instead of stdout.",
)
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if --out differs.")
@click.pass_context
def schema(ctx: click.Context, kind: str, out: Path | None, check: bool) -> None:
    """Print (or write) the JSON Schema generated from the configuration models."""
    from deployer.config.schema import SchemaKind, render_schema

    text = render_schema(cast(SchemaKind, kind))
    if check:
        if out is None:
            raise click.UsageError("--check needs --out FILE to compare with")
        current = out.read_text(encoding="utf-8") if out.is_file() else None
        if current != text:
            console().print(f"[red]{out} is stale[/red]: run sits-deployer schema --kind {kind} -o {out}")
            ctx.exit(1)
        info(f"{out} is up to date")
        return
    if out is None:
        sys.stdout.write(text)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, text)
    info(f"wrote {out}")
