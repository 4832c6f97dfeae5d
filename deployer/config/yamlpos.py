"""YAML loading that keeps the line and column of every key and value.

The document is composed into nodes (which carry marks) and turned into plain Python data here,
so that positions survive and problems the standard loader hides become findings: tabs in the
indentation, duplicate keys (YAML silently keeps the last), undefined or duplicate anchors, merge
keys that merge a non-mapping, and alias "bombs" that expand into huge documents.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from deployer.config.findings import FieldPath, Finding, format_path
from deployer.config.sourcemap import SourceMap

# A deploy.yaml has a few hundred nodes and a 4 MiB inventory (the loader's size limit) under a
# million; far beyond this is an alias bomb, not a fleet.
MAX_NODES = 1_000_000
# libyaml's parser when PyYAML has it (about 10x faster on a large inventory); same nodes and marks.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_MERGE_TAG = "tag:yaml.org,2002:merge"
_STR_TAG = "tag:yaml.org,2002:str"
_INDENT_TAB = re.compile(r"^[ ]*\t")


@dataclass
class YamlDocument:
    """The data of one YAML file, where each field sits, and the problems found reading it."""

    data: Any
    positions: SourceMap
    findings: list[Finding] = field(default_factory=list)


class _DocumentTooLarge(Exception):
    """Raised inside the walk when aliases expand the document past `MAX_NODES`."""


def load_yaml(text: str, file: str) -> YamlDocument:
    """Parse ``text`` (the contents of ``file``) into data plus positions, never raising."""
    positions = SourceMap(file)
    tabs = _tab_findings(text, file)
    if tabs:
        return YamlDocument(None, positions, tabs)
    try:
        try:
            data, walker = _compose(text, positions, _LOADER)
        except yaml.YAMLError:
            if _LOADER is yaml.SafeLoader:
                raise
            # Broken YAML: the pure-Python parser again, for its more precise messages.
            positions = SourceMap(file)
            data, walker = _compose(text, positions, yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        return YamlDocument(None, positions, [_syntax_finding(exc, file)])
    except yaml.YAMLError as exc:
        return YamlDocument(None, positions, [Finding(file, 1, 1, "<yaml>", f"invalid YAML: {exc}")])
    except _DocumentTooLarge:
        message = f"the document expands to more than {MAX_NODES} nodes through aliases"
        hint = "use fewer nested aliases (*name); this looks like an alias bomb"
        return YamlDocument(None, positions, [Finding(file, 1, 1, "<yaml>", message, hint)])
    return YamlDocument(data, positions, walker.findings)


def _compose(text: str, positions: SourceMap, loader_class: type) -> tuple[Any, _Walker]:
    """The data of `text` and the walker that built it. Raises yaml.YAMLError, _DocumentTooLarge."""
    loader = loader_class(text)
    walker = _Walker(loader, positions)
    try:
        node = loader.get_single_node()
        return (walker.build(node, (), None) if node is not None else None), walker
    finally:
        loader.dispose()


def _tab_findings(text: str, file: str) -> list[Finding]:
    """One finding per line indented with a tab (YAML allows only spaces there)."""
    findings = []
    for number, line in enumerate(text.splitlines(), start=1):
        match = _INDENT_TAB.match(line)
        if match:
            findings.append(
                Finding(
                    file,
                    number,
                    match.end(),
                    "<yaml>",
                    "tab character in indentation",
                    "YAML indents with spaces only; replace the tab with spaces",
                )
            )
    return findings


def _syntax_finding(exc: yaml.MarkedYAMLError, file: str) -> Finding:
    """Turn a PyYAML error into a finding at its problem mark, with a hint where we have one."""
    mark = exc.problem_mark or exc.context_mark
    line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    problem, context = exc.problem or "", exc.context or ""
    message, hint = f"invalid YAML: {problem}", None
    if "'\\t'" in problem:
        message, hint = "tab character in YAML", "YAML separates with spaces only; replace the tab"
    elif problem.startswith("found undefined alias"):
        name = problem.split("'")[1]
        message = f"undefined alias *{name}"
        hint = f"define the anchor &{name} before its first use, or fix the spelling"
    elif context.startswith("found duplicate anchor"):
        name = context.split("'")[1]
        first = exc.context_mark.line + 1 if exc.context_mark else "?"
        message = f"duplicate anchor &{name} (first defined at line {first})"
        hint = "give each anchor a unique name"
    elif "for merging" in problem:
        message = "a merge key (<<) must refer to a mapping or a list of mappings"
        hint = "merge an anchored mapping, for example  <<: *defaults"
    elif problem == "mapping values are not allowed here":
        hint = "check the indentation, and quote values that contain ': '"
    elif context.startswith("while parsing a flow"):
        hint = "quote values that contain { } [ ] , or ${...} inside [...] and {...}"
    elif context.startswith("expected a single document"):
        message = "more than one YAML document ('---') in the file"
        hint = "put the whole configuration in one document"
    elif problem.startswith("could not determine a constructor"):
        message = f"unsupported YAML tag: {problem.split('tag ')[-1]}"
        hint = "remove the tag; only plain YAML values are allowed"
    return Finding(file, line, column, "<yaml>", message, hint)


class _Walker:
    """Builds Python data from composed nodes, recording positions and duplicate keys."""

    def __init__(self, loader: yaml.SafeLoader | yaml.CSafeLoader, positions: SourceMap) -> None:
        self.loader = loader
        self.positions = positions
        self.findings: list[Finding] = []
        self._budget = MAX_NODES
        self._scanned: set[int] = set()

    def build(self, node: yaml.Node, path: FieldPath, key: yaml.Node | None) -> Any:
        self._budget -= 1
        if self._budget < 0:
            raise _DocumentTooLarge
        scalar = isinstance(node, yaml.ScalarNode)
        self.positions.add(path, _pos(key) if key is not None else None, _pos(node), scalar=scalar)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(child, (*path, i), None) for i, child in enumerate(node.value)]
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if node.tag == _STR_TAG:  # most values: the constructor would return the same text, slower
            return node.value
        return self.loader.construct_object(node, deep=True)

    def _mapping(self, node: yaml.MappingNode, path: FieldPath) -> dict[Any, Any]:
        if id(node) not in self._scanned:
            # Only the explicit keys, before merging: a key may legitimately override a merged one.
            self._scanned.add(id(node))
            self._report_duplicates(node, path)
            self.loader.flatten_mapping(node)
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = self._key(key_node)
            result[key] = self.build(value_node, (*path, key), key_node)
        return result

    def _report_duplicates(self, node: yaml.MappingNode, path: FieldPath) -> None:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self._key(key_node)
            if key in first_line:
                line, column = _pos(key_node)
                self.findings.append(
                    Finding(
                        self.positions.file,
                        line,
                        column,
                        format_path((*path, key)),
                        f"duplicate key '{key}' (first defined at line {first_line[key]})",
                        "remove one of them; YAML would silently keep only the last",
                    )
                )
            else:
                first_line[key] = _pos(key_node)[0]

    def _key(self, node: yaml.Node) -> str | int:
        if not isinstance(node, yaml.ScalarNode):
            raise yaml.MarkedYAMLError(
                problem="a mapping key must be a plain value", problem_mark=node.start_mark
            )
        key = self.loader.construct_object(node)
        # YAML 1.1 reads `on:`/`no:`/`1.5:` as bools/floats; a field path wants text or an index.
        return key if isinstance(key, str) or type(key) is int else str(key)


def _pos(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1
