"""Conventions every command shares: where output goes, verbosity, errors and exit codes.

Human messages go to stderr (rich, which honours NO_COLOR); data goes to stdout.
Exit codes: 0 ok, 1 failure, 2 usage (click's own), and for `plan --detailed-exitcode` 2 = changes.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from deployer.core.clikit import emit_json, examples, output_option, verbosity
from deployer.core.redact import redact

__all__ = ["console", "debug", "emit_json", "examples", "info", "output_option", "stdout", "verbosity"]

_stderr: Console | None = None
_stdout: Console | None = None


class _RedactingConsole(Console):
    """Redacts every string before rich lays it out: a table cell may wrap a secret over two
    lines, past what redacting the output stream (LazyGroup.invoke) catches."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(redact(text), **kwargs)


def console() -> Console:
    """The console for human-readable messages (stderr)."""
    global _stderr
    if _stderr is None:
        _stderr = _RedactingConsole(stderr=True, highlight=False, soft_wrap=True)
    return _stderr


def stdout() -> Console:
    """The console for data (tables) on stdout: `status | grep dev1` finds the device's row.

    Piped, it is wide enough that a table's columns are not squeezed into 80 characters.
    """
    global _stdout
    if _stdout is None:
        _stdout = Console(highlight=False, soft_wrap=False)
        if not _stdout.is_terminal:
            _stdout = Console(highlight=False, width=max(_stdout.width, 200))
    return _stdout


def info(message: str) -> None:
    """Print a progress or status line to stderr unless --quiet."""
    if verbosity() >= 0:
        console().print(message)


def debug(message: str) -> None:
    """Print a detail line to stderr only with -v."""
    if verbosity() >= 1:
        console().print(f"[dim]{message}[/dim]")
