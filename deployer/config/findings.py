"""One problem found in a config file, located by file, line and column.

Every check and every schema error ends up as a `Finding`; `validate` prints them as
``file:line:column: field.path: message (hint)`` and `--output json` emits `to_dict()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PathPart = str | int
FieldPath = tuple[PathPart, ...]


def format_path(path: Sequence[PathPart]) -> str:
    """Render a field path the way users write it: ``fleet.devices[2].name``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "<root>"


@dataclass(frozen=True)
class Finding:
    """A problem at ``file:line:column`` (1-based) in field ``path``, with an optional remedy."""

    file: str
    line: int
    column: int
    path: str
    message: str
    hint: str | None = None
    # "warning": the config loads and validate passes, but a later command will need this fixed.
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        warning = "warning: " if self.severity == "warning" else ""
        text = f"{self.file}:{self.line}:{self.column}: {self.path}: {warning}{self.message}"
        return f"{text} ({self.hint})" if self.hint else text

    @property
    def is_error(self) -> bool:
        """Whether this finding makes the config invalid."""
        return self.severity == "error"

    def to_dict(self) -> dict[str, object]:
        """The finding as a JSON-ready mapping (the `--output json` element)."""
        return {
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "path": self.path,
            "message": self.message,
            "hint": self.hint,
            "severity": self.severity,
        }


def sort_findings(findings: Sequence[Finding]) -> list[Finding]:
    """Findings in reading order (file, line, column), duplicates removed."""
    unique = dict.fromkeys(findings)
    return sorted(unique, key=lambda f: (f.file, f.line, f.column, f.path, f.message))
