"""How a build reports progress: a small protocol, a silent default and a rich progress bar.

The pipeline only calls these methods; the CLI decides whether anything is drawn.
"""

from __future__ import annotations

from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)


class BuildProgress(Protocol):
    """Receives build events. Every method must be cheap; none may raise."""

    def stage(self, text: str) -> None:
        """A new phase started (hashing, quantizing, quality gate, ...)."""

    def start_tensors(self, total: int, total_bytes: int) -> None:
        """Quantization of `total` tensors (`total_bytes` of source data) begins."""

    def tensor_done(self, name: str, nbytes: int) -> None:
        """One source tensor (`nbytes` of source data) was quantized and written."""

    def close(self) -> None:
        """The build ended (successfully or not)."""


class SilentProgress:
    """Reports nothing: the default for library use and tests."""

    def stage(self, text: str) -> None:
        """Ignored."""

    def start_tensors(self, total: int, total_bytes: int) -> None:
        """Ignored."""

    def tensor_done(self, name: str, nbytes: int) -> None:
        """Ignored."""

    def close(self) -> None:
        """Ignored."""


class RichProgress:
    """A progress bar over the source bytes, advanced once per tensor, on `console`."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[count]}"),
            TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[tensor]}"),
            console=console,
            transient=True,
        )
        self._task: TaskID | None = None
        self._done = 0
        self._total = 0

    def stage(self, text: str) -> None:
        """Print the phase on its own line."""
        self._console.print(f"[dim]{text}[/dim]")

    def start_tensors(self, total: int, total_bytes: int) -> None:
        """Show the bar."""
        self._total = total
        self._progress.start()
        self._task = self._progress.add_task("quantizing", total=total_bytes, tensor="", count=f"0/{total}")

    def tensor_done(self, name: str, nbytes: int) -> None:
        """Advance the bar by one tensor."""
        if self._task is not None:
            self._done += 1
            count = f"{self._done}/{self._total}"
            self._progress.update(self._task, advance=nbytes, tensor=name, count=count)

    def close(self) -> None:
        """Remove the bar."""
        self._progress.stop()
