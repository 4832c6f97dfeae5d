"""Where each field of a config came from: file, line and column of its key and of its value.

A `SourceMap` is keyed by field path (``("fleet", "devices", 0, "name")``). Devices read from an
inventory file are grafted in under their place in the merged config but keep their own file and
their own path for display, so a finding points at the file the user has to edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deployer.config.findings import FieldPath, Finding, format_path


@dataclass(frozen=True)
class Mark:
    """A 1-based position in ``file``; ``display`` is the field path as written in that file."""

    file: str
    line: int
    column: int
    display: FieldPath


@dataclass
class SourceMap:
    """Positions of keys and values by field path, for one config and its inventory."""

    file: str
    keys: dict[FieldPath, Mark] = field(default_factory=dict)
    values: dict[FieldPath, Mark] = field(default_factory=dict)
    scalars: set[FieldPath] = field(default_factory=set)

    def add(
        self, path: FieldPath, key: tuple[int, int] | None, value: tuple[int, int], *, scalar: bool
    ) -> None:
        """Record the 1-based (line, column) of a field's key (if it has one) and of its value."""
        if key is not None:
            self.keys[path] = Mark(self.file, key[0], key[1], path)
        self.values[path] = Mark(self.file, value[0], value[1], path)
        if scalar:
            self.scalars.add(path)

    def graft_items(self, other: SourceMap, source: FieldPath, target: FieldPath, offset: int) -> None:
        """Copy the marks of ``other``'s list items ``source + (i, ...)`` to ``target + (offset + i,
        ...)`` in this map, for every item at once (one pass: an inventory has thousands)."""
        n = len(source)

        def moved(path: FieldPath) -> FieldPath | None:
            index = path[n] if len(path) > n and path[:n] == source else None
            if not isinstance(index, int):
                return None
            return (*target, offset + index, *path[n + 1 :])

        for own, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for path, mark in theirs.items():
                if (new := moved(path)) is not None:
                    own[new] = mark
        for path in other.scalars:
            if (new := moved(path)) is not None:
                self.scalars.add(new)

    def locate(self, path: FieldPath, *, key: bool = False) -> tuple[Mark, FieldPath]:
        """The mark of ``path`` (its key when ``key``), or of its nearest located ancestor.

        Returns the mark and the part of ``path`` below it, which the display path gets appended.
        A missing field is located at its parent's key, which is where the user has to add it;
        a field of a shorthand scalar (``strategy: canary`` for its ``type``) at that scalar.
        """
        for depth in range(len(path), -1, -1):
            prefix = path[:depth]
            at_key = key or (depth < len(path) and prefix not in self.scalars)
            preferred = self.keys if at_key else self.values
            mark = preferred.get(prefix) or self.values.get(prefix) or self.keys.get(prefix)
            if mark is not None:
                return mark, path[depth:]
        return Mark(self.file, 1, 1, ()), path

    def finding(
        self, path: FieldPath, message: str, hint: str | None = None, *, key: bool = False
    ) -> Finding:
        """A finding located at ``path`` (see `locate`)."""
        mark, rest = self.locate(path, key=key)
        return Finding(mark.file, mark.line, mark.column, format_path(mark.display + rest), message, hint)
