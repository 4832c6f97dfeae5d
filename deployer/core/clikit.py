"""Command-line conventions both CLIs share, without rich (the device agent does not install it).

Human messages go to stderr, data to stdout; -v/-q live on the root command's context object.
`sits-deployer` prints through rich on top of these (deployer/cli/common.py); `sits-agent` prints
plain text, since a device journal has no terminal to colour.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from deployer.core.redact import redact, redacted_json
from deployer.errors import SitsError

__all__ = ["emit_json", "examples", "output_option", "plain_error", "verbosity"]

F = TypeVar("F", bound=Callable[..., Any])


def verbosity() -> int:
    """-1 quiet, 0 normal, 1+ verbose, as set by the root command's -v/-q."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx else None
    return int((root.obj or {}).get("verbosity", 0)) if root else 0


def emit_json(data: Any) -> None:
    """Write machine-readable output to stdout, one JSON document."""
    sys.stdout.write(redacted_json(data, indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()


def output_option(func: F) -> F:
    """Add `--output text|json` to a command (passed as `output`)."""
    return click.option(
        "--output",
        "output",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="text for people, json for machines (one document on stdout).",
    )(func)


def examples(*commands: str) -> str:
    """The `--help` epilog listing example command lines (click keeps \\b blocks unwrapped)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {c}" for c in commands)


def plain_error(exc: SitsError) -> None:
    """Print an error and its hint to stderr as plain text, never a traceback."""
    click.echo(f"error: {redact(exc.message)}", err=True)
    if exc.hint:
        click.echo(f"hint: {redact(exc.hint)}", err=True)
