"""Conventions every command shares: where output goes, verbosity, errors and exit codes.

Human messages go to stderr (rich, which honours NO_COLOR); data goes to stdout.
Exit codes: 0 ok, 1 failure, 2 usage (click's own), and for `plan --detailed-exitcode` 2 = changes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console

F = TypeVar("F", bound=Callable[..., Any])

_stderr: Console | None = None


def console() -> Console:
    """The console for human-readable messages (stderr)."""
    global _stderr
    if _stderr is None:
        _stderr = Console(stderr=True, highlight=False, soft_wrap=True)
    return _stderr


def verbosity() -> int:
    """-1 quiet, 0 normal, 1+ verbose, as set by the root command's -v/-q."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx else None
    return int((root.obj or {}).get("verbosity", 0)) if root else 0


def info(message: str) -> None:
    """Print a progress or status line to stderr unless --quiet."""
    if verbosity() >= 0:
        console().print(message)


def debug(message: str) -> None:
    """Print a detail line to stderr only with -v."""
    if verbosity() >= 1:
        console().print(f"[dim]{message}[/dim]")


def emit_json(data: Any) -> None:
    """Write machine-readable output to stdout, one JSON document."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def output_option(func: F) -> F:
    """Add `--output text|json` to a command (passed as `output`)."""
    return click.option(
        "--output",
        "output",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="text for people (stderr), json for machines (stdout).",
    )(func)


def examples(*commands: str) -> str:
    """The `--help` epilog listing example command lines (click keeps \\b blocks unwrapped)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {c}" for c in commands)
